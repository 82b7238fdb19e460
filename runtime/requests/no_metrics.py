"""What the hub observes when no ``/metrics`` endpoint was asked for: every observation free.

The hub reports a call's boundaries (refused, admitted, first output, a
choice's end, the call's end) to whatever metrics it is given
(``runtime/context/metrics.py``'s ``Metrics``, which sits above the request
shell); without one, to this.
"""

from __future__ import annotations


class NoMetrics:
    """What the hub talks to when no endpoint was asked for: every call is free."""

    def refused(self, reason: str, code: str) -> None: ...
    def internal_error(self, rpc: str) -> None: ...
    def admitted(self, prompt_tokens: int, choices: int) -> None: ...
    def first_output(self, seconds: float) -> None: ...
    def choice_done(self, finish_reason, tokens_sent, cached_tokens, mean_gap_s) -> None: ...
    def call_ended(self, seconds: float, error_code: str | None) -> None: ...
