"""Pair helpers for the KV relay tests: hand-made publisher frames, a subscriber
model that checks what it receives, and a sim engine + publisher + lossy wire
wired to a relay in memory.

``Subscriber`` is the contract's consumer written down: it applies batches by
the rule the relay's live set keeps (copies per (rank, tier, hash), cap 8;
removal takes one; clear empties the rank; snapshot chunk 0 opens with a
clear) and asserts the sequence rules on the way: per rank every batch is the
one after the last (snapshot chunks included), a resumed cursor continues at
cursor + 1, a complete history starts at 0, a snapshot comes first.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import msgspec

from enginelink.machines.kv_relay import FetchReplay, Journal, KvRelay, Plan, Refused
from enginelink.machines.kv_state import COPIES_CAP
from enginelink.machines.sim_core import SimConfig, SimEngineCore
from enginelink.tools.sim_kv import KvEventHooks, SimKvPublisher
from enginelink.wire import kv_events as kv
from enginelink.wire import vllm
from enginelink.wire.engine import GenerateSpec, SamplingSpec
from enginelink.wire.kv_batch import KvBatch, KvCleared, KvRemoved, KvStored

TOPIC = b"kv"
CODEC = vllm.VllmCodec()


# ---- hand-made frames ----------------------------------------------------------


def payload(*events: Any, ts: float = 1.0, rank: int | None = 0) -> bytes:
    """A publisher batch; events may be wire structs or raw dicts/lists."""
    return msgspec.msgpack.encode([ts, list(events), rank])


def msg(seq: int, *events: Any, ts: float = 1.0, rank: int | None = 0) -> list[bytes]:
    return kv.pub_message(TOPIC, seq, payload(*events, ts=ts, rank=rank))


def stored(hashes: list[int], parent: int | None = None, bs: int = 2, tokens: list[int] | None = None,
           **fields: Any) -> kv.BlockStored:  # fmt: skip
    fields.setdefault("medium", "GPU")
    if tokens is None:
        tokens = [(h * 7 + i) % 1000 for h in hashes for i in range(bs)]
    return kv.BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=bs, lora_id=None,
        lora_name=fields.pop("lora_name", None), **fields,
    )  # fmt: skip


def removed(hashes: list[int], **fields: Any) -> kv.BlockRemoved:
    fields.setdefault("medium", "GPU")
    return kv.BlockRemoved(block_hashes=hashes, **fields)


def cleared() -> kv.AllBlocksCleared:
    return kv.AllBlocksCleared()


# ---- the subscriber model ------------------------------------------------------


class Subscriber:
    def __init__(self, relay: KvRelay, cursor: int, blocks: dict | None = None) -> None:
        """``blocks``: what a resuming subscriber already holds (its state after ``cursor``)."""
        self.relay = relay
        self.cursor = cursor
        self.blocks: dict[tuple[int, int, int], int] = dict(blocks or {})
        self.last: dict[int, int] = {}
        self.snapshot_next: dict[int, int] = {}  # rank -> next chunk index expected
        self.mid_snapshot = False  # some chunks applied, not all: its cursor is no state to resume from
        self.received: list[KvBatch] = []
        self.end = None
        result = relay.subscribe(cursor, 0.0)
        self.refused = result if isinstance(result, Refused) else None
        self.id = result.subscriber if isinstance(result, Plan) else None
        self.modes = result.modes if isinstance(result, Plan) else {}
        self.bases = {rank: r.base for rank, r in relay.ranks.items()}  # what a complete history starts at

    @property
    def open(self) -> bool:
        return self.refused is None and self.end is None

    def pull(self, max_batches: int | None = None) -> int:
        """Pull once and apply; how many batches came."""
        if not self.open:
            return 0
        got = self.relay.pull(self.id, max_batches)
        for batch in got.batches:
            self.apply(batch)
        if got.end is not None:
            self.end = got.end
            self.relay.unsubscribe(self.id, 0.0)
        return len(got.batches)

    def drain(self, max_batches: int = 7) -> None:
        while self.open and self.pull(max_batches):
            pass

    def apply(self, batch: KvBatch) -> None:
        rank, seq = batch.dp_rank, batch.sequence_number
        assert rank in self.modes, f"batch for unknown rank {rank}"
        chunk = batch.snapshot
        if chunk is not None:
            assert self.modes[rank] == "snapshot", "a snapshot chunk on a stream that asked for none"
            assert chunk.index == self.snapshot_next.get(rank, 0), "snapshot chunks out of order"
            assert chunk.count >= 1 and chunk.index < chunk.count and chunk.unknown_before >= 0
            if chunk.index == 0:
                assert rank not in self.last, "a snapshot after other batches"
                assert isinstance(batch.events[0].data, KvCleared), "chunk 0 must open with a clear"
            else:
                assert seq == self.last[rank] + 1, f"snapshot chunk sequence {seq} after {self.last[rank]}"
            self.snapshot_next[rank] = chunk.index + 1
            self.mid_snapshot = chunk.index + 1 < chunk.count
            assert all(e.event_id == 0 for e in batch.events)
        elif rank in self.last:
            assert seq == self.last[rank] + 1, f"rank {rank}: batch {seq} after {self.last[rank]} (a silent skip)"
        else:
            mode = self.modes[rank]
            assert mode != "snapshot", "the snapshot must come first"
            if mode == "resume":
                assert seq == self.cursor + 1, f"resumed at {self.cursor} but got {seq}"
            elif mode == "history":
                assert seq == self.bases[rank], f"a complete history starts at {self.bases[rank]}, not {seq}"
        self.last[rank] = seq
        self.received.append(batch)
        for event in batch.events:
            apply_event(self.blocks, rank, event.data)


def apply_event(blocks: dict, rank: int, data: Any) -> None:
    match data:
        case KvCleared():
            for key in [k for k in blocks if k[0] == rank]:
                del blocks[key]
        case KvStored(tier=tier):
            for block in data.blocks:
                key = (rank, tier, block.block_hash)
                blocks[key] = min(blocks.get(key, 0) + 1, COPIES_CAP)
        case KvRemoved(tier=tier):
            for h in data.block_hashes:
                key = (rank, tier, h)
                if key in blocks:
                    blocks[key] -= 1
                    if blocks[key] <= 0:
                        del blocks[key]


# ---- a sim engine, its publisher, a lossy wire, a relay -------------------------


class Pair:
    """Sim engine core + KV publisher → in-flight PUB messages → relay.

    The wire keeps messages in flight until delivered, so tests can drop,
    duplicate or reorder them; replay fetches wait until answered, from the
    publisher's buffer as it is at that moment. Every journal action the relay
    returns is kept, for the fold check.
    """

    def __init__(self, relay: KvRelay, *, block_size: int = 4, num_gpu_blocks: int = 10,
                 buffer_steps: int = 10_000, rank: int = 0) -> None:  # fmt: skip
        config = kv.KvEventsConfig(enable_kv_cache_events=True, topic="kv", replay_endpoint="tcp://*:0",
                                   buffer_steps=buffer_steps)  # fmt: skip
        self.rank = rank
        self.publisher = SimKvPublisher(config, rank)
        self.hooks = KvEventHooks(self.publisher, block_size)
        self.core = SimEngineCore(
            SimConfig(vocab_size=64, max_model_len=256, block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                      engine_index=rank),
            self.hooks,
        )  # fmt: skip
        self.numbered: dict[int, list[bytes]] = {}  # publisher incarnation -> every payload it numbered
        publish = self.publisher.publish

        def recording_publish(events, ts):
            message = publish(events, ts)
            self.numbered.setdefault(self.publisher.restarts, []).append(self.publisher.last[1])
            return message

        self.publisher.publish = recording_publish
        self.relay = relay
        self.wire: deque[tuple[int, list[bytes]]] = deque()  # (publisher incarnation, message)
        self.fetches: deque[FetchReplay] = deque()
        self.journal: list[Journal] = []
        self.now = 0.0
        self._rid = 0

    # engine side
    def request(self, prompt: list[int], max_tokens: int = 2) -> None:
        self._rid += 1
        spec = GenerateSpec(request_id=f"r{self._rid}", prompt_token_ids=prompt,
                            sampling=SamplingSpec(max_tokens=max_tokens, ignore_eos=True))  # fmt: skip
        self.core.handle_input(*CODEC.encode_add(spec), self.now)
        self.run()

    def reset_cache(self) -> None:
        self.core.handle_input(*CODEC.encode_utility(1, "reset_prefix_cache", ()), self.now)

    def run(self) -> None:
        while self.core.has_work:
            self.now += 0.01
            self.core.step(self.now)
        self._collect()

    def flush(self) -> None:
        """Publish events a step has not published yet (test only: no real engine does this)."""
        self.hooks.step_done(self.now)
        self._collect()

    def _collect(self) -> None:
        for message in self.hooks.take_messages():
            self.wire.append((self.publisher.restarts, message))

    # wire side
    def deliver(self, n: int = 1) -> None:
        for _ in range(min(n, len(self.wire))):
            _, message = self.wire.popleft()
            self._act(self.relay.on_live(self.rank, message, self.now))

    def answer(self, complete: bool = True, keep: int | None = None) -> None:
        if not self.fetches:
            return
        fetch = self.fetches.popleft()
        replies = self.publisher.replay(fetch.start_seq)
        if not complete:
            replies = replies[: keep or 0]  # what came before the timeout; no end marker
        self._act(self.relay.on_replay(fetch.rank, fetch.token, replies, complete, self.now))

    def settle(self) -> None:
        """Everything in flight delivered and every fetch answered, until quiet."""
        self.flush()
        while self.wire or self.fetches:
            self.deliver(len(self.wire))
            while self.fetches:
                self.answer()

    def _act(self, actions: list) -> None:
        for action in actions:
            if isinstance(action, FetchReplay):
                self.fetches.append(action)
            elif isinstance(action, Journal):
                self.journal.append(action)

    def relay_saw_everything(self) -> bool:
        """The relay's current incarnation is exactly the publisher's: every batch, in order."""
        current = self.relay.ranks[self.rank].inc
        accepted = [j.payload["payload"] for j in self.journal
                    if j.kind == "kv.batch" and j.payload["inc"] == current and j.payload["rank"] == self.rank]
        lost = any(j.kind == "kv.lost" and j.payload["inc"] == current for j in self.journal)
        return not lost and accepted == self.numbered.get(self.publisher.restarts, [])

    def engine_blocks(self) -> dict[tuple[int, int, int], int]:
        """What the engine's prefix cache holds, as the relay keys it (device tier)."""
        return {(self.rank, 1, kv.fold_hash(h)): 1 for h in self.core._cache}


def state_at(journal: list[Journal], ranks: list[int], config: Any, rank: int, cursor: int) -> dict:
    """The live set a subscriber holds after applying the rank's batches up to ``cursor`` of the
    current incarnation: the journal folded up to there (replay = fold)."""
    records = [j for j in journal if j.payload.get("rank") == rank or j.kind not in ("kv.batch", "kv.lost")]
    incarnations = [j.payload for j in records if j.kind == "kv.incarnation"]
    current, base = (incarnations[-1]["inc"], incarnations[-1]["base"]) if incarnations else (0, 0)
    folded = KvRelay(ranks, config)
    for j in records:
        p = j.payload
        if j.kind in ("kv.batch", "kv.lost") and p["rank"] == rank and p["inc"] == current:
            if base + (p["seq"] if j.kind == "kv.batch" else p["first"]) > cursor:
                break
        folded.apply_record(j.kind, p)
    return {k: v for k, v in folded.live_set().items() if k[0] == rank}
