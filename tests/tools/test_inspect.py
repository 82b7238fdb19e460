"""``enginelink inspect`` on a live servicer: requests in flight, links, run, journal.

One servicer with a slow engine (20 ms per step) serves long streams that
stay in flight while the tool reads its journal from the outside, plus a few
requests that finish or are aborted first.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from tests.harness import VENV_BIN, Servicer, generate_request, wait_until
from tests.tools.helpers import PROMPT, Stream, copy_journal, engine_pid, enginelink, inspect_json, journal_has

pytestmark = pytest.mark.process  # starts processes: not in the fast loop (tests/fast_loop.py)

LONG = dict(max_tokens=1500, ignore_eos=True)


# The engine binds a thread to this CPU, as vLLM's CPU backend binds its Worker's: inspect shows the placement.
BOUND_CPU = min(os.sched_getaffinity(0))


def engine_nice(servicer) -> int:
    """The nice value the launch gives the engine: 10 below the servicer's own, at most 19."""
    return min(19, os.getpriority(os.PRIO_PROCESS, servicer.process.pid) + 10)


@pytest.fixture(scope="module")
def busy(tmp_path_factory, test_model_dir):
    """A servicer with long-0, long-1 and long-n2 (n = 2) in flight; short, pair finished; cut aborted."""
    servicer = Servicer(tmp_path_factory.mktemp("inspect"), model_dir=test_model_dir,
                        engine_args=["--step-us", "20000", "--bind-cpu", str(BOUND_CPU)],
                        # The opt-in priority knobs on, so inspect has them to show (defaults: 0 and normal).
                        # So deprioritised, on a CI box at load 15 its start took over 60 s (40 s before the
                        # engine's placement, then a full warm-up): warm-up is off (nothing here reads it)
                        # and the start has minutes, as the real-engine servicers do.
                        env={"ENGINELINK_DRAIN_SECS": "0.2", "ENGINELINK_PLACEMENT": "auto",
                             "ENGINELINK_ENGINE_NICE": "10", "ENGINELINK_SERVICER_SCHED": "batch",
                             "ENGINELINK_WARMUP": "off"}).start(timeout_s=180)
    streams = []
    try:
        streams = [Stream(servicer, "long-0", **LONG), Stream(servicer, "long-1", **LONG),
                   Stream(servicer, "long-n2", n=2, temperature=1.0, **LONG), Stream(servicer, "cut", **LONG)]
        list(servicer.stub.Generate(generate_request("short", PROMPT, stream=True, max_tokens=4, ignore_eos=True)))
        list(servicer.stub.Generate(generate_request("pair", PROMPT, n=2, temperature=1.0, max_tokens=3,
                                                     ignore_eos=True)))
        for stream in streams:
            assert stream.streaming.wait(30)
        servicer.stub.Abort(pb.AbortRequest(request_ids=["cut"]))
        wait_until(lambda: journal_has(servicer.journal, lambda recs: any(
            r.kind == "client.sent" and r.payload["request_id"] == "cut" for r in recs)), 5, "cut's abort on disk")
        yield servicer
    finally:
        servicer.stop()
        for stream in streams:
            stream.join(10)


