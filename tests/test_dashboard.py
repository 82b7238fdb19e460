"""The Grafana dashboard (docs/grafana-dashboard.json) queries only what the servicer exports.

A live ``enginelink serve --metrics-port`` on the sim engine serves a call
and refuses one; every metric name in every query of the dashboard (panels
and variables) must be one its ``/metrics`` exports (a histogram's
``_bucket``/``_sum``/``_count`` included), and every label a query groups
or selects by must be on that metric's samples wherever the scrape has
samples of it (the media families and ``internal_errors_total`` have none
without media traffic or a bug: their names are checked, their labels not).
Queries are read with promql-parser (the Rust parser of GreptimeDB, as
Prometheus' grammar): a query Prometheus would refuse fails here, and the
labels a query uses are the ones its selectors and ``by`` clauses name, per
metric. The dashboard's own shape (variables defined, panels on the grid,
the areas it must show) is checked in-process.
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections import defaultdict
from pathlib import Path

import grpc
import promql_parser
import pytest

from tests.harness import Servicer, free_port, generate_request

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana-dashboard.json"
METRIC = re.compile(r"\bsmg_servicer_[a-z0-9_]+\b")
VARIABLE = re.compile(r"\$(?:\{)?([a-zA-Z_][a-zA-Z0-9_]*)")
# A variable variable's query is Grafana's, not PromQL: label_values(SELECTOR, LABEL).
LABEL_VALUES = re.compile(r"^label_values\((.*),\s*([a-zA-Z_][a-zA-Z0-9_]*)\)$")
# Labels Prometheus adds to every series it scrapes (the target's), and the histogram buckets'.
SCRAPE_LABELS = {"instance", "job", "le"}
# What the dashboard must show (issue 36): each area by a metric it queries.
AREAS = {
    "time to first token": "smg_servicer_time_to_first_token_seconds_bucket",
    "inter-token latency": "smg_servicer_inter_token_latency_seconds_bucket",
    "end-to-end latency": "smg_servicer_e2e_request_latency_seconds_bucket",
    "tokens/s": "smg_servicer_generated_tokens_total",
    "in flight": "smg_servicer_in_flight_requests",
    "the engine's queue": "smg_servicer_dp_rank_waiting_requests",
    "KV relay": "smg_servicer_kv_relay_events_total",
    "journal": "smg_servicer_journal_store_failing",
    "media": "smg_servicer_media_fetches_total",
    "errors by status": "smg_servicer_errors_total",
}


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", ()):
            found.append((panel["title"], target["expr"]))
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            found.append((f"variable {var['name']}", var["definition"]))
    return found


def _promql(expr: str) -> promql_parser.Expr:
    """The query as Prometheus parses it, Grafana's variables given values first."""
    expr = expr.replace("$__rate_interval", "5m")
    if m := LABEL_VALUES.match(expr):
        expr = m.group(1)
    return promql_parser.parse(VARIABLE.sub(".*", expr))


def _uses(expr: str) -> dict[str, set[str]]:
    """Each metric the query reads, with the labels it selects or groups it by (an aggregation's
    ``by`` labels count for every metric under it; a label_values variable's label for its selector's)."""
    uses: dict[str, set[str]] = defaultdict(set)

    def visit(node, grouping: frozenset[str]) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            uses[node.name] |= {m.name for m in node.matchers.matchers} | grouping
        elif isinstance(node, promql_parser.AggregateExpr):
            modifier = node.modifier
            by = frozenset(modifier.labels) if modifier is not None and modifier.type == \
                promql_parser.AggModifierType.By else frozenset()
            visit(node.expr, grouping | by)
            return
        for child in _children(node):
            visit(child, grouping)

    label = LABEL_VALUES.match(expr)
    visit(_promql(expr), frozenset({label.group(2)}) if label else frozenset())
    return dict(uses)


