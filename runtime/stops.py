"""Stop strings, matched by the servicer on detokenized text (the engine does not).

A ``StopMatcher`` follows one choice's output with the tokenizer's streaming
decoder (``tokenizers.decoders.DecodeStream``: incremental, UTF-8 safe), and
looks for any stop string only in the text that the new token could have
completed, so matching is O(new text), not O(output).

When a stop string completes inside token t, the choice ends with
``finish_reason "stop"`` and ``matched_stop_str``; the tokens up to and
including t are kept (the router cuts the text at the stop string itself), the
rest of the delta is dropped, and the hub aborts the engine request.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class StopMatcher:
    __slots__ = ("stops", "tokenizer", "decoder", "text", "longest")

    def __init__(self, stops: tuple[str, ...], tokenizer, skip_special_tokens: bool) -> None:
        self.stops = stops
        self.tokenizer = tokenizer
        self.decoder = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.text = ""
        self.longest = max(len(s) for s in stops)

    def feed(self, tokens: list[int]) -> tuple[list[int], str | None]:
        """Feed new tokens; returns (tokens to keep, matched stop string or None)."""
        for position, token in enumerate(tokens):
            piece = self.decoder.step(self.tokenizer, token)
            if not piece:
                continue
            start = max(0, len(self.text) - self.longest + 1)
            self.text += piece
            window = self.text[start:]
            for stop in self.stops:
                if stop in window:
                    return tokens[: position + 1], stop
        return tokens, None
