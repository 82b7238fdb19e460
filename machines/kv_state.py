"""One DP rank's KV state: normalisation, drop rules, the live block set, snapshots.

``RankKv.normalise`` turns a decoded publisher batch into the neutral
``KvBatch`` a subscriber receives, applying the rules of the smg contract
§12.6, and folds what it forwards into the live block set; ``snapshot``
writes that set back out as chunks a subscriber can resync from.

Rules (§12.6, parity with the reference relays where they agree):
- dropped events are counted under one rule name each (``DROP_RULES``);
  ``event_id`` advances once per engine event, forwarded or not;
- gates, in order: ownership ``kvcr`` → ``unsupported_ownership``; locality
  other than absent/LOCAL → ``non_local_locality``; medium not in the tier
  map → ``unknown_medium``; a group whose kind is not main attention (learned
  from stores; a kind-less event follows what its group was learned as, an
  unknown group counts as main) → ``non_main_attention_group``; then, for
  stores, no hashes or no tokens → ``placeholder``; ``len(hashes) ×
  block_size ≠ len(tokens)`` → ``unaligned_blocks``; a hash repeated in the
  event or equal to its parent → ``self_referencing_hashes``;
- LoRA name and cache salt a store omits are inherited from its parent's
  live record (same tier);
- the live set is keyed ``(tier, hash)`` with a copy count capped at
  ``COPIES_CAP``: a store adds one copy per hash, a removal takes one away
  (the record goes with the last), a clear empties the rank. A subscriber
  that applies forwarded events by the same rule holds the same set; that is
  the invariant the relay's property tests check.

Sans-io; deterministic (iteration follows insertion order).
"""

from __future__ import annotations

from collections import Counter
from typing import Final, Iterator

from enginelink.wire.kv_batch import (
    ExtraKey,
    KvBatch,
    KvBlock,
    KvCleared,
    KvEvent,
    KvRemoved,
    KvSnapshotChunk,
    KvStored,
    Locality,
    Tier,
    cache_level_of,
)
from enginelink.wire.kv_events import WireBatch, WireCleared, WireMalformed, WireRemoved, WireStored, WireUnknown

COPIES_CAP: Final = 8
MAIN_ATTENTION_KINDS: Final = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
DROP_RULES: Final = (
    "unknown_type", "malformed", "unsupported_ownership", "non_local_locality", "unknown_medium",
    "non_main_attention_group", "placeholder", "unaligned_blocks", "self_referencing_hashes",
)  # fmt: skip

_TIERS: Final = {
    **dict.fromkeys(("GPU", "DEVICE"), Tier.DEVICE),
    **dict.fromkeys(("CPU", "CPU_PINNED", "CPU_TIER1"), Tier.HOST),
    **dict.fromkeys(("CPU_TIER2", "DISK", "NVME", "STORAGE"), Tier.DISK),
    **dict.fromkeys(("EXTERNAL", "NETWORK", "REMOTE", "SHARED"), Tier.EXTERNAL),
}


def tier_of(medium: str | None) -> Tier | None:
    """The tier a medium names; absent = device; None for a medium we do not know."""
    return Tier.DEVICE if medium is None else _TIERS.get(medium.upper())


class _Drop(Exception):
    def __init__(self, rule: str) -> None:
        self.rule = rule


class LiveBlock:
    """A live block: the block as last stored, the event header it came with, its copies."""

    __slots__ = ("block", "parent", "header", "attrs", "copies")

    def __init__(self, block: KvBlock, parent: int | None, header: KvStored, attrs: tuple, copies: int) -> None:
        self.block = block
        self.parent = parent
        self.header = header  # the KvStored it arrived in (its blocks are not used from here)
        self.attrs = attrs  # the header's fields but blocks and parent: what a snapshot chain shares
        self.copies = copies


