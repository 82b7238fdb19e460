"""``enginelink bench --engine mlx`` end to end, tiny: both arms run, the ratio is reported.

A smoke run only (the figures of a shared 2-core machine mean nothing).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.harness import VENV_BIN

pytestmark = [pytest.mark.mlx, pytest.mark.slow]


def test_a_tiny_bench_runs_both_arms_and_reports_the_ratio(mlx_python, test_model_dir):
    done = subprocess.run(
        [str(VENV_BIN / "enginelink"), "bench", "--engine", "mlx", "--model", str(test_model_dir),
         "--concurrency", "2", "--rounds", "1", "--requests", "4", "--max-tokens", "4", "--prompt-tokens", "8",
         "--json"], capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    (result,) = report["results"]
    assert result["concurrency"] == 2
    for side in ("enginelink", "raw"):
        (run,) = result["runs"][side]
        assert run["tokens"] == 16 and run["short"] == 0, (side, run)
    assert result["ratio"] == pytest.approx(result["enginelink_tokens_per_s"] / result["raw_tokens_per_s"])


def test_a_tiny_bench_with_the_reference_mlx_servicer_runs_three_arms(mlx_python, test_model_dir):
    # The reference is a bench tool, not the suite's: tools/setup-mlx --with-reference installs it.
    from enginelink.tools.bench_mlx import reference_dir

    try:
        reference_dir(mlx_python)
    except RuntimeError as missing:
        if os.environ.get("ENGINELINK_REQUIRE_BENCH_REFS") == "1":
            pytest.fail(str(missing))
        pytest.skip(str(missing))
    done = subprocess.run(
        [str(VENV_BIN / "enginelink"), "bench", "--engine", "mlx", "--against", "smg-python", "--model",
         str(test_model_dir), "--concurrency", "2", "--rounds", "1", "--requests", "4", "--max-tokens", "4",
         "--prompt-tokens", "8", "--json"], capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = json.loads(done.stdout)["results"]
    for side in ("enginelink", "raw", "reference"):
        (run,) = result["runs"][side]
        assert run["tokens"] == 16 and run["short"] == 0, (side, run)
    assert result["reference_ratio"] == pytest.approx(result["reference_tokens_per_s"] / result["raw_tokens_per_s"])
