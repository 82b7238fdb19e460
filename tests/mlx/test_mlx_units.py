"""The MLX launch without MLX: the API check's refusals, the launcher's command, the facts env name.

These need no MLX installation: the check runs whatever ``ENGINELINK_MLX_PYTHON``
names, so a stand-in interpreter that answers like a mismatched venv shows
what ``enginelink serve --engine mlx`` says and that it exits 2 before any
engine starts.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from enginelink.runtime.engine.zmq_transport import ENGINE_FACTS_ENV
from enginelink.runtime.contracts.mlx.launch import CHECKOUT, MlxIncompatible, MlxLauncher, check_installed
from enginelink.tools import mlx_engine
from tests.harness import VENV_BIN, free_port


def fake_python(tmp: Path, report: dict | None, status: int = 0) -> Path:
    """An executable that answers ``-m enginelink.tools.mlx_check`` with ``report`` (None: garbage)."""
    path = tmp / "python"
    said = "not json" if report is None else json.dumps(report)
    path.write_text(f"#!/bin/sh\necho '{said}'\nexit {status}\n")
    path.chmod(0o755)
    return path


GOOD = {"problems": [], "mlx": "0.32.4", "mlx_lm": "0.31.3", "enginelink": str(CHECKOUT)}


def test_the_engine_reads_the_facts_path_the_link_sets():
    assert mlx_engine.ENGINE_FACTS_ENV == ENGINE_FACTS_ENV


def test_the_launcher_runs_the_engine_module_with_the_mlx_python(tmp_path):
    launcher = MlxLauncher(python="/venv/bin/python", model_dir=tmp_path, extra_args=["--completion-batch-size", "4"])
    argv, env = launcher.command("ipc:///x/hs.sock")
    assert argv == ["/venv/bin/python", "-m", "enginelink.tools.mlx_engine", "--handshake", "ipc:///x/hs.sock",
                    "--model", str(tmp_path), "--completion-batch-size", "4"]
    assert env == {}
    assert launcher.engine == "vllm"  # the wire it speaks


@pytest.mark.process
def test_a_matching_venv_passes_the_check(tmp_path):
    assert check_installed(str(fake_python(tmp_path, GOOD)))["mlx_lm"] == "0.31.3"


@pytest.mark.process
@pytest.mark.parametrize("report, words", [
    ({**GOOD, "problems": ["mlx_lm 0.32.0 has no SequenceStateMachine (built against mlx-lm 0.31.3)"]},
     "has no SequenceStateMachine"),
    ({**GOOD, "problems": ["mlx_lm 0.30.0: BatchGenerator.insert lacks state_machines"]}, "lacks state_machines"),
    ({**GOOD, "enginelink": "/somewhere/else"}, "runs enginelink from /somewhere/else"),
    (None, "could not run"),
])
def test_a_mismatched_venv_is_refused_naming_the_mismatch(tmp_path, report, words):
    with pytest.raises(MlxIncompatible) as refused:
        check_installed(str(fake_python(tmp_path, report, status=1 if report and report["problems"] else 0)))
    assert words in str(refused.value)


@pytest.mark.process
def test_serve_refuses_with_exit_2_before_any_engine_starts(tmp_path, test_model_dir):
    python = fake_python(tmp_path, {**GOOD, "problems": ["mlx_lm 0.32.0 has no SequenceStateMachine"]}, status=1)
    done = subprocess.run(
        [str(VENV_BIN / "enginelink"), "serve", "--engine", "mlx", "--model", str(test_model_dir),
         "--port", str(free_port()), "--journal", str(tmp_path / "j.sqlite")],
        capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin", "ENGINELINK_MLX_PYTHON": str(python), "XDG_STATE_HOME": str(tmp_path)},
    )
    assert done.returncode == 2, done.stderr
    assert "has no SequenceStateMachine" in done.stderr
    assert not (tmp_path / "j.sqlite").exists()


@pytest.mark.process
def test_serve_names_a_missing_mlx_python(tmp_path, test_model_dir):
    done = subprocess.run(
        [str(VENV_BIN / "enginelink"), "serve", "--engine", "mlx", "--model", str(test_model_dir),
         "--port", str(free_port())],
        capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin", "ENGINELINK_MLX_PYTHON": str(tmp_path / "nope"), "XDG_STATE_HOME": str(tmp_path)},
    )
    assert done.returncode == 2, done.stderr
    assert "does not exist: run tools/setup-mlx" in done.stderr


@pytest.mark.process
@pytest.mark.parametrize("flags, words", [
    (["--completion-batch-size", "0"], "--completion-batch-size 0: expected >= 1"),
    (["--max-logprobs", "-2"], "--max-logprobs -2"),
    (["--coalesce-max-ms", "-1"], "--coalesce-max-ms -1.0: expected 0 to 10000"),
    (["--coalesce-gap-ms", "20000"], "--coalesce-gap-ms 20000.0: expected 0 to 10000"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_engine_arguments_it_refuses_reach_the_servicer_with_exit_2(tmp_path, flags, words):
    # Before any MLX import: this venv has none, the refusal needs none.
    facts = tmp_path / "facts.json"
    done = subprocess.run([str(VENV_BIN / "python"), "-m", "enginelink.tools.mlx_engine", "--handshake", "ipc:///x",
                           "--model", str(tmp_path), *flags], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", ENGINE_FACTS_ENV: str(facts)})  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert words in json.loads(facts.read_text())["refused_arguments"]


def test_bench_engine_mlx_options(capsys):
    import argparse

    from enginelink.tools import bench, bench_mlx

    def parse(*argv: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        bench.add_arguments(parser)
        return parser.parse_args(list(argv))

    args = parse("--engine", "mlx", "--rounds", "0")
    assert bench.run(args) == 2  # refused before any engine starts
    assert "--engine mlx needs" in capsys.readouterr().err
    assert args.concurrency == [8, 32]  # MLX's default: under and at its 32-sequence batch
    assert parse("--engine", "sim").concurrency is None  # the sim bench keeps its own default (128)
    assert bench_mlx.engine_args_for(parse("--engine", "mlx"), 8) == ["--completion-batch-size", "8"]
    assert bench_mlx.engine_args_for(parse("--engine", "mlx", "--engine-args=--completion-batch-size 4"), 8) == [
        "--completion-batch-size", "4"]
