"""The engines' KV-cache event wire (vLLM ``--kv-events-config``), sans-io.

Both ends live here so the sim publisher and the relay never disagree: the
config flag, the endpoint rules, the PUB framing, the replay protocol, the
event structs a publisher encodes, and the lenient decoder a relay reads with.
Facts come from ``reference/vllm-engine-wire.md`` §7 and vLLM's
``vllm/distributed/kv_events.py``.

Wire (one publisher per DP rank, sequence numbers from 0 per publisher):

- PUB message: ``[topic, seq (u64 big-endian), msgpack KVEventBatch]``;
  ``KVEventBatch`` is ``[ts, events, data_parallel_rank]`` (array_like), its
  events tagged maps (``{"type": "BlockStored", ...}``, defaulted fields left
  out). Older publishers send tag-first arrays; the decoder takes both.
- Replay (a DEALER asks the publisher's ROUTER): request ``[b"", start_seq
  (8 bytes BE)]``; one reply per buffered batch with ``seq >= start_seq``,
  ``[b"", topic, seq, payload]``, then the end marker ``[b"", b"", 0xFF×8,
  b""]``. SGLang's publisher (and vLLM before the topic was added) answers
  without the topic frame: ``[b"", seq, payload]`` and ``[b"", 0xFF×8, b""]``.
  ``parse_replay_reply`` reads both; ``replay_reply`` writes either.

Rules:
- sans-io: frames in, frames out; no sockets, no clocks;
- what a publisher sent that we cannot read is ``WireError`` (the engine's
  fault) at the batch level; inside a readable batch, an event we cannot read
  becomes ``WireMalformed``/``WireUnknown`` so the rest of the batch survives
  and the relay counts the drop by rule;
- hashes are folded to the proto's int64 at decode: an int keeps its low 64
  bits, a byte digest its last eight bytes big-endian (what vLLM sends as an
  int for the same digest); token bigrams ``[t, t']`` fold to ``t``.
"""

from __future__ import annotations

import json
from typing import Any, Final, Literal

import msgspec

from enginelink.wire.engine import WireError

END_SEQ: Final = b"\xff" * 8
MASK64: Final = (1 << 64) - 1


# --------------------------------------------------------------------------
# --kv-events-config
# --------------------------------------------------------------------------


class KvEventsConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``KVEventsConfig``: the JSON of ``--kv-events-config``, same keys, same defaults."""

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:  # vLLM: zmq when events are on, else null
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.buffer_steps < 1:
            raise ValueError("buffer_steps must be >= 1")

    @property
    def publishing(self) -> bool:
        """Events are produced and sent: both switches on, as vLLM requires."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


def parse_config(text: str) -> KvEventsConfig:
    """``--kv-events-config JSON``; ValueError (with the reason) for a bad one."""
    try:
        return msgspec.convert(json.loads(text), KvEventsConfig)
    except (json.JSONDecodeError, msgspec.ValidationError, TypeError) as exc:
        raise ValueError(f"--kv-events-config: {exc}") from None


def endpoint_for_rank(endpoint: str, rank: int) -> str:
    """vLLM's ``offset_endpoint_port``: rank r publishes on ``port + r``.

    inproc gets a ``_dp<r>`` suffix; tcp port 0 stays 0 (the OS picks one per
    socket); anything else under DP > 0 is refused, as vLLM refuses it (an
    ipc endpoint cannot serve two ranks: give each rank its own config).
    """
    if not endpoint or rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{rank}"
    if "tcp" in endpoint:
        host, sep, port = endpoint.rpartition(":")
        if not sep or not port.isdigit():
            return endpoint
        return endpoint if int(port) == 0 else f"{host}:{int(port) + rank}"
    raise ValueError(f"KV events endpoint {endpoint!r} cannot be offset for DP rank {rank}: use tcp or inproc")


