"""Helpers for the contract tests: run calls the way a client does, and read the journal.

Everything here goes through the servicer's public surfaces only: grpcio
calls on its port, and its journal file opened read-only (SQLite ``mode=ro``),
as ``enginelink journal`` would. Every wait has a deadline; none sleeps longer
than a poll interval.
"""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from enginelink.journal.store import open_reader
from tests.harness import generate_request, wait_until

# Any single call in these tests is short; a hung servicer fails the test, not the run.
CALL_TIMEOUT_S = 10.0
POLL_S = 0.02
# 20 ms per engine step: a 50-token request lasts about a second, long enough
# to abort, cancel or collide with, short enough for the suite's time budget.
SLOW_ENGINE_ARGS = ["--step-us", "20000"]

_ids = itertools.count(1)
_run = uuid.uuid4().hex[:6]


def new_id(prefix: str) -> str:
    """A request id no other test (or earlier run on the same servicer) uses."""
    return f"{prefix}-{_run}-{next(_ids)}"


def prompt(seed: int, length: int = 8) -> list[int]:
    """A prompt of in-vocabulary ids (3..4095) that differs per seed."""
    return [3 + (seed * 7919 + i * 104729) % 4093 for i in range(length)]


@dataclass
class Outcome:
    """What a client saw from one Generate call, split by choice."""

    messages: list[pb.GenerateResponse]
    chunks: dict[int, list[pb.GenerateStreamChunk]] = field(default_factory=dict)
    completes: dict[int, list[pb.GenerateComplete]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for message in self.messages:
            kind = message.WhichOneof("response")
            assert kind in ("chunk", "complete"), f"a GenerateResponse with neither chunk nor complete: {message}"
            body = getattr(message, kind)
            target = self.chunks if kind == "chunk" else self.completes
            target.setdefault(body.index, []).append(body)

    def complete(self, index: int = 0) -> pb.GenerateComplete:
        got = self.completes.get(index, [])
        assert len(got) == 1, f"choice {index}: expected exactly one complete, got {len(got)}: {self.messages}"
        return got[0]

    def streamed(self, index: int = 0) -> list[int]:
        return [t for chunk in self.chunks.get(index, []) for t in chunk.token_ids]


def call(stub, request: pb.GenerateRequest, timeout_s: float = CALL_TIMEOUT_S) -> Outcome:
    return Outcome(list(stub.Generate(request, timeout=timeout_s)))


def generate(stub, request_id: str, input_ids: list[int], *, stream: bool = False, **sampling) -> Outcome:
    return call(stub, generate_request(request_id, input_ids, stream=stream, **sampling))


def greedy(stub, input_ids: list[int], max_tokens: int, **sampling) -> list[int]:
    """Non-streaming greedy output ids (ignoring EOS unless told otherwise)."""
    sampling.setdefault("ignore_eos", True)
    outcome = generate(stub, new_id("greedy"), input_ids, temperature=0.0, max_tokens=max_tokens, **sampling)
    return list(outcome.complete(0).output_ids)


def outcome_or_error(stub, request: pb.GenerateRequest) -> Outcome | grpc.RpcError:
    try:
        return call(stub, request)
    except grpc.RpcError as error:
        return error


def refusal(stub, request: pb.GenerateRequest) -> grpc.RpcError:
    """The error a Generate call ends with; fails the test if it was served."""
    result = outcome_or_error(stub, request)
    assert isinstance(result, grpc.RpcError), f"request {request.request_id!r} was served: {result.messages}"
    return result


def active_requests(stub) -> int:
    return stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=CALL_TIMEOUT_S).active_requests


def wait_idle(stub, timeout_s: float = 5.0) -> None:
    wait_until(lambda: active_requests(stub) == 0, timeout_s, "active_requests == 0", interval_s=POLL_S)


# -- the journal, read as a post-mortem tool would --------------------------------------


@dataclass(frozen=True)
class Row:
    seq: int
    time: float
    stream: str
    kind: str
    payload: object


def journal_rows(path: Path, kinds: tuple[str, ...] | None = None) -> list[Row]:
    with open_reader(path) as reader:
        records = reader.records(kinds=kinds or None)
    return [Row(rec.seq, rec.time, rec.stream, rec.kind, rec.payload) for rec in records]


def engine_request_ids(path: Path) -> list[str]:
    """Every engine request id the servicer sent an ADD for (in order)."""
    return [rid for row in journal_rows(path, ("engine.request",)) for rid in row.payload["request_ids"]]


def wait_journal(path: Path, predicate, what: str, timeout_s: float = 5.0):
    """Poll the journal (flushed in batches every ~50 ms) until ``predicate(rows)`` holds."""
    return wait_until(lambda: predicate(journal_rows(path)), timeout_s, what, interval_s=0.05)
