"""The sim engine's KV-event publisher: vLLM's, SGLang's or TokenSpeed's ``ZmqEventPublisher``, sans-io.

``SimKvPublisher`` numbers batches (from 0 per publisher), keeps the last
``buffer_steps`` encoded batches for replay and answers replay requests,
exactly as the engine its wire plays does on the wire (``dialect``:
``wire/kv_events.py`` for vLLM, ``wire/kv_engines.py`` for SGLang, one
BlockStored per page with signed hashes and ``cache_salt``, and TokenSpeed,
tag-first arrays, no clear).
``KvEventHooks`` plugs it into ``SimEngineCore``: the core reports blocks
stored (full blocks only, with their parent hash and token ids), removed
(LRU eviction) and cleared (``reset_prefix_cache``); the hooks gather them
and publish one batch per engine step that has events — never between
steps, like vLLM, so a clear on an idle engine goes out with the next step.

Fault switches (for tests; config ``SimKvFaults`` or the utility call
``enginelink_sim_kv_fault(kind, count)``):
- ``skip``: the next batches take a sequence number and go nowhere, not even
  into the replay buffer (an unrecoverable hole);
- ``drop``: the next batches are buffered for replay but never sent on PUB
  (lost on the wire; a relay can repair them);
- ``restart``: the publisher starts over — sequence back to 0, replay buffer
  empty, the core's prefix cache emptied, and the new incarnation's first
  batch opens with a startup ``AllBlocksCleared`` (as SGLang's does).

Rules: no sockets, no clock (timestamps are the core's ``now`` plus a fixed
offset the process shell chooses), bounded by ``buffer_steps``.
"""

from __future__ import annotations

from collections import deque

import msgspec

from enginelink.machines.sim_core import SimHooks
from enginelink.wire import kv_engines, kv_events as kv

FAULT_KINDS = ("skip", "drop", "restart")


class SimKvFaults(msgspec.Struct, frozen=True, kw_only=True):
    skip_seqs: frozenset[int] = frozenset()  # sequence numbers never sent nor buffered
    drop_seqs: frozenset[int] = frozenset()  # sequence numbers buffered but not sent
    restart_after_batches: int | None = None  # restart once after this many batches
    replay_topic: bool = True  # False: TokenSpeed's replay replies (older SGLang's too), without the topic frame


class SimKvPublisher:
    def __init__(self, config: kv_engines.EngineKvConfig, rank: int = 0, faults: SimKvFaults | None = None,
                 dialect: str = "vllm") -> None:  # fmt: skip
        self.config = config
        self.dialect = dialect
        self.rank = rank
        self.topic = config.topic.encode()
        self.faults = faults or SimKvFaults()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.seq = 0
        self.skip_next = 0
        self.drop_next = 0
        self.published = 0  # batches numbered, all incarnations
        self.last: tuple[int, bytes] | None = None  # the last batch numbered, sent or not
        self.restarts = 0

    def publish(self, events: list[kv.EngineKvEvent], ts: float) -> list[bytes] | None:
        """Number and encode one batch; the PUB message to send, or None if a fault ate it (or, on
        TokenSpeed's wire, the step's events were only a clear, which its scheduler never publishes)."""
        if self.dialect == "tokenspeed":
            events = [e for e in events if not isinstance(e, kv.AllBlocksCleared)]
            if not events:
                return None
        seq = self.seq
        self.seq += 1
        self.published += 1
        payload = kv_engines.encode_batch(self.dialect, ts, events, self.rank)
        self.last = (seq, payload)
        if self.skip_next or seq in self.faults.skip_seqs:
            self.skip_next = max(0, self.skip_next - 1)
            return None
        self.buffer.append((seq, payload))
        if self.drop_next or seq in self.faults.drop_seqs:
            self.drop_next = max(0, self.drop_next - 1)
            return None
        return kv.pub_message(self.topic, seq, payload)

    def replay(self, start_seq: int) -> list[list[bytes]]:
        """The replies to one replay request (identity not included), end marker last."""
        topic = self.topic if self.faults.replay_topic else None
        replies = [kv.replay_reply(topic, seq, payload) for seq, payload in self.buffer if seq >= start_seq]
        replies.append(kv.replay_end(self.faults.replay_topic))
        return replies

    def restart(self) -> None:
        self.seq = 0
        self.buffer.clear()
        self.restarts += 1


class KvEventHooks(SimHooks):
    """Core hooks that publish the core's prefix-cache changes once per step."""

    def __init__(self, publisher: SimKvPublisher, block_size: int, ts_offset: float = 0.0) -> None:
        self.publisher = publisher
        self.block_size = block_size
        self.ts_offset = ts_offset
        self.events: list[kv.EngineKvEvent] = []
        self.outbox: list[list[bytes]] = []
        self.core = None  # set by SimEngineCore (attach)
        self._restart_done = False

    def blocks_stored(self, block_hashes: list[int], parent: int | None, token_ids: list[int],
                      extra_keys: list[list | None] | None = None) -> None:  # fmt: skip
        self.events.append(
            kv.BlockStored(
                block_hashes=list(block_hashes), parent_block_hash=parent, token_ids=list(token_ids),
                block_size=self.block_size, lora_id=None, medium="GPU", lora_name=None,
                extra_keys=extra_keys if extra_keys is not None else [None] * len(block_hashes),
                group_idx=0, kv_cache_spec_kind="full_attention",
            )  # fmt: skip
        )

    def blocks_removed(self, block_hashes: list[int]) -> None:
        self.events.append(kv.BlockRemoved(block_hashes=list(block_hashes), medium="GPU", group_idx=0))

    def cache_cleared(self) -> None:
        self.events.append(kv.AllBlocksCleared())

    def attach(self, core) -> None:
        self.core = core

    def step_done(self, now: float) -> None:
        if not self.events:
            return
        events, self.events = self.events, []
        message = self.publisher.publish(events, now + self.ts_offset)
        if message is not None:
            self.outbox.append(message)
        after = self.publisher.faults.restart_after_batches
        if after is not None and not self._restart_done and self.publisher.published >= after:
            self._restart_done = True
            self.kv_fault("restart", 1)

    def kv_fault(self, kind: str, count: int) -> str | None:
        match kind:
            case "skip":
                self.publisher.skip_next += count
            case "drop":
                self.publisher.drop_next += count
            case "restart":
                # The engine "restarted": its cache is gone, its unsent events with it, and
                # the new publisher's first batch opens with a startup clear.
                self.publisher.restart()
                if self.core is not None:
                    self.core.forget_prefix_cache()
                self.events = [kv.AllBlocksCleared()]
            case _:
                return f"unknown KV fault {kind!r}; known: {', '.join(FAULT_KINDS)}"
        return None

    def take_messages(self) -> list[list[bytes]]:
        """PUB messages to send now, oldest first."""
        out, self.outbox = self.outbox, []
        return out
