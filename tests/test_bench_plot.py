"""``enginelink bench --plot FILE.svg``: the run's figures drawn, per arm and concurrency.

A short sim-engine run (seconds) as a user runs it; the SVG keeps its text as
text, so the arms' names and the axes can be read back from the file.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from enginelink.tools import bench_plot
from tests.harness import VENV_BIN


def _bench(*argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([str(VENV_BIN / "enginelink"), "bench", *argv], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.process
def test_a_short_side_by_side_run_is_drawn_with_every_arm(tmp_path, test_model_dir):
    """enginelink and the grpclib floor (no install needed), two concurrencies: one SVG naming both arms."""
    plot = tmp_path / "bench.svg"
    done = _bench("--model", str(test_model_dir), "--against", "grpclib-floor", "--concurrency", "4", "8",
                  "--rounds", "1", "--requests", "16", "--max-tokens", "64", "--plot", str(plot))
    assert done.returncode == 0, done.stderr
    assert f"plot written to {plot}" in done.stderr
    svg = plot.read_text()
    assert svg.startswith("<?xml") and "<svg" in svg
    for text in ("enginelink", "grpclib-floor", "output tokens/s", "servicer CPU, µs per output token",
                 "concurrency", "--against grpclib-floor --concurrency 4 8"):
        assert text in svg, text


@pytest.mark.process
def test_a_plain_run_is_drawn(tmp_path, test_model_dir):
    plot = tmp_path / "plain.svg"
    done = _bench("--model", str(test_model_dir), "--concurrency", "4", "--requests", "16", "--max-tokens", "64",
                  "--plot", str(plot))
    assert done.returncode == 0, done.stderr
    svg = plot.read_text()
    assert "enginelink" in svg and "--concurrency 4 --requests 16" in svg


@pytest.mark.process
@pytest.mark.parametrize("name, words", [("plot.png", "the plot is an SVG file"),
                                          ("missing/plot.svg", "no directory")])
def test_a_plot_it_cannot_write_is_refused_before_the_run(tmp_path, name, words):
    """Exit 2 at once, not after the run: nothing is started (no --model needed to get there)."""
    done = _bench("--plot", str(tmp_path / name), timeout=60)
    assert done.returncode == 2 and words in done.stderr, done.stderr
    assert "calls" not in done.stdout


def test_no_matplotlib_is_refused_with_the_extra_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(bench_plot.PlotError, match=r"enginelink\[bench\]"):
        bench_plot.check(tmp_path / "x.svg")


def test_what_is_drawn_per_arm():
    """Medians per arm and concurrency; no CPU bar where the figure is not a servicer's alone."""
    run = {"tokens_per_s": 100.0, "servicer_cpu_s": 0.5, "tokens": 10_000}
    vllm = {"results": [{"concurrency": 32, "runs": {"enginelink": [run, {**run, "tokens_per_s": 120.0}],
                                                     "raw": [{"tokens_per_s": 130.0, "tokens": 10_000}],
                                                     "smg-rust": [run]}}]}
    drawn = bench_plot.series(vllm)
    assert drawn["enginelink"][32] == {"tokens_per_s": [100.0, 120.0], "us_per_token": [50.0, 50.0]}
    assert drawn["raw"][32]["us_per_token"] == [] and drawn["smg-rust"][32]["us_per_token"] == [50.0]
    mlx = {"engine": "mlx", "results": [{"concurrency": 8, "runs": {"reference": [run]}}]}
    assert bench_plot.series(mlx)["reference"][8]["us_per_token"] == []  # mlx-lm runs in its process
    plain = {"config": {"concurrency": 128}, "tokens_per_s": 5.0, "servicer_cpu_us_per_token": 7.0}
    assert bench_plot.series(plain) == {"enginelink": {128: {"tokens_per_s": [5.0], "us_per_token": [7.0]}}}
