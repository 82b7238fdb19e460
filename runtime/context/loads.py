"""Engine load, from the scheduler stats that ride on engine output frames.

GetLoads answers from here. Every served rank is present (``served``: the
link's DP ranks once its handshake named them; the first rank before), zero
filled before its first stats arrive, so the router sees a responsive worker
and every rank it may pin. A rank's load is a ``RankLoad``, contract-neutral:
each contract's service encodes it into its own ``SchedulerLoad`` (the fields
are named as the protos name them).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from enginelink.wire.engine import SchedulerStats

# Generated-token samples kept per rank for gen_throughput.
THROUGHPUT_WINDOW_S = 2.0


@dataclass(frozen=True, slots=True)
class RankLoad:
    """One DP rank's load, as every contract's ``SchedulerLoad`` carries it."""

    dp_rank: int
    num_running_reqs: int
    num_waiting_reqs: int
    num_total_reqs: int
    num_used_tokens: int
    max_total_num_tokens: int
    token_usage: float
    utilization: float
    gen_throughput: float
    cache_hit_rate: float
    max_running_requests: int


class Loads:
    def __init__(self, first_rank: int = 0) -> None:
        self.first_rank = first_rank
        self.served: tuple[int, ...] = (first_rank,)
        self.stats: dict[int, SchedulerStats] = {}
        self.stats_at: dict[int, float] = {}  # rank -> when its newest stats arrived (a load record's age_ms)
        self._generated: dict[int, deque[tuple[float, int]]] = {}

    def update(self, rank: int, stats: SchedulerStats | None, generated_tokens: int, now: float) -> None:
        if stats is not None:
            self.stats[rank] = stats
            self.stats_at[rank] = now
        if generated_tokens:
            window = self._generated.setdefault(rank, deque())
            window.append((now, generated_tokens))
            while window and window[0][0] < now - THROUGHPUT_WINDOW_S:
                window.popleft()

    def gen_throughput(self, rank: int) -> float:
        window = self._generated.get(rank)
        if not window:
            return 0.0
        return sum(n for _, n in window) / THROUGHPUT_WINDOW_S

    def rank_loads(self, max_num_seqs: int, capacity_tokens: int) -> list[RankLoad]:
        ranks = sorted(set(self.stats) | set(self.served))
        loads = []
        for rank in ranks:
            stats = self.stats.get(rank, SchedulerStats())
            hit_rate = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
            loads.append(
                RankLoad(
                    dp_rank=rank,
                    num_running_reqs=stats.num_running_reqs,
                    num_waiting_reqs=stats.num_waiting_reqs,
                    num_total_reqs=stats.num_running_reqs + stats.num_waiting_reqs,
                    num_used_tokens=round(stats.kv_cache_usage * capacity_tokens),
                    max_total_num_tokens=capacity_tokens,
                    token_usage=stats.kv_cache_usage,
                    utilization=stats.kv_cache_usage,
                    gen_throughput=self.gen_throughput(rank),
                    cache_hit_rate=hit_rate,
                    max_running_requests=max_num_seqs,
                )
            )
        return loads
