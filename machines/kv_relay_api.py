"""What the KV relay machine (``kv_relay.py``) and its shell say to each other.

The bounds (``KvRelayConfig``), the two transition tables (a publisher rank,
a subscriber), the journal kinds the relay writes, the actions it returns
(``FetchReplay`` / ``Journal`` / ``Wake``) and its answers to subscribers
(``Plan`` / ``Refused`` / ``Pull`` / ``Ended``). Closed vocabulary: the shell
``match``es on these and nothing else.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final, Mapping

import msgspec

from enginelink.machines.table import build_table
from enginelink.wire.kv_batch import KvBatch

HISTORY_BATCHES_ENV: Final = "SMG_KV_EVENT_HISTORY_BATCHES"
HISTORY_BYTES_ENV: Final = "SMG_KV_EVENT_HISTORY_BYTES"
MAX_SUBSCRIBERS_ENV: Final = "ENGINELINK_KV_MAX_SUBSCRIBERS"
MAX_SUBSCRIBERS_PER_PEER_ENV: Final = "ENGINELINK_KV_MAX_SUBSCRIBERS_PER_PEER"
SEND_STALL_ENV: Final = "ENGINELINK_KV_SEND_STALL_SECS"

# Journal kinds the relay writes (to be added to journal/records.py KINDS); payload keys:
KIND_KV_BATCH: Final = "kv.batch"  # {rank, inc, seq, source: live|replay, payload: bytes}
KIND_KV_LOST: Final = "kv.lost"  # {rank, inc, first, last, why: hole|before_start}
KIND_KV_GAP: Final = "kv.gap"  # {rank, inc, first, last}
KIND_KV_INCARNATION: Final = "kv.incarnation"  # {rank, inc, base, reason, seq}


def kv_stream(rank: int) -> str:
    return f"kv/{rank}"


class KvRelayConfig(msgspec.Struct, frozen=True, kw_only=True):
    history_batches_max: int = 10_000  # SMG_KV_EVENT_HISTORY_BATCHES, per rank
    history_bytes_max: int = 256 << 20  # SMG_KV_EVENT_HISTORY_BYTES, per rank
    replay: bool = True  # the publisher has a replay endpoint
    repair_pending_max: int = 10_000  # live batches held while a repair is out
    snapshot_chunk_blocks: int = 2048
    # ENGINELINK_KV_MAX_SUBSCRIBERS: open streams; one more takes the slot of one not taking its
    # events (machines/kv_admission.py), or is refused UNAVAILABLE.
    subscribers_max: int = 64
    # ENGINELINK_KV_MAX_SUBSCRIBERS_PER_PEER: open streams from one peer (runtime/peers.py). A router
    # subscribes once per worker; 16 leaves room for several routers behind one proxy or NAT, and keeps
    # one address to a quarter of the default slots.
    subscribers_per_peer_max: int = 16
    pull_batches_max: int = 256
    # ENGINELINK_KV_SEND_STALL_SECS: a message flow control holds this long ends the
    # stream with DATA_LOSS (the shell's clock; the machine only records the end).
    send_stall_s: float = 30.0

    @classmethod
    def from_env(cls, env: Mapping[str, str], **overrides) -> "KvRelayConfig":
        """Bounds from the environment (ValueError names a bad knob)."""
        for key, name in ((HISTORY_BATCHES_ENV, "history_batches_max"), (HISTORY_BYTES_ENV, "history_bytes_max"),
                          (MAX_SUBSCRIBERS_ENV, "subscribers_max"),
                          (MAX_SUBSCRIBERS_PER_PEER_ENV, "subscribers_per_peer_max")):  # fmt: skip
            raw = env.get(key, "").strip()
            if raw and name not in overrides:
                if not raw.isdigit() or int(raw) < 1:
                    raise ValueError(f"{key} must be a positive integer, got {raw!r}")
                overrides[name] = int(raw)
        raw = env.get(SEND_STALL_ENV, "").strip()
        if raw and "send_stall_s" not in overrides:
            try:
                stall_s = float(raw)
            except ValueError:
                stall_s = 0.0
            if not 0 < stall_s < float("inf"):
                raise ValueError(f"{SEND_STALL_ENV} must be a positive number of seconds, got {raw!r}")
            overrides["send_stall_s"] = stall_s
        return cls(**overrides)


# ---- the tables --------------------------------------------------------------


class RankState(StrEnum):
    IDLE = "idle"  # no batch of this incarnation yet
    LIVE = "live"
    REPAIRING = "repairing"  # a replay fetch is out
    CLOSED = "closed"


class RankEvent(StrEnum):
    FIRST_BATCH = "first_batch"
    GAP = "gap"
    REPAIRED = "repaired"
    RESTART = "restart"
    CLOSE = "close"


RANK_TABLE = build_table(
    "kv_rank",
    states=[s.value for s in RankState],
    transitions=[
        (RankEvent.FIRST_BATCH, RankState.IDLE, RankState.LIVE),
        (RankEvent.GAP, [RankState.IDLE, RankState.LIVE, RankState.REPAIRING], RankState.REPAIRING),
        (RankEvent.REPAIRED, RankState.REPAIRING, RankState.LIVE),
        (RankEvent.RESTART, [RankState.LIVE, RankState.REPAIRING], RankState.IDLE),
        (RankEvent.CLOSE, [RankState.IDLE, RankState.LIVE, RankState.REPAIRING], RankState.CLOSED),
    ],
    initial=RankState.IDLE,
    terminal={RankState.CLOSED},
)


class SubState(StrEnum):
    CATCHING_UP = "catching_up"
    LIVE = "live"
    ENDED = "ended"


class SubEvent(StrEnum):
    CAUGHT_UP = "caught_up"
    END = "end"


SUBSCRIBER_TABLE = build_table(
    "kv_subscriber",
    states=[s.value for s in SubState],
    transitions=[
        (SubEvent.CAUGHT_UP, SubState.CATCHING_UP, SubState.LIVE),
        (SubEvent.END, [SubState.CATCHING_UP, SubState.LIVE], SubState.ENDED),
    ],
    initial=SubState.CATCHING_UP,
    terminal={SubState.ENDED},
)


# ---- actions and answers -----------------------------------------------------


class FetchReplay(msgspec.Struct, frozen=True):
    """Ask rank's replay ROUTER from ``start_seq``; answer with ``on_replay(rank, token, …)``."""

    rank: int
    token: int
    start_seq: int


class Journal(msgspec.Struct, frozen=True):
    stream: str
    kind: str
    payload: dict


class Wake(msgspec.Struct, frozen=True):
    """These subscribers may have something new to pull (or an end)."""

    subscribers: tuple[int, ...]


Action = FetchReplay | Journal | Wake


class Refused(msgspec.Struct, frozen=True):
    status: str  # "OUT_OF_RANGE" | "UNAVAILABLE"
    message: str


class Plan(msgspec.Struct, frozen=True):
    subscriber: int
    modes: dict[int, str]  # rank -> "history" | "snapshot" | "resume" | "live"
    actions: tuple[Action, ...] = ()


class Ended(msgspec.Struct, frozen=True):
    status: str  # "DATA_LOSS" | "UNAVAILABLE"
    message: str


class Pull(msgspec.Struct, frozen=True):
    batches: tuple[KvBatch, ...]
    end: Ended | None = None  # send the batches, then end the stream with this
    actions: tuple[Action, ...] = ()