class RankKv:
    """Normaliser and live block set of one rank (one publisher incarnation)."""

    def __init__(self, rank: int, drops: Counter) -> None:
        self.rank = rank
        self.drops = drops  # shared with the relay: counts by rule name
        self.blocks: dict[tuple[int, int], LiveBlock] = {}
        self.groups: dict[int, bool] = {}  # group_idx -> is main attention
        self.event_id = 0
        self.forwarded = Counter()  # stored / removed / cleared

    def reset(self) -> None:
        self.blocks.clear()
        self.groups.clear()
        self.event_id = 0

    # ---- normalisation ----------------------------------------------------

    def normalise(self, wire: WireBatch, seq: int) -> KvBatch:
        """The batch a subscriber gets, numbered ``seq`` (the relay's served number)."""
        for event in wire.events:  # learn the batch's groups first: stores may follow their removals
            if isinstance(event, WireStored) and event.group_idx is not None and event.kv_cache_spec_kind:
                self.groups[event.group_idx] = event.kv_cache_spec_kind in MAIN_ATTENTION_KINDS
        out: list[KvEvent] = []
        for event in wire.events:
            self.event_id += 1
            try:
                data = self._one(event)
            except _Drop as drop:
                self.drops[drop.rule] += 1
                continue
            out.append(KvEvent(self.event_id, data))
        return KvBatch(seq, wire.ts, tuple(out), self.rank)

    def _one(self, event) -> KvStored | KvRemoved | KvCleared:
        match event:
            case WireStored():
                return self._stored(event)
            case WireRemoved():
                return self._removed(event)
            case WireCleared(ownership=ownership):
                if _agent(ownership):
                    raise _Drop("unsupported_ownership")
                self.blocks.clear()
                self.forwarded["cleared"] += 1
                return KvCleared(ownership)
            case WireUnknown():
                raise _Drop("unknown_type")
            case WireMalformed():
                raise _Drop("malformed")
        raise AssertionError(f"unhandled wire event {event!r}")

    def _gates(self, event: WireStored | WireRemoved, kind: str | None) -> Tier:
        if _agent(event.ownership):
            raise _Drop("unsupported_ownership")
        if event.locality is not None and event.locality.upper() != "LOCAL":
            raise _Drop("non_local_locality")
        tier = tier_of(event.medium)
        if tier is None:
            raise _Drop("unknown_medium")
        if event.group_idx is not None:
            main = kind in MAIN_ATTENTION_KINDS if kind else self.groups.get(event.group_idx, True)
            if not main:
                raise _Drop("non_main_attention_group")
        return tier

    def _stored(self, e: WireStored) -> KvStored:
        tier = self._gates(e, e.kv_cache_spec_kind)
        hashes, tokens, size = e.block_hashes, e.token_ids, e.block_size
        if not hashes or not tokens:
            raise _Drop("placeholder")
        if size <= 0 or size > 0x7FFFFFFF or len(hashes) * size != len(tokens):
            raise _Drop("unaligned_blocks")
        if len(set(hashes)) != len(hashes) or (e.parent_block_hash is not None and e.parent_block_hash in hashes):
            raise _Drop("self_referencing_hashes")
        lora_name, salt = e.lora_name, e.cache_salt
        if (lora_name is None or salt is None) and e.parent_block_hash is not None:
            parent = self.blocks.get((tier, e.parent_block_hash))
            if parent is not None:
                lora_name = lora_name if lora_name is not None else parent.header.lora_name
                salt = salt if salt is not None else parent.header.cache_salt
        level = cache_level_of(tier)
        extra = e.extra_keys or ()
        blocks = tuple(
            KvBlock(h, tokens[i * size : (i + 1) * size], size, e.lora_id, level, _extra_keys(extra, i))
            for i, h in enumerate(hashes)
        )
        header = KvStored(
            blocks=blocks, parent_block_hash=e.parent_block_hash, tier=int(tier), medium=e.medium,
            group_idx=e.group_idx, kv_cache_spec_kind=e.kv_cache_spec_kind,
            kv_cache_spec_sliding_window=e.kv_cache_spec_sliding_window, locality=int(Locality.LOCAL),
            ownership=e.ownership, session_id=e.session_id, lora_name=lora_name, cache_salt=salt,
        )  # fmt: skip
        parent = e.parent_block_hash
        attrs = _attrs(header)
        for block in blocks:
            key = (int(tier), block.block_hash)
            live = self.blocks.get(key)
            copies = 1 if live is None else min(live.copies + 1, COPIES_CAP)
            self.blocks[key] = LiveBlock(block, parent, header, attrs, copies)
            parent = block.block_hash
        self.forwarded["stored"] += 1
        return header

    def _removed(self, e: WireRemoved) -> KvRemoved:
        tier = self._gates(e, None)
        for h in e.block_hashes:
            key = (int(tier), h)
            live = self.blocks.get(key)
            if live is not None:
                live.copies -= 1
                if live.copies <= 0:
                    del self.blocks[key]
        self.forwarded["removed"] += 1
        return KvRemoved(
            e.block_hashes, cache_level_of(tier), int(tier), e.medium, e.group_idx, int(Locality.LOCAL), e.ownership
        )

    # ---- the live set and snapshots ---------------------------------------

    def live_set(self) -> dict[tuple[int, int], int]:
        """``{(tier, hash): copies}``."""
        return {key: live.copies for key, live in self.blocks.items()}

    def block_count(self) -> int:
        return sum(live.copies for live in self.blocks.values())

    def snapshot(self, cut: int, ts: float, unknown_before: int, chunk_blocks: int, chunks_max: int) -> list[KvBatch]:
        """The live set as chunks numbered ``.. cut``: chunk 0 opens with a clear; parents first.

        One stored block per physical copy; chains of blocks that share their
        event header go out as one event. At most ``chunk_blocks`` blocks per
        chunk, more only when ``chunks_max`` (the sequence numbers this
        incarnation has used up to the cut) leaves too few chunks.
        """
        events: list[KvStored] = list(self._snapshot_events())
        total = sum(len(e.blocks) for e in events)
        wanted = max(1, min(-(-total // chunk_blocks), chunks_max))
        per_chunk = max(1, -(-total // wanted))
        chunks: list[list[KvEvent]] = [[KvEvent(0, KvCleared())]]
        room = per_chunk
        for event in events:
            blocks, parent = event.blocks, event.parent_block_hash
            while blocks:
                if room == 0:
                    chunks.append([])
                    room = per_chunk
                part, blocks = blocks[:room], blocks[room:]
                chunks[-1].append(KvEvent(0, _with_blocks(event, part, parent)))
                parent = part[-1].block_hash
                room -= len(part)
        count = len(chunks)
        return [
            KvBatch(cut - count + 1 + i, ts, tuple(c), self.rank, KvSnapshotChunk(i, count, total, unknown_before))
            for i, c in enumerate(chunks)
        ]

    def _snapshot_events(self) -> Iterator[KvStored]:
        children: dict[tuple[int, int], list[tuple[int, int]]] = {}
        roots: list[tuple[int, int]] = []
        for key, live in self.blocks.items():
            parent = (key[0], live.parent) if live.parent is not None else None
            if parent is not None and parent in self.blocks and parent != key:
                children.setdefault(parent, []).append(key)
            else:
                roots.append(key)
        order: list[tuple[int, int]] = []
        seen: set[tuple[int, int]] = set()
        for start in roots + list(self.blocks):  # then whatever a parent cycle kept from the roots
            if start in seen:
                continue
            stack = [start]
            while stack:
                key = stack.pop()
                if key in seen:
                    continue
                seen.add(key)
                order.append(key)
                stack.extend(reversed(children.get(key, ())))
        for copy in range(1, COPIES_CAP + 1):
            run: list[LiveBlock] = []
            for key in order:
                live = self.blocks[key]
                if live.copies < copy:
                    continue
                if run and not (live.parent == run[-1].block.block_hash and live.attrs == run[-1].attrs):
                    yield _chain(run)
                    run = []
                run.append(live)
            if run:
                yield _chain(run)


def _attrs(h: KvStored) -> tuple:
    return (h.tier, h.medium, h.group_idx, h.kv_cache_spec_kind, h.kv_cache_spec_sliding_window, h.locality,
            h.ownership, h.session_id, h.lora_name, h.cache_salt)  # fmt: skip


def _chain(run: list[LiveBlock]) -> KvStored:
    return _with_blocks(run[0].header, tuple(live.block for live in run), run[0].parent)


def _with_blocks(header: KvStored, blocks: tuple[KvBlock, ...], parent: int | None) -> KvStored:
    return KvStored(
        blocks, parent, header.tier, header.medium, header.group_idx, header.kv_cache_spec_kind,
        header.kv_cache_spec_sliding_window, header.locality, header.ownership, header.session_id,
        header.lora_name, header.cache_salt,
    )  # fmt: skip


def _agent(ownership: str | None) -> bool:
    return ownership is not None and ownership.lower() == "kvcr"


def _extra_keys(per_block: tuple, i: int) -> tuple[ExtraKey, ...]:
    items = per_block[i] if i < len(per_block) else None
    if not items:
        return ()
    out = []
    for item in items:
        if isinstance(item, str):
            out.append(ExtraKey(text=item))
        elif isinstance(item, (bytes, bytearray)):
            out.append(ExtraKey(blob=bytes(item)))
        elif isinstance(item, int) and not isinstance(item, bool) and -(1 << 63) <= item < 1 << 63:
            out.append(ExtraKey(number=item))
        elif (
            isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)
            and isinstance(item[1], int) and not isinstance(item[1], bool)
        ):  # fmt: skip
            out.append(ExtraKey(multimodal=(item[0], max(-(1 << 63), min(item[1], (1 << 63) - 1)))))
    return tuple(out)