def publisher_binds(endpoint: str) -> bool:
    """vLLM's PUB binds only on a wildcard, ``::``, ipc or inproc; otherwise it connects
    (and the subscriber must bind). The replay ROUTER always binds."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def connectable(endpoint: str) -> str:
    """Where a subscriber connects to a binding publisher: wildcards become loopback."""
    return endpoint.replace("*", "127.0.0.1").replace("0.0.0.0", "127.0.0.1")


# --------------------------------------------------------------------------
# What a publisher encodes (vLLM's msgspec structs, field for field)
# --------------------------------------------------------------------------


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


EngineKvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[EngineKvEvent]
    data_parallel_rank: int | None = None


_ENCODER: Final = msgspec.msgpack.Encoder()


def encode_batch(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def pub_message(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    return [topic, seq_bytes(seq), payload]


def parse_pub_message(frames: list[bytes]) -> tuple[bytes, int, bytes]:
    """``(topic, seq, payload)`` of one PUB message."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise WireError(f"KV PUB message: want [topic, seq(8), payload], got {len(frames)} frames")
    return bytes(frames[0]), int.from_bytes(frames[1], "big"), bytes(frames[2])


# --------------------------------------------------------------------------
# Replay
# --------------------------------------------------------------------------


def replay_request(start_seq: int) -> list[bytes]:
    """What the relay's DEALER sends."""
    return [b"", seq_bytes(start_seq)]


def parse_replay_request(frames: list[bytes]) -> int:
    """The start sequence of a request as the ROUTER receives it, identity stripped."""
    if len(frames) != 2 or frames[0] != b"" or len(frames[1]) != 8:
        raise WireError(f"KV replay request: want [b'', seq(8)], got {len(frames)} frames")
    return int.from_bytes(frames[1], "big")


def replay_reply(topic: bytes | None, seq: int, payload: bytes) -> list[bytes]:
    """One replayed batch as the ROUTER sends it (identity not included); topic None = SGLang form."""
    return [b"", seq_bytes(seq), payload] if topic is None else [b"", topic, seq_bytes(seq), payload]


def replay_end(with_topic: bool = True) -> list[bytes]:
    return [b"", b"", END_SEQ, b""] if with_topic else [b"", END_SEQ, b""]


class ReplayEnd(msgspec.Struct, frozen=True):
    pass


def parse_replay_reply(frames: list[bytes]) -> tuple[int, bytes] | ReplayEnd:
    """``(seq, payload)`` of one reply as the DEALER receives it, or the end marker."""
    if len(frames) == 4 and frames[0] == b"":
        seq, payload = frames[2], frames[3]
    elif len(frames) == 3 and frames[0] == b"":
        seq, payload = frames[1], frames[2]
    else:
        raise WireError(f"KV replay reply: unexpected {len(frames)}-frame message")
    if len(seq) != 8:
        raise WireError(f"KV replay reply: sequence frame of {len(seq)} bytes")
    if seq == END_SEQ:
        return ReplayEnd()
    return int.from_bytes(seq, "big"), bytes(payload)


# --------------------------------------------------------------------------
# What a relay reads: lenient, folded, one struct per event
# --------------------------------------------------------------------------


class WireStored(msgspec.Struct, frozen=True, gc=False):
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None  # per block, raw items
    medium: str | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class WireRemoved(msgspec.Struct, frozen=True, gc=False):
    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class WireCleared(msgspec.Struct, frozen=True, gc=False):
    ownership: str | None = None


class WireUnknown(msgspec.Struct, frozen=True, gc=False):
    type_name: str


class WireMalformed(msgspec.Struct, frozen=True, gc=False):
    field: str


WireEvent = WireStored | WireRemoved | WireCleared | WireUnknown | WireMalformed


class WireBatch(msgspec.Struct, frozen=True, gc=False):
    ts: float
    events: tuple[WireEvent, ...]
    dp_rank: int | None = None


_ANY: Final = msgspec.msgpack.Decoder()

# Slot order of the legacy tag-first array layout (vLLM's declaration order).
_STORED_SLOTS: Final = (
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
    "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality",
    "ownership", "session_id",
)  # fmt: skip
_REMOVED_SLOTS: Final = ("block_hashes", "medium", "group_idx", "locality", "ownership")
_CLEARED_SLOTS: Final = ("ownership",)


def decode_batch(payload: bytes) -> WireBatch:
    """One publisher batch; WireError if the batch itself is unreadable."""
    try:
        raw = _ANY.decode(payload)
    except msgspec.DecodeError as exc:
        raise WireError(f"undecodable KV event batch: {exc}") from None
    if isinstance(raw, (list, tuple)) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict) and "events" in raw:
        ts, events = raw.get("ts", 0.0), raw["events"]
        rank = raw.get("data_parallel_rank", raw.get("attn_dp_rank"))
    else:
        raise WireError("KV event batch is neither [ts, events, rank] nor a map")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not isinstance(events, list):
        raise WireError("KV event batch: bad ts or events")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)):
        rank = None
    return WireBatch(float(ts), tuple(_event(e) for e in events), rank)


