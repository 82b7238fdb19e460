"""The sim engine's PD legs and SGLang's DP controller, for the SGLang and TokenSpeed personalities.

What the real engines do that the sim copies (SGLang 0.5.23, TokenSpeed 0.1.1
source; ``runtime/requests/pd_bootstrap.py`` has the servicer's side):

- ``--disaggregation-mode prefill``: a request runs as a prefill only (the
  scheduler sets ``max_new_tokens`` 1: one token, then it finishes
  ``length`` once its KV is handed over), and needs a bootstrap room (SGLang's
  DP controller asserts one; a prefill with no peer to send to cannot run):
  without one it is aborted, status 400. Under data parallelism with the
  room-following balance (SGLang's default on a prefill leg, TokenSpeed's
  always) a request that runs on a rank other than its room's residue fails
  as SGLang's KV sender fails it ("follow_bootstrap_room conflict", 500);
- ``--disaggregation-mode decode``: a request needs a bootstrap room too,
  then generates as a whole request would (the sim has no KV to move: the
  tokens are the same seeded ones); the stand-in host ``2.2.2.2`` is SGLang's
  transfer to nobody, accepted on either leg;
- SGLang's DP controller (``--dp-size N`` behind one input address): a
  request with ``routed_dp_rank`` goes to that rank (out of range: refused,
  as ``maybe_external_dp_rank_routing`` raises), else to the next rank in
  turn (``round_robin``, the default), or, with ``follow_bootstrap_room``, to
  its room's residue; control requests and aborts reach every rank, and each
  rank answers a control request itself (one reply per rank, same id).

Every served room is logged by the shell (``room_line``) so a test can see
which leg and rank ran it. Sans-io: the controller only routes messages.
"""

from __future__ import annotations

from typing import Final, Sequence

import msgspec

from enginelink.wire import sglang, sglang_structs as ss

NO_LEG: Final = "null"
LEG_MODES: Final = ("null", "prefill", "decode")
STAND_IN_HOST: Final = "2.2.2.2"  # SGLang's FAKE_BOOTSTRAP_HOST
FOLLOW_ROOM: Final = "follow_bootstrap_room"
NO_ROOM_MESSAGE: Final = ("req.bootstrap_room should not be None. Do not send requests directly to prefill or "
                          "decode instances; send to the router instead.")


class SimLeg(msgspec.Struct, frozen=True):
    """One sim engine's PD role (its ``--disaggregation-*`` and ``--load-balance-method`` flags)."""

    mode: str = NO_LEG
    bootstrap_port: int = 8998
    load_balance_method: str = "auto"
    dp_size: int = 1

    def __post_init__(self) -> None:
        if self.mode not in LEG_MODES:
            raise ValueError(f"disaggregation mode must be one of {', '.join(LEG_MODES)}, got {self.mode!r}")

    @property
    def is_leg(self) -> bool:
        return self.mode != NO_LEG

    @property
    def follows_room(self) -> bool:
        return self.mode == "prefill" and self.load_balance_method in ("auto", FOLLOW_ROOM)

    def refusal(self, host: str | None, room: int | None, rank: int) -> tuple[str, int] | None:
        """(message, HTTP status) when this leg cannot run a request with this bootstrap on ``rank``."""
        if not self.is_leg:
            return None
        if room is None or not host:
            return NO_ROOM_MESSAGE, 400
        if self.follows_room and self.dp_size > 1 and host != STAND_IN_HOST and room % self.dp_size != rank:
            return (f"follow_bootstrap_room conflict: dispatched to dp_rank {rank} but bootstrap_room {room} "
                    f"implies dp_rank {room % self.dp_size}. Set SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK"
                    "=1 to allow mixed routing."), 500
        return None

    def max_new_tokens(self, asked: int | None) -> int | None:
        """A prefill leg generates one token (the scheduler's own ``max_new_tokens = 1``)."""
        return 1 if self.mode == "prefill" else asked


def room_line(leg: SimLeg, rank: int, rid: str, host: str | None, port: int | None, room: int | None) -> str:
    """The shell's log line for a request a leg took (tests read it from the servicer's relayed log)."""
    return f"pd {leg.mode} leg: rank {rank} took {rid} (bootstrap {host}:{port} room {room})"


class SglangDpController:
    """SGLang's DP controller in front of N personalities (one per rank), sans-io.

    ``handle`` routes one input message; ``step`` steps every rank with work,
    their outputs together, the step's cost the longest rank's (the ranks run
    side by side). ``room_lines`` collects the log lines the ranks' legs made.
    """

    def __init__(self, ranks: Sequence, leg: SimLeg) -> None:
        self.ranks = list(ranks)
        self.leg = leg
        self._next = 0

    @property
    def has_work(self) -> bool:
        return any(rank.has_work for rank in self.ranks)

    def handle(self, frames: Sequence[bytes], now: float) -> list[list[bytes]]:
        message = sglang.decode_input(frames)
        match message:
            case ss.TokenizedGenerateReqInput() | ss.TokenizedEmbeddingReqInput():
                target = self._place(message)
                if isinstance(target, str):
                    reason = sglang.finish_abort(target, 400)
                    return [sglang.encode_outputs(sglang.token_batch(
                        [message.rid or ""], [[]], [reason], prompt_tokens=[0], completion_tokens=[0]))]
                return self.ranks[target].handle(frames, now)
        # Aborts, flushes and profiling reach every rank; each answers for itself.
        return [out for rank in self.ranks for out in rank.handle(frames, now)]

    def _place(self, req) -> int | str:
        """The rank a request goes to, or SGLang's refusal."""
        size = len(self.ranks)
        pinned = req.routed_dp_rank
        if pinned is not None:
            if not 0 <= pinned < size:
                return f"DP rank {pinned} is not active."
            return pinned
        if self.leg.follows_room and getattr(req, "bootstrap_room", None) is not None:
            return req.bootstrap_room % size
        rank = self._next % size
        self._next = (self._next + 1) % size
        return rank

    def step(self, now: float) -> tuple[list[list[bytes]], float]:
        messages: list[list[bytes]] = []
        cost = 0.0
        for rank in self.ranks:
            if rank.has_work:
                out, rank_cost = rank.step(now)
                messages.extend(out)
                cost = max(cost, rank_cost)
        return messages, cost
