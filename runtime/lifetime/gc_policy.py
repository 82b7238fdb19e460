"""The servicer's cyclic garbage collector, set once the servicer serves.

Measured with ``gc.callbacks`` in the servicer under ``enginelink bench``
(c=128, a real engine's pace; ``docs/benchmarks-history.md``, "Stop 17"), the
collector took about a tenth of the servicer's CPU, 1.9 us per token on
the vLLM contract and 2.5 on SGLang's: a young collection every few
engine steps (each step allocates a list, a tuple or a struct per token),
and every full collection walked the whole start-up heap (the tokenizer,
protobuf descriptors, grpclib, the model's facts): 30-45 ms each.

So, at SERVING (never during start-up, whose garbage is collected first):

- ``gc.freeze()``: what start-up built is moved out of the collector's
  generations. It lives as long as the process, so no collection needs to
  walk it again.
- The young generation's threshold is raised (``ENGINELINK_GC_YOUNG``,
  default 20,000 allocations; Python's is 700): most per-token objects die by
  reference count before a collection would look at them, so fewer and
  cheaper collections. Garbage cycles are still collected, just later; the
  young generation holds at most that many container objects more.

``ENGINELINK_GC_FREEZE=0`` and ``ENGINELINK_GC_YOUNG=700`` give Python's own
behaviour back. The simulation's in-memory servicers never call this: it is
the process's policy, set by ``server.serve`` only.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace

from enginelink.runtime.env_flags import on_off

FREEZE_ENV = "ENGINELINK_GC_FREEZE"
YOUNG_ENV = "ENGINELINK_GC_YOUNG"
YOUNG_DEFAULT = 20_000


@dataclass(frozen=True)
class GcPolicy:
    freeze: bool = True
    young: int = YOUNG_DEFAULT  # allocations between young collections (``gc.set_threshold``'s first)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> GcPolicy:
        """The knobs; ValueError names the one that is wrong."""
        freeze = on_off(env, FREEZE_ENV)
        young_raw = env.get(YOUNG_ENV, "").strip()
        try:
            young = int(young_raw) if young_raw else YOUNG_DEFAULT
        except ValueError:
            raise ValueError(f"{YOUNG_ENV}={young_raw!r}: expected a count of allocations (Python's own is 700)") \
                from None
        if not 1 <= young <= 10_000_000:
            raise ValueError(f"{YOUNG_ENV}={young}: expected 1 to 10,000,000 allocations (Python's own is 700)")
        return cls(freeze=freeze, young=young)

    def apply(self) -> None:
        """Collect start-up's garbage, then freeze what is left and set the young threshold."""
        if self.freeze:
            gc.collect()
            gc.freeze()
        _, middle, old = gc.get_threshold()
        gc.set_threshold(self.young, middle, old)

    @staticmethod
    def stats() -> SimpleNamespace:
        """For the metrics (``smg_servicer_gc_*``): what was frozen, the young threshold in force, and the
        collections each generation ran since the process started."""
        counts = gc.get_stats()
        return SimpleNamespace(frozen_objects=gc.get_freeze_count(), young_threshold=gc.get_threshold()[0],
                               collections_young=counts[0]["collections"],
                               collections_middle=counts[1]["collections"],
                               collections_full=counts[2]["collections"])