def test_json_shows_links_requests_in_flight_and_the_live_run(busy):
    view = inspect_json(busy.journal)
    assert view["run"]["status"] == "running"
    assert view["run"]["pid"] == busy.process.pid and view["run"]["pid_alive"] is True
    assert view["as_of"]["basis"] == "live"
    [link] = view["links"]
    assert (link["name"], link["state"]) == ("vllm-0", "serving")
    assert link["engine_pid"] == engine_pid(busy.journal) and link["engine_alive"] is True
    assert link["facts"]["max_model_len"] == 2048
    # What the launch set for the engine and the servicer (ENGINELINK_ENGINE_NICE=10, ENGINELINK_SERVICER_SCHED=batch).
    assert link["priority"]["levels"] == 10 and link["priority"]["nice"] == engine_nice(busy)
    assert link["priority"]["servicer"]["policy"] == "batch" and link["priority"]["servicer"]["threads"] >= 1
    assert link["placement"]["bound_cpus"] == [BOUND_CPU]  # ENGINELINK_PLACEMENT=auto
    requests = {q["id"]: q for q in view["requests"]}
    assert sorted(requests) == ["long-0", "long-1", "long-n2"]  # warm-up, if any, ended before serving
    pair = requests["long-n2"]
    assert (pair["state"], pair["n"], pair["prompt_tokens"]) == ("running", 2, len(PROMPT))
    assert pair["engine_ids"] == ["long-n2#0", "long-n2#1"]
    assert pair["tokens"] >= 2 and pair["age_s"] > 0
    assert view["ended_recently"] == {"aborted": 1, "finished": 2}
    journal = view["journal"]
    assert journal["path"] == str(busy.journal) and journal["first_seq"] == 1 and journal["pruned_at_start"] == 0
    assert journal["records"] == journal["last_seq"] and journal["by_kind"]["engine.frame"] > 0
    assert (journal["records_max"], journal["bytes_max"]) == (5_000_000, 1024 ** 3)
    # The media settings it started with: the processor, the setting that decided it, every bound by name
    # (the item cap 0: unset, the engine's own --limit-mm-per-prompt alone).
    media = view["run"]["media"]
    assert (media["mm_processor"], media["mm_processor_source"]) == ("off", "default")
    assert media["bounds"]["SMG_VLLM_MM_MAX_ITEMS"] == 0 and media["bounds"]["SMG_VLLM_MM_SIDECAR_MAX_QUEUE"] == 256

    # Tokens so far keep growing while the streams run.
    before = requests["long-0"]["tokens"]
    wait_until(lambda: {q["id"]: q for q in inspect_json(busy.journal)["requests"]}["long-0"]["tokens"] > before + 5,
               5, "long-0 to make progress in inspect")


def test_human_view_lists_the_same(busy):
    done = enginelink("inspect", "--journal", busy.journal)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert f"servicer pid {busy.process.pid}" in out and "RUNNING (pid alive)" in out
    assert "vllm-0     serving" in out and "(alive)" in out and "max_model_len=2048" in out
    assert f"priority: engine 10 levels below the servicer: nice {engine_nice(busy)}" in out
    assert "run SCHED_BATCH" in out
    if len(os.sched_getaffinity(0)) > 1:
        assert f"placement: the engine binds CPU {BOUND_CPU}; the servicer's " in out
    else:
        assert "placement: unchanged: the engine binds no thread to particular CPUs" in out  # its only CPU
    assert "requests in flight (3)" in out
    rows = sorted(line.split() for line in out.splitlines() if line.startswith("  long-"))
    assert [(row[0], row[1], row[3]) for row in rows] == [("long-0", "running", "1"), ("long-1", "running", "1"),
                                                          ("long-n2", "running", "2")]
    assert "recently ended: 1 aborted, 2 finished" in out
    assert "media: mm_processor=off (source=default); bounds: " in out
    assert "SMG_VLLM_MM_MAX_ITEM_BYTES=33554432" in out and "SMG_VLLM_MM_SIDECAR_TIMEOUT_MS=30" in out


# Runs argv with SIGINT's default action, as in a terminal: a test run started in the background by a
# non-interactive shell has SIGINT ignored, the children inherit that, and Ctrl-C then never arrives. A
# small Python that resets it and execs (a default disposition survives exec), not ``preexec_fn``: that
# runs Python in the forked child of a parent whose other threads (an earlier test's gRPC channels in
# the same xdist worker) may hold locks, and on CI the child died before its first line.
_AT_A_TERMINAL = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"


def _as_at_a_terminal(argv: list[str]) -> list[str]:
    return [sys.executable, "-c", _AT_A_TERMINAL, *argv]


