"""Journal records: the one vocabulary every event is written in.

A record is ``(seq, time, stream, kind, payload)``:

- ``seq``: contiguous from 1 within one journal (one servicer run; a journal
  file holds one run, see ``journal.py``). Gaps on disk only where the disk
  path dropped records (counted as ``store_dropped``) or pruned them;
- ``time``: ``trio.current_time()`` of the servicer when it was appended;
  the ``run.start`` record holds the wall-clock time at trio time 0 of the run,
  so readers can print wall times without the machines ever reading a clock;
- ``stream``: what the record is about (``link/<name>``, ``req/<request id>``,
  ``engine/<rank>``, ``kv/<rank>``, ``run``);
- ``kind``: one of the ``KIND_*`` names below (closed vocabulary);
- ``payload``: for the raw kinds (``engine.frame``) the bytes as received (one
  record per frame, never per token); for everything else a msgpack-able dict.

Rules:

- The kind alone says how a payload is stored: raw kinds are kept as the
  bytes given, every other kind is encoded once with msgpack at append. The
  ring and the store keep only those bytes (a ``Row``); a ``Record`` is the
  decoded view handed to readers and to ``fold``.
- The ring's and the store's byte budgets count encoded payload bytes.
- Payload shapes only grow: new keys are optional for readers, so an old
  journal still folds.

Payload shapes (keys; all required unless marked):

``run.start``         {wall_time, trio_time, pid, argv, version, budgets: {...}}
``transition``        {machine: "link"|"request"|"kv_rank"|"kv_subscriber", id, source, dest, event}
``client.generate``   {request_id, n, prompt_tokens, stream, max_tokens}
``client.abort``      {request_ids, reason: "abort_rpc"|"client_gone"}
``engine.frame``      raw bytes of one engine output frame (multi-part frames:
                      only the first part: vLLM's large arrays, logprobs of
                      more than ~30 tokens a row, travel in further frames
                      that are not journaled; the fold never reads logprobs)
``engine.handshake``  {step: "hello"|"init"|"ready"|"READY", message: {...}, rank}
                      (``rank``: the DP rank whose step it is; a launch step has none)
``engine.facts``      {link, pid, facts: {...}, ranks: [{rank, instance_id, …}]}
``engine.request``    {link, request_ids, prompt_tokens, ranks}  (one ADD per
                      engine request; ``ranks[i]``: the DP rank request_ids[i] went to)
``engine.kv_release`` {link, request_id, engine_id, sent}  a refused PD decode
                      request's pre-aborted ADD, so the prefill side frees its KV
                      (runtime/contracts/vllm/kv_transfer.py); never a call's engine request
``engine.restart``    {link, attempt, crash, restarts_max, window_s}  the engine is
                      started again after ``crash`` (engine restarts on;
                      docs/resume.md): the launch and handshake records follow
``engine.held``       {link, request_id, engine_ids, tokens}  the engine died under
                      the request; it is held to be re-submitted (``tokens``: per
                      engine id, those generated so far)
``engine.resume``     {link, request_id, engine_ids, indexes, reprefilled, prompt_tokens,
                      ranks, resumes}  the held request re-submitted to the new
                      engine: each open choice (``indexes``) as its prompt plus
                      the ``reprefilled`` tokens it had generated
``client.sent``       {request_id, index, tokens_sent, finish_reason}  written
                      ONCE per choice, when it completes (never per message:
                      the journal must stay cheap at 100k tokens/s)
``error``             {whose: "client"|"engine"|"servicer", code, message, id?}
``internal_error``    {rpc, type, message, traceback, request_id?}  an unexpected
                      exception (our bug) a gRPC handler answered INTERNAL for;
                      the traceback keeps its last 8192 characters
``snapshot``          {state: <fold state>}  (periodic, bounds replay; see
                      ``fold.snapshot_payload`` for the compact form)
``kv.batch``          {rank, inc, seq, source: "live"|"replay", payload: bytes}  one
                      KV event batch the relay accepted, its publisher payload as
                      received (``machines/kv_relay.py``; stream ``kv/<rank>``)
``kv.lost``           {rank, inc, first, last, why: "hole"|"before_start"}
``kv.gap``            {rank, inc, first, last}  (a repair from replay was asked)
``kv.incarnation``    {rank, inc, base, reason, seq}  a publisher (re)start; the
                      relay writes incarnation 0 at its own start, with its
                      sequence base
``run.stop``          {exit_status, reason}
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

KIND_RUN_START: Final = "run.start"
KIND_RUN_STOP: Final = "run.stop"
KIND_TRANSITION: Final = "transition"
KIND_CLIENT_GENERATE: Final = "client.generate"
KIND_CLIENT_ABORT: Final = "client.abort"
KIND_CLIENT_SENT: Final = "client.sent"
KIND_ENGINE_FRAME: Final = "engine.frame"
KIND_ENGINE_HANDSHAKE: Final = "engine.handshake"
KIND_ENGINE_FACTS: Final = "engine.facts"
KIND_ENGINE_REQUEST: Final = "engine.request"
KIND_ENGINE_KV_RELEASE: Final = "engine.kv_release"
KIND_ENGINE_RESTART: Final = "engine.restart"
KIND_ENGINE_HELD: Final = "engine.held"
KIND_ENGINE_RESUME: Final = "engine.resume"
# The router's direct ZMQ lane (``enginelink headless``): its handshake messages, and each request
# message it sent (type byte + payload, as received).
KIND_ROUTER_HANDSHAKE: Final = "router.handshake"
KIND_ROUTER_FRAME: Final = "router.frame"
KIND_ERROR: Final = "error"
KIND_INTERNAL_ERROR: Final = "internal_error"
KIND_SNAPSHOT: Final = "snapshot"
# The KV relay's (same names as machines/kv_relay_api.py, which writes them).
KIND_KV_BATCH: Final = "kv.batch"
KIND_KV_LOST: Final = "kv.lost"
KIND_KV_GAP: Final = "kv.gap"
KIND_KV_INCARNATION: Final = "kv.incarnation"

KINDS: Final = frozenset(
    {
        KIND_RUN_START,
        KIND_RUN_STOP,
        KIND_TRANSITION,
        KIND_CLIENT_GENERATE,
        KIND_CLIENT_ABORT,
        KIND_CLIENT_SENT,
        KIND_ENGINE_FRAME,
        KIND_ENGINE_HANDSHAKE,
        KIND_ENGINE_FACTS,
        KIND_ENGINE_REQUEST,
        KIND_ENGINE_KV_RELEASE,
        KIND_ENGINE_RESTART,
        KIND_ENGINE_HELD,
        KIND_ENGINE_RESUME,
        KIND_ROUTER_HANDSHAKE,
        KIND_ROUTER_FRAME,
        KIND_ERROR,
        KIND_INTERNAL_ERROR,
        KIND_SNAPSHOT,
        KIND_KV_BATCH,
        KIND_KV_LOST,
        KIND_KV_GAP,
        KIND_KV_INCARNATION,
    }
)

# Kinds whose payload is stored as the raw bytes given (wire frames: decoding
# them is the codec's job, and only when someone asks).
RAW_KINDS: Final = frozenset({KIND_ENGINE_FRAME, KIND_ROUTER_FRAME})

MACHINE_LINK: Final = "link"
MACHINE_REQUEST: Final = "request"
MACHINE_ROUTER: Final = "router"  # the router link of ``enginelink headless`` (machines/router_link.py)

RUN_STREAM: Final = "run"

# What the ring, the pending buffer and the store hold: a record whose payload
# is already encoded. A plain tuple because it is built on the hot path, and
# its field order is the store's column order.
Row = tuple[int, float, str, str, bytes]


class Record(msgspec.Struct, frozen=True, array_like=True):
    seq: int
    time: float
    stream: str
    kind: str
    payload: Any


class Transition(msgspec.Struct, frozen=True):
    """A machine's decision, returned as an action and journaled by the shell."""

    machine: str
    id: str
    source: str
    dest: str
    event: str

    def payload(self) -> dict:
        return {
            "machine": self.machine,
            "id": self.id,
            "source": self.source,
            "dest": self.dest,
            "event": self.event,
        }


