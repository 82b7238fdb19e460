"""A SubscribeKvEvents client for the KV tests, and what they check its batches with.

``KvSubscription`` reads one stream on a thread (grpcio's iterators block)
and keeps every batch; ``wait`` polls a predicate over them, bounded. The
``Chain`` model applies what a subscriber receives: the stored blocks by hash
(token ids, parent), cleared on a clear, a snapshot chunk 0 included.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import grpc
from smg_grpc_proto.generated import common_pb2

from tests.harness import Servicer, generate_request, scrape  # noqa: F401 (re-exported for tests/kv)


class KvSubscription:
    def __init__(self, servicer: Servicer, cursor: int = 0, loads_before_first: bool = True) -> None:
        request = common_pb2.SubscribeKvEventsRequest(start_sequence_number=cursor,
                                                      load_records_before_first_batch=loads_before_first)
        self.call = servicer.stub.SubscribeKvEvents(request)
        self.batches: list = []
        self.error: grpc.RpcError | None = None
        self.done = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for batch in self.call:
                with self._lock:
                    self.batches.append(batch)
        except grpc.RpcError as error:
            self.error = error
        finally:
            self.done.set()

    def snapshot(self) -> list:
        with self._lock:
            return list(self.batches)

    def kv_batches(self) -> list:
        """Batches that are not ``load_only``."""
        return [b for b in self.snapshot() if not b.load.load_only]

    def wait(self, predicate, timeout_s: float = 10.0, what: str = "condition"):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            result = predicate(self)
            if result:
                return result
            if self.done.is_set():
                result = predicate(self)
                if result:
                    return result
                raise AssertionError(f"stream ended ({self.code()}: {self.details()}) before {what}")
            time.sleep(0.02)
        raise AssertionError(f"{what} not reached within {timeout_s} s; {len(self.batches)} batches so far")

    def caught_up(self, timeout_s: float = 10.0) -> int:
        """The newest number once the stream has caught up (a ``load_only`` record comes only then)."""
        self.wait(lambda s: any(b.load.load_only for b in s.snapshot()), timeout_s, "a load_only record")
        return newest_sequence(self.snapshot())

    def wait_end(self, timeout_s: float = 10.0) -> grpc.StatusCode:
        assert self.done.wait(timeout_s), f"stream still open after {timeout_s} s"
        return self.code()

    def code(self) -> grpc.StatusCode | None:
        return self.error.code() if self.error is not None else None

    def details(self) -> str | None:
        return self.error.details() if self.error is not None else None

    def cancel(self) -> None:
        self.call.cancel()
        self.done.wait(5)

    def __enter__(self) -> "KvSubscription":
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()


def newest_sequence(batches) -> int | None:
    kv = [b.sequence_number for b in batches if not b.load.load_only]
    return kv[-1] if kv else None


@dataclass
class Chain:
    """What a subscriber knows after applying batches: stored blocks by hash."""

    blocks: dict[int, tuple[int | None, tuple[int, ...]]] = field(default_factory=dict)  # hash -> (parent, tokens)
    clears: int = 0

    def apply(self, batches) -> "Chain":
        for batch in batches:
            for event in batch.events:
                kind = event.WhichOneof("data")
                if kind == "cleared":
                    self.blocks.clear()
                    self.clears += 1
                elif kind == "removed":
                    for h in event.removed.block_hashes:
                        self.blocks.pop(h, None)
                elif kind == "stored":
                    stored = event.stored
                    parent = stored.parent_block_hash if stored.HasField("parent_block_hash") else None
                    for block in stored.blocks:
                        self.blocks[block.block_hash] = (parent, tuple(block.token_ids))
                        parent = block.block_hash
        return self

    def prefix_of(self, tokens: list[int], block_size: int) -> int:
        """How many whole blocks of ``tokens`` the chain holds, each with the previous as its parent."""
        children: dict[tuple[int | None, tuple[int, ...]], int] = {(p, t): h for h, (p, t) in self.blocks.items()}
        parent: int | None = None
        n = 0
        while (n + 1) * block_size <= len(tokens):
            h = children.get((parent, tuple(tokens[n * block_size : (n + 1) * block_size])))
            if h is None:
                break
            parent, n = h, n + 1
        return n


def generate(servicer: Servicer, request_id: str, prompt: list[int], max_tokens: int = 1) -> list[int]:
    replies = list(servicer.stub.Generate(generate_request(request_id, prompt, temperature=0.0,
                                                           max_tokens=max_tokens, ignore_eos=True), timeout=30))
    completes = [r.complete for r in replies if r.WhichOneof("response") == "complete"]
    assert len(completes) == 1, replies
    return list(completes[0].output_ids)


def prompt(seed: int, length: int, vocab: int = 4096) -> list[int]:
    """Distinct, deterministic prompt ids (away from the warm-up's 1000.. range)."""
    return [(seed * 7919 + i * 104729) % (vocab - 100) + 50 for i in range(length)]


def metric(samples: dict[str, float], family: str, **labels) -> float:
    for name, value in samples.items():
        if name.split("{")[0] == family and all(f'{k}="{v}"' in name for k, v in labels.items()):
            return value
    return 0.0