def test_watch_refreshes_until_interrupted(busy):
    watch = subprocess.Popen(_as_at_a_terminal([str(VENV_BIN / "enginelink"), "inspect", "--journal", str(busy.journal),
                                                "--json", "--watch", "0.2"]), stdout=subprocess.PIPE, text=True)
    try:
        first = json.loads(watch.stdout.readline())
        # The frames keep coming: a later refresh shows a later journal seq. Not necessarily the next one:
        # on a loaded box (CI, load 17) a 0.2 s refresh can fall before the servicer's next journal flush.
        seqs = []
        for _ in range(50):  # 10 s of refreshes at most
            seqs.append(json.loads(watch.stdout.readline())["as_of"]["seq"])
            if seqs[-1] > first["as_of"]["seq"]:
                break
        assert seqs[-1] > first["as_of"]["seq"], (first["as_of"], seqs[-5:])
        # Two refreshes printed: it is in its loop. Ctrl-C ends it promptly with status 0.
        # communicate, not wait: it keeps reading, so a refresh printed meanwhile cannot
        # block the tool on a full pipe (the test's, not the tool's, delay).
        watch.send_signal(signal.SIGINT)
        watch.communicate(timeout=5)
        assert watch.returncode == 0
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()


def test_port_names_the_default_journal(busy, tmp_path):
    state_home = tmp_path / "state"
    (state_home / "enginelink").mkdir(parents=True)
    done = enginelink("inspect", "--port", "50999", env={"XDG_STATE_HOME": str(state_home)})
    assert done.returncode == 1
    assert f"no journal at {state_home / 'enginelink' / 'journal-50999.sqlite'}" in done.stderr
    # A copy of the live journal under the default name is found by port (and read as a dead run's).
    copy_journal(busy.journal, state_home / "enginelink" / "journal-50999.sqlite")
    done = enginelink("inspect", "--json", env={"XDG_STATE_HOME": str(state_home), "ENGINELINK_PORT": "50999"})
    assert done.returncode == 0, done.stderr
    assert {q["id"] for q in json.loads(done.stdout)["requests"]} >= {"long-0", "long-1"}


def test_inspect_shows_the_kv_relay_window_and_its_subscribers(tmp_path, test_model_dir):
    from tests.kv.kv_client import KvSubscription, generate, prompt

    with Servicer(tmp_path, model_dir=test_model_dir) as servicer:
        with KvSubscription(servicer) as subscription:
            subscription.caught_up()
            generate(servicer, "kv-inspect", prompt(7, 64))
            wait_until(lambda: inspect_json(servicer.journal)["kv"]["subscribers_open"], 5, "subscriber journaled")
            kv = inspect_json(servicer.journal)["kv"]
            assert kv["batches_journaled"] > 0
            assert len(kv["subscribers_open"]) == 1 and kv["subscribers_seen"] == 1
            assert kv["ranks"]["0"]["state"] == "live" and kv["ranks"]["0"].get("holes", []) == []
            subscription.cancel()
        wait_until(lambda: inspect_json(servicer.journal)["kv"]["subscribers_open"] == [], 5, "subscriber gone")
        text = enginelink("inspect", "--journal", servicer.journal).stdout
        assert "KV events:" in text and "subscribers open 0" in text and "rank 0: live" in text


BLOCKED_READ = """
import sqlite3, sys
from enginelink.tools.inspect import interruptible
db = sys.argv[1]
locker = sqlite3.connect(db, isolation_level=None)
locker.execute("CREATE TABLE t (x)")
locker.execute("BEGIN EXCLUSIVE")  # every other connection now waits its busy timeout, inside SQLite

def read():
    print("reading", flush=True)  # from the worker: the main thread is inside the try by now
    sqlite3.connect(db, timeout=120).execute("SELECT * FROM t").fetchall()

try:
    interruptible(read)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(0)
sys.exit(3)
"""


def test_ctrl_c_is_not_held_off_by_a_read_blocked_in_sqlite(tmp_path):
    """What kept `inspect --watch` from ending on SIGINT: a SQLite call holds off Python's handler
    until it returns (here a 120 s busy wait). Read through ``interruptible``, Ctrl-C ends it at once."""
    reader = subprocess.Popen(_as_at_a_terminal([str(VENV_BIN / "python"), "-c", BLOCKED_READ,
                                                 str(tmp_path / "locked.sqlite")]), stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline().strip() == "reading"
        reader.send_signal(signal.SIGINT)
        out, _ = reader.communicate(timeout=5)
        assert (reader.returncode, out.strip()) == (0, "interrupted")
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()
