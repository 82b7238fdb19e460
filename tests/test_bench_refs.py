"""``enginelink bench --against``: the reference servicers beside enginelink (tools/bench_refs.py).

What a user sees: the arms are named and checked before anything starts, a missing reference venv
says how to make it, and a short run against the sim engine reports every arm with complete counts,
its CPU per token, its RSS and its pooled ratio to enginelink. No figure is asserted for speed.

The end-to-end runs need ``tools/setup-bench-refs``'s venv (and vLLM's, for smg-python): without it they
skip, unless ``ENGINELINK_REQUIRE_BENCH_REFS=1`` makes its absence a failure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess

import pytest

from enginelink.tools import bench, bench_refs
from tests.harness import VENV_BIN

REFS_PYTHON = bench_refs.DEFAULT_REFS_VENV / "bin" / "python"
needs_refs = pytest.mark.skipif(
    not REFS_PYTHON.exists() and os.environ.get("ENGINELINK_REQUIRE_BENCH_REFS") != "1",
    reason="no reference venv: run tools/setup-bench-refs (ENGINELINK_REQUIRE_BENCH_REFS=1 fails instead)",
)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_arms_are_named_and_checked(capsys):
    assert _args("--against", "smg-rust, smg-python,smg-rust").against == ["smg-rust", "smg-python"]
    assert _args("--against", "grpclib-floor,smg-rust").against == ["grpclib-floor", "smg-rust"]
    for bad in ("smg-go", "", "smg-rust,enginelink"):
        with pytest.raises(SystemExit) as exit_:
            _args("--against", bad)
        assert exit_.value.code == 2
        assert "expected a comma-separated list of smg-rust, smg-python" in capsys.readouterr().err


def test_a_missing_reference_venv_says_how_to_make_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(bench_refs.REFS_VENV_ENV, str(tmp_path / "nowhere"))
    assert bench.run(_args("--against", "smg-rust", "--requests", "4")) == 1
    err = capsys.readouterr().err
    assert "run tools/setup-bench-refs" in err and str(tmp_path / "nowhere") in err
    # --target makes no sense beside arms the bench starts itself.
    assert bench.run(_args("--against", "smg-rust", "--target", "127.0.0.1:1")) == 2


def test_the_floor_goes_with_the_sim_engine_only(capsys):
    """grpclib-floor has no engine: beside a real engine's alternation it would measure nothing comparable."""
    for engine in ("vllm", "mlx"):
        assert bench.run(_args("--engine", engine, "--against", "grpclib-floor")) == 2
        assert "grpclib-floor has no engine behind it" in capsys.readouterr().err


def test_the_floor_sends_as_many_messages_per_call_as_enginelink():
    from enginelink.tools.bench_floor_servicer import chunk_sizes

    messages = bench_refs.floor_messages
    assert messages(128, 34.7) == 4 and messages(128, 41.0) == 3
    assert messages(128, 1.0) == 128  # an engine at one token per step: a message per token
    assert messages(8, 1.6) == 5 and messages(8, 500.0) == 1  # never fewer than one
    assert messages(8, 0.0) == 1  # enginelink sent no chunk (a run of errors): one message
    assert chunk_sizes(128, 3) == [43, 43, 42] and chunk_sizes(8, 5) == [2, 2, 2, 1, 1]
    assert chunk_sizes(3, 5) == [1, 1, 1] and chunk_sizes(0, 4) == []  # never an empty chunk


def test_pooled_ratio_is_the_geometric_mean_with_an_interval():
    assert bench_refs.pooled([]) == {"n": 0, "geomean": None, "low": None, "high": None}
    one = bench_refs.pooled([0.8])
    assert one["geomean"] == pytest.approx(0.8) and one["low"] is None
    same = bench_refs.pooled([1.1, 1.1, 1.1])
    assert same["geomean"] == same["low"] == same["high"] == pytest.approx(1.1)
    spread = bench_refs.pooled([0.5, 2.0])
    assert spread["geomean"] == pytest.approx(1.0)  # geometric: 0.5 and 2.0 cancel
    assert spread["low"] < 1.0 < spread["high"]
    assert spread["low"] * spread["high"] == pytest.approx(1.0)  # symmetric in log space
    wider = bench_refs.pooled([0.25, 4.0])
    assert wider["low"] < spread["low"] and wider["high"] > spread["high"]
    assert "0.500" not in bench_refs.format_pooled(spread) and "2 repetitions" in bench_refs.format_pooled(spread)
    assert math.isclose(bench_refs.pooled([0.9, 1.0, 1.1])["geomean"], (0.9 * 1.0 * 1.1) ** (1 / 3))


def test_the_rust_shim_passes_only_what_the_binding_takes():
    """smg-grpc-servicer 0.14.1's launcher passes keywords smg 1.13.0's server does not take: the shim drops them."""
    from enginelink.tools.bench_ref_servicer import shim_kwargs

    class Server:
        def __init__(self, bind_address, *, engine_count=1, tokenizer_dir=None):
            pass

    kept = shim_kwargs(Server, {"bind_address": "x", "engine_count": 1, "metrics_bind_address": None,
                                "engine_silence_timeout_secs": 300.0})
    assert kept == {"bind_address": "x", "engine_count": 1}
    Server(**kept)