def _children(node) -> list:
    match node:
        case promql_parser.BinaryExpr():
            return [node.lhs, node.rhs]
        case promql_parser.Call():
            return list(node.args)
        case promql_parser.MatrixSelector():
            return [node.vector_selector]
        case promql_parser.ParenExpr() | promql_parser.UnaryExpr() | promql_parser.SubqueryExpr():
            return [node.expr]
    return []


def test_every_query_is_promql_and_reads_the_servicers_metrics():
    for where, expr in _queries(_dashboard()):
        uses = _uses(expr)  # raises on a query Prometheus would refuse
        assert uses and all(name.startswith("smg_servicer_") for name in uses), (where, expr)
        assert set(uses) == set(METRIC.findall(expr)), (where, expr)


def test_the_dashboard_defines_its_variables_covers_the_areas_and_fits_the_grid():
    dashboard = _dashboard()
    queries = _queries(dashboard)
    assert len(queries) > 40
    defined = {var["name"] for var in dashboard["templating"]["list"]}
    assert defined == {"datasource", "model", "instance", "rank"}
    for where, expr in queries:
        used = set(VARIABLE.findall(expr)) - {"__rate_interval"}
        assert used <= defined, (where, expr)
        assert METRIC.search(expr), (where, expr)
    queried = {name for _, expr in queries for name in METRIC.findall(expr)}
    assert {area: name for area, name in AREAS.items() if name not in queried} == {}
    # Every panel reads the chosen data source; ids unique; no two panels overlap on the 24-column grid.
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24, panel["title"]
        mine = {(g["x"] + dx, g["y"] + dy) for dx in range(g["w"]) for dy in range(g["h"])}
        assert not cells & mine, panel["title"]
        cells |= mine


def _exported(text: str) -> tuple[set[str], dict[str, set[str]]]:
    """The names a scrape exports, and the label names seen on each name's samples."""
    names: set[str] = set()
    labels: dict[str, set[str]] = defaultdict(set)
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            names.add(name)
            if kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        elif line and not line.startswith("#"):
            name, _, rest = line.partition("{")
            names.add(name.split(" ")[0])
            if rest:
                labels[name] |= {pair.split("=", 1)[0] for pair in re.findall(r'(\w+)="', rest.rsplit("}", 1)[0])}
    return names, labels


@pytest.mark.process
def test_every_metric_the_dashboard_queries_is_exported_by_a_live_servicer(tmp_path, test_model_dir):
    metrics_port = free_port()
    with Servicer(tmp_path, model_dir=test_model_dir, extra=["--metrics-port", str(metrics_port)],
                  env={"SMG_VLLM_SERVICER_WARMUP": "off"}) as servicer:
        replies = list(servicer.stub.Generate(generate_request("ok", [318, 283, 1552], max_tokens=4), timeout=30))
        assert replies[-1].HasField("complete")
        with pytest.raises(grpc.RpcError) as refused:  # a refusal: errors_total{code} and refusals_total{reason}
            list(servicer.stub.Generate(generate_request("bad", [318], max_tokens=4, temperature=-1.0), timeout=30))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    names, labels = _exported(text)
    missing = defaultdict(list)
    wrong_labels = []
    for where, expr in _queries(_dashboard()):
        for name, wanted in _uses(expr).items():
            if name not in names:
                missing[name].append(where)
            elif name in labels and (absent := wanted - SCRAPE_LABELS - labels[name]):
                wrong_labels.append((where, name, sorted(absent)))
    assert dict(missing) == {}, "the dashboard queries metrics the servicer does not export"
    assert wrong_labels == [], "the dashboard groups or selects by labels these metrics do not have"
    checked = {name for _, expr in _queries(_dashboard()) for name in METRIC.findall(expr)} & labels.keys()
    assert {"smg_servicer_errors_total", "smg_servicer_refusals_total", "smg_servicer_dp_rank_waiting_requests",
            "smg_servicer_kv_relay_events_total", "smg_servicer_time_to_first_token_seconds_bucket"} <= checked
