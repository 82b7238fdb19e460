"""The operator's mistakes: a second start, a busy port, a typo. Each is refused with one line and exit 2,
and none of them touches a live servicer or its journal."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

from enginelink.journal.files import previous_path
from enginelink.journal.store import open_reader
from tests.harness import VENV_BIN, Servicer, free_port, generate_request, wait_until

PROMPT = [318, 283, 1552, 10, 90, 305]
START_TIMEOUT_S = 60


def serve(tmp: Path, *args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``enginelink serve ARGS`` run to its end, with its own state dir and socket dir.

    The socket dir is a short one of its own, not under ``tmp``: an ipc path must fit 107 bytes."""
    sockets = tempfile.mkdtemp(prefix="el-sock-")
    environ = {**os.environ, "XDG_STATE_HOME": str(tmp / "state"), "SMG_ZMQ_SOCKET_DIR": sockets,
               "ENGINELINK_WARMUP": "off", **(env or {})}
    try:
        return subprocess.run([str(VENV_BIN / "enginelink"), "serve", *map(str, args)], capture_output=True,
                              text=True, timeout=START_TIMEOUT_S, env=environ)
    finally:
        shutil.rmtree(sockets, ignore_errors=True)


def refused_with_one_line(done: subprocess.CompletedProcess) -> str:
    """Exit 2, no traceback, and the reason on one line of stderr starting `enginelink serve:`."""
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "ExceptionGroup" not in done.stderr, done.stderr
    [line] = [line for line in done.stderr.splitlines() if line.startswith("enginelink serve:")]
    return line


def journal_seqs(path: Path) -> int:
    with open_reader(path) as reader:
        return reader.last_seq()


def completes(servicer: Servicer, request_id: str) -> None:
    reply = list(servicer.stub.Generate(generate_request(request_id, PROMPT, max_tokens=3, ignore_eos=True)))
    assert reply[-1].HasField("complete")


def request_journaled(journal: Path, request_id: str) -> bool:
    with open_reader(journal) as reader:
        return any(r.stream == f"req/{request_id}" for r in reader.records(stream_prefix="req/"))


# -- 1: a second serve never touches the live servicer's journal --------------------------------


@pytest.mark.process
def test_second_and_third_starts_leave_the_live_journal_alone(tmp_path, test_model_dir):
    with Servicer(tmp_path, model_dir=test_model_dir) as live:
        journal = live.journal
        inode = os.stat(journal).st_ino
        pid = live.process.pid
        state = {"XDG_STATE_HOME": str(live.state_home)}
        # The same port and journal (twice), the same port with another journal, another port with this journal.
        attempts = [("--port", live.port, "--journal", journal), ("--port", live.port, "--journal", journal),
                    ("--port", live.port, "--journal", tmp_path / "other.sqlite"),
                    ("--port", free_port(), "--journal", journal)]
        for args in attempts:
            line = refused_with_one_line(serve(tmp_path, "--model", test_model_dir, *args, env=state))
            assert f"process {pid}" in line, line
        # Untouched: the same file, nothing set aside, nothing opened for writing beside it.
        assert os.stat(journal).st_ino == inode
        assert not previous_path(journal).exists()
        assert not (tmp_path / "other.sqlite").exists()
        # ... and still written by the live servicer.
        completes(live, "after-the-refused-starts")
        wait_until(lambda: request_journaled(journal, "after-the-refused-starts"), 5, "the request on disk")
        # inspect --port finds it (the run file names the --journal path) and says it is live.
        done = subprocess.run([str(VENV_BIN / "enginelink"), "inspect", "--port", str(live.port), "--json"],
                              capture_output=True, text=True, timeout=30, env={**os.environ, **state})
        assert done.returncode == 0, done.stderr
        view = json.loads(done.stdout)
        assert view["journal"]["path"] == str(journal)
        assert (view["run"]["status"], view["run"]["pid"]) == ("running", pid)
        # Killed, it leaves its run file: --port still finds its journal, for the post-mortem.
        live.process.kill()
        live.process.wait(10)
        done = subprocess.run([str(VENV_BIN / "enginelink"), "inspect", "--port", str(live.port), "--json"],
                              capture_output=True, text=True, timeout=30, env={**os.environ, **state})
        view = json.loads(done.stdout)
        assert (view["journal"]["path"], view["run"]["status"]) == (str(journal), "dead")


