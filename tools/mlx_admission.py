"""When the MLX engine lets new requests into mlx-lm's batch: a burst at a time, not one by one.

Why: mlx-lm's ``BatchGenerator`` admits whatever was inserted before each
``next()``. A request that joins a batch alone costs a prefill forward and
a first decode forward of its own and a merge of the batch's KV cache, and
it then runs one step out of phase with the rest: it ends on a step of its
own, so its successor joins alone too. Over the wire a burst (a router
answering finished streams with new ones) lands spread over a millisecond
or more; admitted as it landed, the first request of the burst started a
step ahead of the others and the batch never came back into step: on the
tiny test model such steps cost a third more CPU than the same batch in
step, and the split joins more on top (docs/benchmarks-history.md, MLX). mlx-lm
driven in-process inserts a burst at once; the reference servicer waits for
an idle engine's burst (``MLX_COALESCE_MS``, 50 ms).

The rule, checked before each step: held requests go in together once no
request has arrived for ``gap_s``, or ``max_s`` after the first of them
arrived, or as soon as they fill every free slot of the batch (none could
join later anyway). With steps longer than the gap (the usual case) a
running batch's newcomers still join at the next step unless they arrived
in the last ``gap_s`` before it; an idle engine waits out the burst.
``max_s`` 0 admits every request at once (mlx-lm's own behaviour).

Pure bookkeeping (no MLX, no clock): ``mlx_core`` holds its requests here
and passes ``now``; ``mlx_engine``'s loop polls for at most ``wait_s``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

GAP_MS_DEFAULT = 5.0  # a burst through the servicer lands within ~1 ms per request on a loaded 2-core machine
MAX_MS_DEFAULT = 50.0  # the most a held request waits (the reference's MLX_COALESCE_MS)


class Admission(Generic[T]):
    """Requests held until their burst is complete."""

    def __init__(self, gap_s: float = GAP_MS_DEFAULT / 1000, max_s: float = MAX_MS_DEFAULT / 1000) -> None:
        if gap_s < 0 or max_s < 0:
            raise ValueError(f"admission gap {gap_s} s / max {max_s} s: expected >= 0")
        self.gap_s = gap_s
        self.max_s = max_s
        self.held: list[T] = []
        self._first = self._last = 0.0
        # What each burst was let in by ("full": it filled the free slots, "gap", "max", "at_once": max 0),
        # and its sizes: the engine names them when it stops (an out-of-step run shows as small bursts).
        self.due_by: Counter[str] = Counter()
        self.sizes: Counter[int] = Counter()

    def __len__(self) -> int:
        return len(self.held)

    def hold(self, item: T, now: float) -> None:
        if not self.held:
            self._first = now
        self._last = now
        self.held.append(item)

    def drop(self, gone: Callable[[T], bool]) -> list[T]:
        """Take out the held requests ``gone`` picks (aborted); the rest keep their burst's times."""
        out = [x for x in self.held if gone(x)]
        if out:
            self.held = [x for x in self.held if not gone(x)]
        return out

    def wait_s(self, now: float, free_slots: int) -> float | None:
        """Seconds until the held burst is due; 0: due now; None: nothing held."""
        if not self.held:
            return None
        if self.max_s <= 0 or len(self.held) >= free_slots:
            return 0.0
        return max(0.0, min(self._last + self.gap_s, self._first + self.max_s) - now)

    def take_due(self, now: float, free_slots: int) -> list[T]:
        """The held burst if it is due (all of it: mlx-lm queues what the batch has no room for yet), else []."""
        if self.wait_s(now, free_slots) != 0.0:
            return []
        if self.max_s <= 0:
            self.due_by["at_once"] += 1
        elif len(self.held) >= free_slots:
            self.due_by["full"] += 1
        elif now >= self._first + self.max_s:
            self.due_by["max"] += 1
        else:
            self.due_by["gap"] += 1
        out, self.held = self.held, []
        self.sizes[len(out)] += 1
        return out

    def summary(self) -> str:
        """``bursts 8x11 4x2 (full 11, gap 2)``: sizes x how often, largest first, and what let them in."""
        sizes = burst_sizes(self.sizes) or "none"
        due = ", ".join(f"{why} {n}" for why, n in self.due_by.most_common())
        return f"bursts {sizes}" + (f" ({due})" if due else "")


def burst_sizes(sizes: Counter[int]) -> str:
    """``8x11 4x2``: burst sizes x how often, largest first."""
    return " ".join(f"{size}x{n}" for size, n in sorted(sizes.items(), reverse=True))