def _event(raw: Any) -> WireEvent:
    if isinstance(raw, dict):
        fields, tag = raw, raw.get("type")
    elif isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
        tag = raw[0]
        slots = {"BlockStored": _STORED_SLOTS, "BlockRemoved": _REMOVED_SLOTS}.get(tag, _CLEARED_SLOTS)
        fields = dict(zip(slots, raw[1:]))
    else:
        return WireMalformed("type")
    if not isinstance(tag, str):
        return WireMalformed("type")
    try:
        match tag:
            case "BlockStored":
                return _stored(fields)
            case "BlockRemoved":
                return WireRemoved(_hashes(fields.get("block_hashes"), "block_hashes"), **_tail(fields, _REMOVED_TAIL))
            case "AllBlocksCleared":
                return WireCleared(_text(fields.get("ownership")))
            case _:
                return WireUnknown(tag)
    except _Bad as bad:
        return WireMalformed(bad.field)


class _Bad(Exception):
    def __init__(self, field: str) -> None:
        self.field = field


_STORED_TAIL: Final = ("medium", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
                       "locality", "ownership", "session_id")  # fmt: skip
_REMOVED_TAIL: Final = ("medium", "group_idx", "locality", "ownership")
_INT_TAIL: Final = frozenset({"group_idx", "kv_cache_spec_sliding_window"})


def _stored(f: dict) -> WireStored:
    hashes = _hashes(f.get("block_hashes"), "block_hashes")
    parent = f.get("parent_block_hash")
    block_size = f.get("block_size")
    if not isinstance(block_size, int) or isinstance(block_size, bool):
        raise _Bad("block_size")
    lora_id = f.get("lora_id")
    extra = f.get("extra_keys")
    extra_keys = None
    if isinstance(extra, (list, tuple)):
        extra_keys = tuple(tuple(k) if isinstance(k, (list, tuple)) else None for k in extra)
    lora_name = _text(f.get("lora_name")) or None
    salt = _text(f.get("cache_salt")) or _salt_from_extra_keys(extra_keys, lora_name)
    return WireStored(
        block_hashes=hashes,
        parent_block_hash=None if parent is None else _hash(parent, "parent_block_hash"),
        token_ids=_tokens(f.get("token_ids")),
        block_size=block_size,
        lora_id=lora_id if isinstance(lora_id, int) and not isinstance(lora_id, bool) else None,
        lora_name=lora_name,
        cache_salt=salt,
        extra_keys=extra_keys,
        **_tail(f, _STORED_TAIL),
    )


def _tail(f: dict, names: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        value = f.get(name)
        if name in _INT_TAIL:
            out[name] = value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
        else:
            out[name] = _text(value)
    return out


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def fold_hash(value: Any) -> int | None:
    """A block hash as the proto's int64, or None if it is not a hash."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        folded = value & MASK64
    elif isinstance(value, (bytes, bytearray, memoryview)):
        folded = int.from_bytes(bytes(value)[-8:], "big")
    else:
        return None
    return folded - (1 << 64) if folded >= 1 << 63 else folded


def _hash(value: Any, field: str) -> int:
    folded = fold_hash(value)
    if folded is None:
        raise _Bad(field)
    return folded


def _hashes(value: Any, field: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise _Bad(field)
    return tuple(_hash(v, field) for v in value)


def _tokens(value: Any) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise _Bad("token_ids")
    out = []
    for cell in value:
        if isinstance(cell, (list, tuple)) and len(cell) == 2:  # speculative bigram [t, t']
            cell = cell[0]
        if not isinstance(cell, int) or isinstance(cell, bool) or not 0 <= cell <= 0xFFFFFFFF:
            raise _Bad("token_ids")
        out.append(cell)
    return tuple(out)


def _salt_from_extra_keys(extra_keys: tuple | None, lora_name: str | None) -> str | None:
    """vLLM carries the cache salt in the first block's extra keys: its first text not the LoRA name."""
    if not extra_keys or not extra_keys[0]:
        return None
    for item in extra_keys[0]:
        if isinstance(item, str) and item and item != lora_name:
            return item
    return None
