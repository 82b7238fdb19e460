"""``/metrics`` per data-parallel rank: what each rank holds and what its engine core reports.

Read at scrape time from the link's rank table (``machines/ranks.py``: the
engine requests this servicer has in flight on each rank, and how many it
sent there) and from the scheduler stats each rank's output frames carry
(``runtime/context/loads.py``, the same numbers as GetLoads). The families carry the
servicer's ``model`` label and the rank's own ``rank`` (the servicer-wide
families keep ``rank="0"``, the first rank's, as before).
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from enginelink.wire.engine import SchedulerStats


class RankCollector:
    def __init__(self, ranks, loads, labels: dict[str, str]) -> None:
        self.ranks = ranks  # machines.ranks.RankTable
        self.loads = loads  # runtime.context.loads.Loads
        self.model = labels["model"]

    def collect(self):
        names = ["model", "rank"]
        in_flight = GaugeMetricFamily("smg_servicer_dp_rank_in_flight_requests",
                                      "Engine requests this servicer has in flight on the DP rank", labels=names)
        sent = CounterMetricFamily("smg_servicer_dp_rank_requests",
                                   "Engine requests sent to the DP rank (each choice of n is one)", labels=names)
        running = GaugeMetricFamily("smg_servicer_dp_rank_running_requests",
                                    "Requests the DP rank's scheduler runs (its last stats)", labels=names)
        waiting = GaugeMetricFamily("smg_servicer_dp_rank_waiting_requests",
                                    "Requests waiting in the DP rank's scheduler (its last stats)", labels=names)
        kv_usage = GaugeMetricFamily("smg_servicer_dp_rank_kv_cache_usage",
                                     "The DP rank's KV cache usage, 0..1 (its last stats)", labels=names)
        for rank, counts in self.ranks.snapshot().items():
            values = [self.model, str(rank)]
            stats = self.loads.stats.get(rank, SchedulerStats())
            in_flight.add_metric(values, counts["in_flight"])
            sent.add_metric(values, counts["sent"])
            running.add_metric(values, stats.num_running_reqs)
            waiting.add_metric(values, stats.num_waiting_reqs)
            kv_usage.add_metric(values, stats.kv_cache_usage)
        yield from (in_flight, sent, running, waiting, kv_usage)

    def describe(self):
        return []
