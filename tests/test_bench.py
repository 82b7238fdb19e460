"""``enginelink bench``: a short real run, checked for consistent counts (never for speed).

The bench starts its own servicer on the sim engine (zero cost), so these
tests need nothing but the venv. Timing figures are not asserted: they
depend on the machine; only what must hold on any machine is.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

import pytest

from enginelink.tools import bench
from tests.harness import VENV_BIN

REQUESTS = 32
MAX_TOKENS = 32


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def _check_counts(report: dict, requests: int, max_tokens: int) -> None:
    assert report["requests"] == report["ok"] == requests
    assert report["errors"] == report["short"] == 0
    assert report["output_tokens"] == requests * max_tokens
    # Every call: at least one chunk, and exactly one complete after it.
    assert requests <= report["chunks"] <= requests * max_tokens
    assert report["messages"] == report["chunks"] + requests
    assert report["tokens_per_chunk"] == pytest.approx(report["output_tokens"] / report["chunks"])
    assert report["servicer_cpu_s"] > 0
    assert report["servicer_cpu_us_per_token"] == pytest.approx(
        report["servicer_cpu_s"] / report["output_tokens"] * 1e6
    )
    assert report["client_cpu_s"] > 0
    assert report["engine_cpu_s"] is not None and report["engine_cpu_s"] >= 0
    assert report["wall_s"] > 0
    assert report["ttft_ms"]["p50"] <= report["ttft_ms"]["p99"]
    # Gaps exist only between chunks: none when every call came as one chunk.
    for key in ("itl_token_ms", "itl_message_ms"):
        if report["chunks"] > requests:
            assert report[key]["p50"] <= report[key]["p99"]
        else:
            assert report[key]["p50"] is None


@pytest.mark.slow
def test_cli_json_report_counts_are_consistent(test_model_dir):
    """The command as a user runs it: two client processes, JSON on stdout."""
    result = subprocess.run(
        [str(VENV_BIN / "enginelink"), "bench", "--model", str(test_model_dir), "--json",
         "--requests", str(REQUESTS), "--max-tokens", str(MAX_TOKENS), "--concurrency", "8",
         "--client-procs", "2"],
        capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    _check_counts(report, REQUESTS, MAX_TOKENS)
    assert report["config"]["client_procs"] == 2
    assert report["config"]["engine_args"] == ["--max-num-seqs", "128"]


@pytest.mark.slow
def test_engine_args_reach_the_engine(test_model_dir):
    """A cost model given with --engine-args shapes the run; counts still hold."""
    args = _args("--model", str(test_model_dir), "--requests", "8", "--max-tokens", "16",
                 "--concurrency", "4", "--engine-args=--step-us 2000 --max-num-seqs 2")
    report = bench.measure(args)
    _check_counts(report, 8, 16)
    assert report["config"]["engine_args"] == ["--step-us", "2000", "--max-num-seqs", "2"]
    assert report["server"]["max_num_seqs"] == 2  # as the engine reported it


def test_refused_options_exit_2(capsys):
    assert bench.run(_args("--concurrency", "0")) == 2
    assert "--concurrency must be >= 1" in capsys.readouterr().err
    assert bench.run(_args("--servicer-pid", "1")) == 2


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert bench.percentile(values, 50) == 50.0
    assert bench.percentile(values, 99) == 99.0
    assert bench.percentile(values, 100) == 100.0
    assert bench.percentile([], 50) is None
    assert bench.percentile([7.0], 99) == 7.0


def test_proc_cpu_counts_this_process():
    user, system = bench.proc_cpu_s(os.getpid())
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:  # burn CPU, so the counter must move
        pass
    later = bench.proc_cpu_s(os.getpid())
    assert later[0] + later[1] > user + system


def test_engine_vllm_options_parse_without_starting_anything(capsys):
    # Several concurrencies are for --engine vllm only; the sim bench refuses them.
    assert bench.run(_args("--concurrency", "32", "128")) == 2
    assert "--engine vllm" in capsys.readouterr().err
    args = _args("--engine", "vllm", "--concurrency", "32", "128", "--rounds", "0")
    assert args.concurrency == [32, 128]
    assert bench.run(args) == 2  # refused before any engine starts

    from enginelink.tools import bench_engine

    args = _args("--engine", "vllm")
    assert bench_engine.engine_args_for(args, 32) == [
        "--max-model-len", "1024", "--enforce-eager", "--max-num-seqs", "128"]
    assert bench_engine.engine_args_for(args, 200)[-1] == "200"


def test_stand_in_front_end_takes_cpu_not_wall_time():
    """--raw-front-end-us charges the engine's cores: the driver must run for it, not sleep."""
    from enginelink.tools import bench_engine

    args = _args("--engine", "vllm", "--raw-front-end-us", "40", "100")
    assert args.raw_front_end_us == [40.0, 100.0]
    cpu0 = time.thread_time()
    bench_engine.spend_cpu(0.05)
    assert time.thread_time() - cpu0 >= 0.05