@pytest.mark.process
def test_the_run_file_goes_with_a_clean_exit(tmp_path, test_model_dir):
    live = Servicer(tmp_path, model_dir=test_model_dir).start()
    run_file = live.state_home / "enginelink" / f"serve-{live.port}.json"
    try:
        assert json.loads(run_file.read_text())["journal"] == str(live.journal)
    finally:
        assert live.stop() == 0
    assert not run_file.exists()


@pytest.mark.process
def test_busy_port_names_the_servicer_holding_it(tmp_path, test_model_dir):
    with Servicer(tmp_path, model_dir=test_model_dir) as live:
        line = refused_with_one_line(serve(tmp_path, "--model", test_model_dir, "--port", live.port,
                                           env={"XDG_STATE_HOME": str(live.state_home)}))
        # Its default journal is free, so the bind is what refuses it, and the run file says who holds the port.
        assert f"gRPC port 127.0.0.1:{live.port} is in use by process {live.process.pid}" in line, line


@pytest.mark.process
def test_a_crash_loop_keeps_every_crashed_runs_journal(tmp_path, test_model_dir):
    """Three failing starts in a row (the engine refuses its arguments) with ENGINELINK_JOURNAL_KEEP=2:
    the last run's journal and the two before it, each ending with its exit status; nothing older."""
    journal = tmp_path / "loop.sqlite"
    for _ in range(3):
        serve(tmp_path, "--model", test_model_dir, "--port", free_port(), "--journal", journal, "--",
              "--no-such-flag", env={"ENGINELINK_JOURNAL_KEEP": "2"})
    for path in (journal, previous_path(journal, 1), previous_path(journal, 2)):
        with open_reader(path) as reader:
            [stop] = reader.records(kinds=["run.stop"])
            assert stop.payload["exit_status"] == 2
    assert not previous_path(journal, 3).exists()
    # The tools reach the kept runs: --previous K.
    done = subprocess.run([str(VENV_BIN / "enginelink"), "inspect", "--journal", str(journal), "--previous", "2",
                           "--json"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    view = json.loads(done.stdout)
    assert view["journal"]["path"] == str(previous_path(journal, 2))
    assert (view["run"]["status"], view["run"]["exit_status"]) == ("stopped", 2)
    done = subprocess.run([str(VENV_BIN / "enginelink"), "inspect", "--journal", str(journal)],
                          capture_output=True, text=True, timeout=30)
    assert "previous runs' journals kept: 2 (loop.prev.sqlite is the newest" in done.stdout, done.stdout


# -- 4: configuration errors exit 2 with one line ----------------------------------------------


@pytest.fixture
def busy_port():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


@pytest.mark.process
def test_busy_grpc_port_exits_2_before_touching_the_journal(tmp_path, test_model_dir, busy_port):
    journal = tmp_path / "j.sqlite"
    journal.write_bytes(b"")  # a previous run's file must not be set aside by a start that cannot bind
    line = refused_with_one_line(serve(tmp_path, "--model", test_model_dir, "--port", busy_port, "--journal", journal))
    assert f"gRPC port 127.0.0.1:{busy_port} is in use" in line and "--port" in line
    assert journal.exists() and not previous_path(journal).exists()


@pytest.mark.process
def test_busy_metrics_port_exits_2(tmp_path, test_model_dir, busy_port):
    line = refused_with_one_line(serve(tmp_path, "--model", test_model_dir, "--port", free_port(),
                                       "--metrics-port", busy_port))
    assert f"metrics port 127.0.0.1:{busy_port} is in use" in line and "--metrics-port" in line


@pytest.mark.process
def test_unknown_log_level_exits_2(tmp_path, test_model_dir):
    line = refused_with_one_line(serve(tmp_path, "--model", test_model_dir, "--log-level", "LOUD"))
    assert "'LOUD'" in line and "DEBUG, INFO, WARNING, ERROR, CRITICAL" in line
    line = refused_with_one_line(serve(tmp_path, "--model", test_model_dir, env={"ENGINELINK_LOG_LEVEL": "LOUD"}))
    assert "ENGINELINK_LOG_LEVEL" in line


@pytest.mark.process
def test_engine_refusing_its_arguments_exits_2_with_its_reason_redacted(tmp_path, test_model_dir):
    journal = tmp_path / "j.sqlite"
    done = serve(tmp_path, "--model", test_model_dir, "--port", free_port(), "--journal", journal,
                 "--", "--bogus", "3", "--mirror", "https://u:s3cret@example.org/m")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    [line] = [line for line in done.stderr.splitlines() if "exiting with status" in line]
    assert "exiting with status 2: engine link failed: the engine refused its arguments" in line
    # (--hf-token never reaches the engine's argv: it goes by HF_TOKEN; a URL password stays and is echoed.)
    assert "unrecognized arguments: --bogus 3 --mirror https://u:<redacted>@example.org/m" in line
    # The engine handed its refusal over instead of printing usage and the arguments verbatim.
    assert "s3cret" not in done.stderr and "usage:" not in done.stderr
    with open_reader(journal) as reader:
        [stop] = reader.records(kinds=["run.stop"])
    assert stop.payload["exit_status"] == 2 and "s3cret" not in stop.payload["reason"]


# -- 5: only what follows `--` goes to the engine -----------------------------------------------


@pytest.mark.process
def test_unknown_serve_flag_is_refused_with_a_suggestion(tmp_path, busy_port):
    done = serve(tmp_path, "--prot", "5", "--port", busy_port)  # a busy port: had it tried to bind, it would say so
    assert done.returncode == 2
    assert "unrecognized arguments: --prot 5" in done.stderr
    assert "did you mean --port?" in done.stderr and "arguments for the engine go after `--`" in done.stderr
    assert "in use" not in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "state").exists()  # refused before the model, the journal, anything


@pytest.mark.process
def test_only_arguments_after_the_separator_reach_the_engine(tmp_path, test_model_dir):
    """The same flag after `--` is the engine's: the sim engine is the one refusing it."""
    done = serve(tmp_path, "--model", test_model_dir, "--port", free_port(), "--", "--prot", "5")
    assert done.returncode == 2
    assert "python -m enginelink.tools.sim_engine: error: unrecognized arguments: --prot 5" in done.stderr


# -- 7: what a newcomer reads ----------------------------------------------------------------


@pytest.mark.process
def test_make_test_model_prints_the_path_serve_uses(tmp_path):
    done = subprocess.run([str(VENV_BIN / "enginelink"), "make-test-model", "--print-path"], capture_output=True,
                          text=True, timeout=30, env={**os.environ, "XDG_STATE_HOME": str(tmp_path / "xdg")})
    assert done.returncode == 0 and done.stdout.strip() == str(tmp_path / "xdg" / "enginelink" / "test-model")
    assert not (tmp_path / "xdg").exists()  # it prints; it builds nothing


@pytest.mark.parametrize("command", [["serve"], ["sim-engine"], ["make-test-model"], ["inspect"]])
def test_every_flag_is_explained(command):
    """Each flag of these commands has a help text, and serve's help names the `--` rule and where the settings are."""
    import argparse
    import importlib

    from enginelink.tools.cli import SUBCOMMANDS

    parser = argparse.ArgumentParser()
    importlib.import_module(f"enginelink.tools.{SUBCOMMANDS[command[0]][0]}").add_arguments(parser)
    unexplained = [a.option_strings or a.dest for a in parser._actions if not a.help]
    assert unexplained == []
    if command == ["serve"]:
        text = parser.format_help()
        assert "Arguments after `--` go to the engine and nowhere else" in text
        assert 'docs/running.md, "Settings"' in text


@pytest.mark.process
@pytest.mark.parametrize("engine_args, words", [
    (["--data-parallel-size", "4", "--data-parallel-start-rank", "2", "--data-parallel-size-local", "2"],
     "--data-parallel-size 4 with 2 local ranks"),
    (["--data-parallel-size-local", "2", "--data-parallel-start-rank", "2"], "the engine's DP ranks start at 2"),
])
def test_a_vllm_engine_split_over_nodes_is_refused(tmp_path, test_model_dir, engine_args, words):
    """enginelink fronts a whole DP engine on one node (ranks 0..N-1): a node of a multi-node one is refused."""
    line = refused_with_one_line(serve(tmp_path, "--model", test_model_dir, "--engine", "vllm", "--port",
                                       free_port(), "--", *engine_args))
    assert words in line and "ranks 0..N-1, on one node" in line
