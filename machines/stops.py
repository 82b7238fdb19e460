"""Stop strings, matched by the servicer on detokenized text (the engine does not).

A ``StopMatcher`` follows one choice's output with the tokenizer's streaming
decoder (``tokenizers.decoders.DecodeStream``: incremental, UTF-8 safe), and
feeds each new piece of text, and only that, to one Aho–Corasick automaton
over the call's stop strings (``StopAutomaton``, built once per call at
admission and shared by its choices; each choice keeps only its own state).
So a token costs O(its new text), amortized, whatever the number or length
of the stop strings: no legal stop set can make the loop that fans engine
frames out to every call slow for the others.

When a stop string completes inside token t, the choice ends with
``finish_reason "stop"`` and ``matched_stop_str``; the tokens up to and
including t are kept (the router cuts the text at the stop string itself), the
rest of the delta is dropped, and the hub aborts the engine request. When
several stop strings complete inside the same token, the one listed first in
the request is the one reported (as the former scan over the stop list did).

Why a hand-written automaton: the well-kept library (``pyahocorasick``)
searches whole strings and keeps no state between calls, so a stop string
split across two tokens would need the text around the boundary searched
again on every token, which is O(longest stop) per token again. The automaton
below is the textbook one (a trie with failure links, Aho & Corasick 1975),
~50 lines, and its work is counted (``steps``) so tests can assert the bound.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

# No stop string completes in a state with this "first stop" index.
_NONE = 1 << 62
# Bits of a goto key that hold the code point (Unicode needs 21).
_SHIFT = 21


class StopAutomaton:
    """Aho–Corasick over a call's stop strings (code points); immutable once built.

    ``goto[s << 21 | ord(c)]``: the trie's edge out of state s on c (one flat
    dict of int keys: about half the memory of a dict per state);
    ``fail[s]``: the state of the longest proper suffix of s's text that is
    also a trie prefix; ``first[s]``: the smallest list index of any stop
    string that ends at s's text (its own, or one reached through failure
    links), ``_NONE`` if none. Building costs O(total length of the stop
    strings) time and memory (about 100 bytes per character at most).
    """

    __slots__ = ("stops", "goto", "fail", "first")

    def __init__(self, stops: tuple[str, ...]) -> None:
        if not stops or any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = stops
        goto: dict[int, int] = {}
        children: list[list[tuple[int, int]]] = [[]]  # (code point, child) per state, for the build only
        first = [_NONE]
        for index, stop in enumerate(stops):
            state = 0
            for char in stop:
                key = state << _SHIFT | ord(char)
                nxt = goto.get(key)
                if nxt is None:
                    nxt = goto[key] = len(children)
                    children[state].append((ord(char), nxt))
                    children.append([])
                    first.append(_NONE)
                state = nxt
            first[state] = min(first[state], index)
        fail = [0] * len(children)
        queue = [child for _, child in children[0]]  # depth 1 fails to the root
        for state in queue:  # breadth first: a state's fail link is set before its children's
            for code, child in children[state]:
                f = fail[state]
                while f and (f << _SHIFT | code) not in goto:
                    f = fail[f]
                fail[child] = goto.get(f << _SHIFT | code, 0)
                first[child] = min(first[child], first[fail[child]])
                queue.append(child)
        self.goto = goto
        self.fail = fail
        self.first = first


class StopMatcher:
    """One choice's stop-string state: its decoder and its place in the automaton."""

    __slots__ = ("automaton", "tokenizer", "decoder", "state", "steps", "chars")

    def __init__(self, stops: tuple[str, ...] | StopAutomaton, tokenizer, skip_special_tokens: bool) -> None:
        self.automaton = stops if isinstance(stops, StopAutomaton) else StopAutomaton(stops)
        self.tokenizer = tokenizer
        self.decoder = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.state = 0
        # Automaton transitions taken, failure links included: at most twice the
        # characters fed (each character deepens the state by at most one, each
        # failure link makes it shallower), whatever the stop set.
        self.steps = 0
        self.chars = 0  # characters of text fed

    @property
    def stops(self) -> tuple[str, ...]:
        return self.automaton.stops

    def feed(self, tokens: list[int]) -> tuple[list[int], str | None]:
        """Feed new tokens; returns (tokens to keep, matched stop string or None)."""
        for position, token in enumerate(tokens):
            piece = self.decoder.step(self.tokenizer, token)
            if piece:
                matched = self.feed_text(piece)
                if matched is not None:
                    return tokens[: position + 1], matched
        return tokens, None

    def feed_text(self, piece: str) -> str | None:
        """Advance over ``piece``; the first-listed stop string that ends inside it, if any."""
        automaton = self.automaton
        goto, fail, first = automaton.goto, automaton.fail, automaton.first
        state = self.state
        steps = 0
        best = _NONE
        for char in piece:
            code = ord(char)
            while True:
                steps += 1
                nxt = goto.get(state << _SHIFT | code)
                if nxt is not None:
                    state = nxt
                    break
                if state == 0:
                    break
                state = fail[state]
            if first[state] < best:
                best = first[state]
        self.state = state
        self.steps += steps
        self.chars += len(piece)
        return None if best == _NONE else automaton.stops[best]