def test_the_rust_shim_reads_the_models_facts(test_model_dir):
    from enginelink.tools.bench_ref_servicer import model_facts

    facts = model_facts(test_model_dir, 1024, 64)
    config = json.loads((test_model_dir / "config.json").read_text())
    assert facts["vocab_size"] == config["vocab_size"]
    assert facts["max_context_length"] == 1024 and facts["max_num_seqs"] == 64
    assert facts["eos_token_ids"] and all(isinstance(i, int) for i in facts["eos_token_ids"])
    assert facts["kv_events_endpoint"] == ""  # every arm runs with KV events off
    assert model_facts(test_model_dir, None, 8)["max_context_length"] == config["max_position_embeddings"]


def _run_against(test_model_dir, arms: str, timeout_s: float, requests: int = 16, concurrency: int = 4) -> dict:
    result = subprocess.run(
        [str(VENV_BIN / "enginelink"), "bench", "--model", str(test_model_dir), "--json", "--against", arms,
         "--requests", str(requests), "--max-tokens", "8", "--concurrency", str(concurrency), "--rounds", "2"],
        capture_output=True, text=True, timeout=timeout_s,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout)


def _check_arm(result: dict, arm: str, requests: int = 16) -> None:
    runs = result["runs"][arm]
    assert len(runs) == 2  # one per repetition
    for run in runs:
        assert run["tokens"] == requests * 8 and run["short"] == 0
        # A short run of the Rust servicer may cost less than one clock tick (10 ms): measured, maybe 0.
        assert run["servicer_cpu_s"] is not None and run["servicer_cpu_s"] >= 0
        assert run["servicer_rss_mib"] > 0
    summary = result["arms"][arm]
    assert summary["servicer_us_per_token"] >= 0 and summary["servicer_rss_mib"] > 0
    if arm != "enginelink":
        pooled = summary["vs_enginelink"]
        assert pooled["n"] == 2 and pooled["low"] <= pooled["geomean"] <= pooled["high"]
        if "cpu_vs_enginelink" in summary:  # only when both arms' CPU moved in every repetition
            cpu = summary["cpu_vs_enginelink"]
            assert cpu["low"] <= cpu["geomean"] <= cpu["high"]


@pytest.mark.process
@pytest.mark.slow
@needs_refs
def test_rust_reference_beside_enginelink_on_the_sim_engine(test_model_dir):
    report = _run_against(test_model_dir, "smg-rust", 300)
    assert report["engine"] == "sim"
    [result] = report["results"]
    assert set(result["runs"]) == {"enginelink", "smg-rust"}
    _check_arm(result, "enginelink")
    _check_arm(result, "smg-rust")


@pytest.mark.process
@pytest.mark.slow
@needs_refs
def test_python_reference_beside_enginelink_on_the_sim_engine(test_model_dir):
    """smg-python's AsyncLLM starts no engine of its own: the sim engine dials it as a remote headless rank."""
    report = _run_against(test_model_dir, "smg-python", 900)
    [result] = report["results"]
    _check_arm(result, "smg-python")


@pytest.mark.process
@pytest.mark.slow
def test_grpclib_floor_beside_enginelink_on_the_sim_engine(test_model_dir):
    """The floor needs no reference venv. At 128 streams on the load client's one connection it must
    accept them all (h2's own limit is 100, over which it resets the connection), and each repetition it
    sends as many messages per call as enginelink did in that repetition."""
    report = _run_against(test_model_dir, "grpclib-floor", 300, requests=256, concurrency=128)
    [result] = report["results"]
    assert set(result["runs"]) == {"enginelink", "grpclib-floor"}
    _check_arm(result, "enginelink", requests=256)
    _check_arm(result, "grpclib-floor", requests=256)
    for mine, floor in zip(result["runs"]["enginelink"], result["runs"]["grpclib-floor"]):
        assert floor["messages_per_call"] == bench_refs.floor_messages(8, mine["tokens_per_chunk"])
        assert floor["tokens_per_chunk"] == pytest.approx(8 / floor["messages_per_call"])  # as the client saw


@pytest.mark.process
@pytest.mark.slow
@needs_refs
def test_latency_side_by_side_in_a_steady_window_with_a_plot(test_model_dir, tmp_path):
    """What a user feels, per arm, in one run: TTFT and inter-token p50/p90/p99 with their spread over
    the repetitions (lowest <= median <= highest), enginelink's own output delay, and the plot of it all."""
    plot = tmp_path / "refs.svg"
    result = subprocess.run(
        [str(VENV_BIN / "enginelink"), "bench", "--model", str(test_model_dir), "--json", "--against", "smg-rust",
         "--concurrency", "8", "--rounds", "2", "--warm-s", "1", "--duration-s", "2", "--max-tokens", "32",
         "--engine-args=--step-us 20000", "--latency-plot", str(plot)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    [r] = json.loads(result.stdout)["results"]
    for arm in ("enginelink", "smg-rust"):
        latency = r["arms"][arm]["latency"]
        for key in ("ttft_ms", "itl_ms"):
            for q in ("p50", "p90", "p99"):
                s = latency[f"{key}.{q}"]
                assert s["n"] == 2 and s["low"] <= s["median"] <= s["high"], (arm, key, q, s)
        # The engine's pace is 20 ms a token; nobody streams faster than their engine.
        assert latency["itl_ms.p50"]["median"] >= 15
    delay = r["arms"]["enginelink"]["latency"]
    assert delay["output_delay.received.p50"]["median"] <= delay["output_delay.received.p99"]["median"]
    assert r["arms"]["smg-rust"]["latency"]["output_delay.received.p50"] is None  # not ours to read
    svg = plot.read_text()
    assert svg.startswith("<svg") and "smg-rust" in svg and "inter-token p99" in svg