class PayloadError(ValueError):
    """The caller (our own code) gave a kind or payload outside the vocabulary."""


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode


def encode_payload(kind: str, payload: Any) -> bytes:
    """The stored bytes of one payload; checks it against the kind.

    Hot path: one set lookup and, for dict kinds, one msgpack encode.
    """
    if kind in RAW_KINDS:
        if type(payload) is bytes:
            return payload
        if isinstance(payload, (bytearray, memoryview)):
            return bytes(payload)
        raise PayloadError(f"{kind} takes raw bytes, got {type(payload).__name__}")
    if kind not in KINDS:
        raise PayloadError(f"unknown record kind {kind!r}")
    if not isinstance(payload, dict):
        raise PayloadError(f"{kind} takes a dict payload, got {type(payload).__name__}")
    return _encode(payload)


def decode_payload(kind: str, blob: bytes) -> Any:
    """The payload as appended: bytes for raw kinds, the dict otherwise."""
    if kind in RAW_KINDS:
        return blob
    return _decode(blob)


def row_to_record(row: Row) -> Record:
    seq, time, stream, kind, blob = row
    return Record(seq, time, stream, kind, decode_payload(kind, blob))


def link_stream(name: str) -> str:
    return f"link/{name}"


def request_stream(request_id: str) -> str:
    return f"req/{request_id}"


def engine_stream(rank: int) -> str:
    return f"engine/{rank}"
