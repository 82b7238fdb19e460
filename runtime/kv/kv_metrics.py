"""The KV relay's counters and gauges as Prometheus families, read at scrape time.

Families (labels ``model`` and ``rank`` as everywhere; ``rank`` is the DP
rank for the per-rank gauges):

- ``smg_servicer_kv_relay_events_total{event}``: batches received, relayed,
  duplicates, late, undecodable, gaps, repairs, recovered, replay timeouts,
  holes, unknown_before, incarnations, out_of_range, … (``relay.counters()``
  without a dotted name);
- ``smg_servicer_kv_dropped_events_total{rule}``: one per §12.6 drop rule;
- ``smg_servicer_kv_forwarded_events_total{kind}``: stored, removed, cleared;
- ``smg_servicer_kv_data_loss_total{reason}``: restart, behind, hole, stalled, evicted;
- ``smg_servicer_kv_subscriptions_total{mode}``: history, snapshot, resume, live;
- per rank: ``smg_servicer_kv_history_batches``, ``…_history_bytes``,
  ``…_history_holes``, ``…_live_blocks``, ``…_incarnation``,
  ``…_newest_sequence``, ``…_unknown_before``;
- ``smg_servicer_kv_subscribers`` and the bounds
  ``smg_servicer_kv_history_batches_max`` / ``…_history_bytes_max``,
  ``…_subscribers_max``, ``…_subscribers_per_peer_max``, ``…_send_stall_seconds``.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_PREFIXED = {
    "dropped.": ("smg_servicer_kv_dropped_events", "KV events the relay dropped, by rule (smg contract 12.6)", "rule"),
    "forwarded.": ("smg_servicer_kv_forwarded_events", "KV events forwarded to subscribers, by kind", "kind"),
    "data_loss.": ("smg_servicer_kv_data_loss", "KV event streams ended with DATA_LOSS, by reason", "reason"),
    "served_": ("smg_servicer_kv_subscriptions", "KV event subscriptions served, by mode", "mode"),
}
_RANK_GAUGES = ("history_batches", "history_bytes", "history_holes", "live_blocks", "incarnation", "unknown_before")


class KvRelayCollector:
    def __init__(self, shell, labels: dict[str, str]) -> None:
        self.shell = shell
        self.labels = labels

    def collect(self):
        names, values = list(self.labels), list(self.labels.values())
        counters = self.shell.counters()
        events = CounterMetricFamily("smg_servicer_kv_relay_events", "KV relay events, by event",
                                     labels=[*names, "event"])  # fmt: skip
        families = {prefix: CounterMetricFamily(name, doc, labels=[*names, label])
                    for prefix, (name, doc, label) in _PREFIXED.items()}  # fmt: skip
        for key, value in sorted(counters.items()):
            prefix = next((p for p in _PREFIXED if key.startswith(p)), None)
            if prefix is None:
                events.add_metric([*values, key], value)
            else:
                families[prefix].add_metric([*values, key[len(prefix):]], value)
        yield events
        yield from families.values()
        rank_index = names.index("rank") if "rank" in names else None
        gauges = {key: GaugeMetricFamily(f"smg_servicer_kv_{key}", f"KV relay {key.replace('_', ' ')}, per DP rank",
                                         labels=names) for key in (*_RANK_GAUGES, "newest_sequence")}  # fmt: skip
        for rank, g in sorted(self.shell.gauges().items()):
            labels = list(values)
            if rank_index is not None:
                labels[rank_index] = str(rank)
            for key in _RANK_GAUGES:
                gauges[key].add_metric(labels, g[key] or 0)
            gauges["newest_sequence"].add_metric(labels, g["newest"] or 0)
        yield from gauges.values()
        config = self.shell.relay.config
        for name, value, doc in (
            ("smg_servicer_kv_subscribers", len(self.shell.streams), "Open SubscribeKvEvents streams"),
            ("smg_servicer_kv_history_batches_max", config.history_batches_max,
             "KV history bound per rank, batches (SMG_KV_EVENT_HISTORY_BATCHES)"),
            ("smg_servicer_kv_history_bytes_max", config.history_bytes_max,
             "KV history bound per rank, bytes (SMG_KV_EVENT_HISTORY_BYTES)"),
            ("smg_servicer_kv_subscribers_max", config.subscribers_max,
             "Open SubscribeKvEvents streams allowed; one more takes the slot of one not taking its events, "
             "or is refused UNAVAILABLE (ENGINELINK_KV_MAX_SUBSCRIBERS)"),
            ("smg_servicer_kv_subscribers_per_peer_max", config.subscribers_per_peer_max,
             "Open SubscribeKvEvents streams allowed from one peer (ENGINELINK_KV_MAX_SUBSCRIBERS_PER_PEER)"),
            ("smg_servicer_kv_send_stall_seconds", config.send_stall_s,
             "A KV message flow control holds this long ends its stream with DATA_LOSS (ENGINELINK_KV_SEND_STALL_SECS)"),
        ):  # fmt: skip
            family = GaugeMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            yield family

    def describe(self):
        return []
