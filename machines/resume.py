"""Resuming open streams after an engine restart: the policy, the restart budget, and what is re-sent.

When the engine dies with restarts on (``--engine-restarts N``), the link
starts it again and each open request is re-submitted as its prompt plus
the tokens it already streamed (docs/resume.md). This module decides, with
no I/O and no clock (``now`` is an argument):

- ``RestartBudget``: whether a crash may be followed by a restart (at most
  ``restarts_max`` crashes within ``window_s``; the next one fails the link
  as a crash always did);
- ``unresumable``: why one engine request cannot be continued exactly on a
  fresh engine (None when it can): a PD decode leg whose KV came from a
  prefill worker, media beyond ``media_items_max``, a grammar or penalties
  that see the generated tokens differently once they are prompt;
- ``continuation``: the engine request that continues one: the prompt plus
  the generated tokens, ``max_tokens`` and ``min_tokens`` reduced by their
  count, the prompt's logprobs not asked again once they were delivered.

What stays with the servicer and needs nothing here: stop strings (the
matcher is the call's own, it keeps its place), logprobs of the tokens to
come, ``n > 1`` (each choice is its own engine request; the finished ones
are not re-sent).

Rules: one resume per request (``RESUMES_MAX``): a request in flight at two
crashes is failed, not re-sent a third time; every bound is a setting.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import msgspec

from enginelink.wire.engine import GenerateSpec

# A request is re-submitted at most this many times: one in flight at a second crash fails.
RESUMES_MAX: Final = 1
ENGINE_RESTARTS_DEFAULT: Final = 0  # off: an engine death fails every open call and exits 1, as before
ENGINE_RESTARTS_MAX: Final = 100  # the budget's own bound (its memory: one time per crash in the window)
RESTART_WINDOW_S_DEFAULT: Final = 600.0
RESUME_TIMEOUT_S_DEFAULT: Final = 300.0
# Media items a request may carry and still be re-submitted (their features are re-sent and recomputed).
RESUME_MEDIA_ITEMS_MAX_DEFAULT: Final = 4


@dataclass(frozen=True)
class ResumePolicy:
    """``--engine-restarts`` / ``--engine-restart-window`` / ``--resume-timeout`` and the media bound."""

    restarts_max: int = ENGINE_RESTARTS_DEFAULT  # ENGINELINK_ENGINE_RESTARTS; 0 = off
    window_s: float = RESTART_WINDOW_S_DEFAULT  # ENGINELINK_ENGINE_RESTART_WINDOW_SECS
    resume_timeout_s: float = RESUME_TIMEOUT_S_DEFAULT  # ENGINELINK_RESUME_TIMEOUT_SECS
    media_items_max: int = RESUME_MEDIA_ITEMS_MAX_DEFAULT  # ENGINELINK_RESUME_MEDIA_ITEMS_MAX

    def __post_init__(self) -> None:
        if not 0 <= self.restarts_max <= ENGINE_RESTARTS_MAX:
            raise ValueError(f"engine restarts must be 0..{ENGINE_RESTARTS_MAX}, got {self.restarts_max}")
        if self.window_s <= 0 or self.resume_timeout_s <= 0:
            raise ValueError("the restart window and the resume timeout must be positive")
        if self.media_items_max < 0:
            raise ValueError("the media bound must not be negative")

    @property
    def enabled(self) -> bool:
        return self.restarts_max > 0


class RestartBudget:
    """The crashes of one link within the window; whether the next one may be followed by a restart."""

    __slots__ = ("policy", "crashes", "restarts")

    def __init__(self, policy: ResumePolicy) -> None:
        self.policy = policy
        self.crashes: deque[float] = deque()  # crashes that were followed by a restart, within the window
        self.restarts = 0  # restarts granted in all (the metrics' count)

    def crashed(self, now: float) -> str | None:
        """A crash at ``now``: None when the engine may be started again (counted), else why not."""
        policy = self.policy
        while self.crashes and self.crashes[0] <= now - policy.window_s:
            self.crashes.popleft()
        if len(self.crashes) >= policy.restarts_max:
            return (f"engine restarts stop: {len(self.crashes) + 1} crashes within {policy.window_s:g} s "
                    f"(ENGINELINK_ENGINE_RESTARTS={policy.restarts_max} per ENGINELINK_ENGINE_RESTART_WINDOW_SECS)")
        self.crashes.append(now)
        self.restarts += 1
        return None


def unresumable(spec: GenerateSpec, generated: int, policy: ResumePolicy) -> str | None:
    """Why this engine request, ``generated`` tokens in, cannot continue exactly on a fresh engine; None if it can."""
    if generated >= spec.sampling.max_tokens:
        return "it had generated all of its max_tokens (the engine's finish was lost with it)"
    kv = spec.kv_transfer_params
    if kv is not None and kv.get("bootstrap_room") is not None:
        # SGLang's and TokenSpeed's legs run at once and meet by room (runtime/requests/pd_bootstrap.py):
        # the other leg's engine was mid-transfer with the dead one and would not pair with a new one.
        return "an SGLang/TokenSpeed PD leg: its KV transfer is paired by bootstrap room with the dead engine"
    if kv is not None and (kv.get("do_remote_prefill") or generated):
        return ("a PD decode leg: its KV came from a prefill worker, which no longer holds it"
                if kv.get("do_remote_prefill") else "a PD leg past its first token")
    media = len(spec.mm_features or ())
    if media > policy.media_items_max:
        return (f"{media} media items, above ENGINELINK_RESUME_MEDIA_ITEMS_MAX={policy.media_items_max} "
                "(a new engine would recompute their features)")
    if generated:
        if spec.mm_inputs is not None:
            # SGLang's processor output (padded ids, positions) describes the prompt as first sent.
            return ("an image the router preprocessed for SGLang: its processor output describes the prompt "
                    "as sent, not with the generated tokens appended")
        sampling = spec.sampling
        if sampling.structured_outputs is not None:
            return "a constrained request: its grammar's state cannot be carried to a new engine"
        if sampling.frequency_penalty or sampling.presence_penalty:
            return ("frequency or presence penalties: they count generated tokens, which a new engine "
                    "would read as prompt")
    return None


def continuation(spec: GenerateSpec, generated: Sequence[int], *, prompt_logprobs_sent: bool) -> GenerateSpec:
    """The engine request that continues ``spec`` after ``generated``: the same engine id, the prompt
    plus those tokens, ``max_tokens`` and ``min_tokens`` less their count; the prompt's logprobs not
    asked again once the client has them (they would cover the generated tokens too)."""
    count = len(generated)
    sampling = spec.sampling
    if count >= sampling.max_tokens:
        raise ValueError(f"{count} tokens generated of max_tokens {sampling.max_tokens}: nothing to continue")
    changes: dict = {"max_tokens": sampling.max_tokens - count, "min_tokens": max(0, sampling.min_tokens - count)}
    if prompt_logprobs_sent:
        changes["prompt_logprobs"] = None
    return msgspec.structs.replace(
        spec, prompt_token_ids=[*spec.prompt_token_ids, *generated],
        sampling=msgspec.structs.replace(sampling, **changes))
