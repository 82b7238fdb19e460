"""What keeps the engine full: the front end gets the CPU first, and no transport limit below admission.

Both were found measuring a real vLLM engine (docs/benchmarks-history.md): its
processes busy-poll, so a servicer at the same priority waited for a core on
every wake-up; and h2's default of 100 concurrent streams per connection held
the 101st call in the client. These tests run ``enginelink serve`` over the
sim engine and look where a user would: the processes' priorities in
``/proc``, the journal, and calls on one channel.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from enginelink.journal.store import open_reader
from enginelink.journal.records import KIND_ENGINE_HANDSHAKE
from enginelink.runtime.engine.placement import ENGINE_NICE_DEFAULT, cpu_list, describe_placement
from enginelink.runtime.engine.engine_processes import engine_members
from enginelink.runtime.rpc.fastpath import MAX_CONCURRENT_STREAMS, READY_CALLBACKS_MAX
from tests.harness import Servicer, engine_pid, free_port, generate_request, scrape

PROMPT = [318, 283, 1552, 10, 90, 305]


def autogroup(pid: int | str) -> str | None:
    """The kernel's autogroup of ``pid`` and its nice ("/autogroup-123 nice 0"); None where autogroups
    do not apply (a cgroup prints nothing, a kernel without them has no file)."""
    try:
        return Path(f"/proc/{pid}/autogroup").read_text().strip() or None
    except OSError:
        return None


def priority_record(journal: Path) -> dict:
    with open_reader(journal) as reader:
        steps = [r.payload for r in reader.records(kinds=[KIND_ENGINE_HANDSHAKE])]
    return next(s["message"] for s in steps if s["step"] == "priority")


@pytest.mark.process
def test_engine_runs_at_the_servicers_priority_by_default(tmp_path, test_model_dir):
    """Production default (issue 23): no renice, so the engine does not yield to every process on the host."""
    assert ENGINE_NICE_DEFAULT == 0
    with Servicer(tmp_path, model_dir=test_model_dir) as servicer:
        engine = engine_pid(servicer.journal)
        own = os.getpriority(os.PRIO_PROCESS, servicer.process.pid)
        for pid in engine_members(engine):
            assert os.getpriority(os.PRIO_PROCESS, pid) == own, pid
        # The engine runs in the servicer's session, so under the kernel's autogroups in its scheduling
        # group (docs/benchmarks-history.md, "the kernel's autogroups"); its own process group, not the
        # foreground's: a terminal's ^C reaches the servicer alone, which drains and then stops it.
        for pid in engine_members(engine):
            assert autogroup(pid) == autogroup(servicer.process.pid), pid
            assert os.getsid(pid) == os.getsid(servicer.process.pid) and os.getpgid(pid) != os.getpgid(servicer.process.pid)
        assert os.getpgid(engine) == engine
        record = priority_record(servicer.journal)
        assert record["levels"] == 0 and "nice" not in record and "autogroup_nice" not in record
        assert f"engine process {engine} started, at the servicer's priority (ENGINELINK_ENGINE_NICE=0)" in servicer.log()


@pytest.mark.process
def test_engine_nice_ten_runs_the_engine_ten_levels_below_the_servicer(tmp_path, test_model_dir):
    """The opt-in knob still does what it did as the default."""
    with Servicer(tmp_path, model_dir=test_model_dir, env={"ENGINELINK_ENGINE_NICE": "10"}) as servicer:
        engine = engine_pid(servicer.journal)
        own = os.getpriority(os.PRIO_PROCESS, servicer.process.pid)
        expected = min(19, own + 10)
        for pid in engine_members(engine):
            assert os.getpriority(os.PRIO_PROCESS, pid) == expected, pid
        record = priority_record(servicer.journal)
        assert record["nice"] == expected
        assert f"engine process {engine} started, 10 levels below the servicer: nice {expected}" in servicer.log()
        # One scheduling group for the servicer and its engine, which nice alone ranks inside it: the
        # group itself (the servicer's too) keeps its weight.
        assert "autogroup_nice" not in record
        assert autogroup(engine) == autogroup(servicer.process.pid) == autogroup("self")


def thread_policies(pid: int) -> dict[int, int]:
    policies = {}
    for name in os.listdir(f"/proc/{pid}/task"):
        try:
            policies[int(name)] = os.sched_getscheduler(int(name))
        except ProcessLookupError:
            pass
    return policies


@pytest.mark.process
def test_servicer_threads_wait_for_the_engine_to_yield(tmp_path, test_model_dir):
    """With ENGINELINK_SERVICER_SCHED=batch every servicer thread runs SCHED_BATCH once the engine runs;
    the engine keeps SCHED_OTHER."""
    with Servicer(tmp_path, model_dir=test_model_dir, env={"ENGINELINK_SERVICER_SCHED": "batch"}) as servicer:
        engine = engine_pid(servicer.journal)
        policies = thread_policies(servicer.process.pid)
        assert len(policies) > 1 and set(policies.values()) == {os.SCHED_BATCH}, policies
        assert {os.sched_getscheduler(pid) for pid in engine_members(engine)} == {os.SCHED_OTHER}
        servicer_record = priority_record(servicer.journal)["servicer"]
        assert servicer_record["policy"] == "batch" and servicer_record["threads"] >= 1
        assert "threads run SCHED_BATCH, so they wait for the engine to yield" in servicer.log()
        # And it still serves.
        with grpc.insecure_channel(f"127.0.0.1:{servicer.port}") as channel:
            stub = pb_grpc.VllmEngineStub(channel)
            responses = list(stub.Generate(generate_request("after-batch", PROMPT, stream=True, max_tokens=4), timeout=30))
        assert responses[-1].complete.finish_reason == "length"


@pytest.mark.process
def test_a_servicer_started_as_batch_still_gives_its_engine_the_normal_policy(tmp_path, test_model_dir):
    """Policies are inherited: under `chrt -b` (here: a SCHED_BATCH parent) the engine must not be batch."""
    os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    try:
        servicer = Servicer(tmp_path, model_dir=test_model_dir, env={"ENGINELINK_SERVICER_SCHED": "batch"})
        servicer.start()
    finally:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    try:
        engine = engine_pid(servicer.journal)
        assert {os.sched_getscheduler(pid) for pid in engine_members(engine)} == {os.SCHED_OTHER}
        assert "policy_error" not in priority_record(servicer.journal)
    finally:
        servicer.stop()


@pytest.mark.process
def test_servicer_sched_normal_leaves_the_policy_alone(tmp_path, test_model_dir):
    with Servicer(tmp_path, model_dir=test_model_dir, env={"ENGINELINK_SERVICER_SCHED": "normal"}) as servicer:
        assert set(thread_policies(servicer.process.pid).values()) == {os.SCHED_OTHER}
        assert "servicer" not in priority_record(servicer.journal)


@pytest.mark.process
def test_servicer_threads_keep_sched_other_by_default(tmp_path, test_model_dir):
    """Production default (issue 23): SCHED_BATCH is opt-in; every servicer and engine thread keeps SCHED_OTHER."""
    with Servicer(tmp_path, model_dir=test_model_dir) as servicer:
        engine = engine_pid(servicer.journal)
        policies = thread_policies(servicer.process.pid)
        assert len(policies) > 1 and set(policies.values()) == {os.SCHED_OTHER}, policies
        assert {os.sched_getscheduler(pid) for pid in engine_members(engine)} == {os.SCHED_OTHER}
        assert "servicer" not in priority_record(servicer.journal)
        assert "SCHED_BATCH" not in servicer.log()


@pytest.mark.process
@pytest.mark.parametrize("name, value, expected", [
    ("ENGINELINK_SERVICER_SCHED", "fifo", "expected one of batch, normal"),
    ("ENGINELINK_PLACEMENT", "pinned", "expected one of auto, off"),
])
def test_a_bad_choice_is_refused_before_anything_starts(tmp_path, test_model_dir, name, value, expected):
    servicer = Servicer(tmp_path, model_dir=test_model_dir, env={name: value})
    servicer.start(wait_serving=False)
    try:
        assert servicer.wait(30) == 2
        assert f"{name}={value!r}: {expected}" in servicer.log()
    finally:
        servicer.stop()


@pytest.mark.process
def test_engine_nice_zero_keeps_the_servicers_priority(tmp_path, test_model_dir):
    with Servicer(tmp_path, model_dir=test_model_dir, env={"ENGINELINK_ENGINE_NICE": "0"}) as servicer:
        engine = engine_pid(servicer.journal)
        assert os.getpriority(os.PRIO_PROCESS, engine) == os.getpriority(os.PRIO_PROCESS, servicer.process.pid)
        assert priority_record(servicer.journal)["levels"] == 0
        assert "nice" not in priority_record(servicer.journal)


@pytest.mark.process
@pytest.mark.parametrize("value", ["high", "20", "-1"])
def test_bad_engine_nice_is_refused_before_anything_starts(tmp_path, test_model_dir, value):
    servicer = Servicer(tmp_path, model_dir=test_model_dir, env={"ENGINELINK_ENGINE_NICE": value})
    servicer.start(wait_serving=False)
    try:
        assert servicer.wait(30) == 2
        assert f"ENGINELINK_ENGINE_NICE={value!r}" in servicer.log()
    finally:
        servicer.stop()


@pytest.mark.process
def test_160_streams_on_one_connection_all_run_at_once(tmp_path, test_model_dir):
    """The router sends every call over one connection: none may wait in the transport."""
    calls = 160
    # 20 ms steps and 100 tokens: every call lasts ~2 s; the engine holds them all.
    engine_args = ["--step-us", "20000", "--max-num-seqs", "256"]
    metrics_port = free_port()
    with Servicer(tmp_path, model_dir=test_model_dir, engine_args=engine_args,
                  extra=["--metrics-port", str(metrics_port)]) as servicer:

        async def run() -> tuple[int, int]:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{servicer.port}") as channel:
                stub = pb_grpc.VllmEngineStub(channel)
                first_token = asyncio.Event()
                started = 0
                finished_before_all_started = 0
                all_started = asyncio.Event()

                async def one(i: int) -> None:
                    nonlocal started, finished_before_all_started
                    request = generate_request(f"many-{i}", PROMPT, stream=True, max_tokens=100, ignore_eos=True)
                    seen_first = False
                    async for response in stub.Generate(request, timeout=60):
                        if response.HasField("chunk") and not seen_first:
                            seen_first = True
                            started += 1
                            if started == calls:
                                all_started.set()
                            first_token.set()
                        if response.HasField("complete") and not all_started.is_set():
                            finished_before_all_started += 1

                await asyncio.gather(*(one(i) for i in range(calls)))
                return started, finished_before_all_started

        started, finished_early = asyncio.run(run())
        assert started == calls
        assert finished_early == 0, f"{finished_early} calls finished before the last one got its first token"
        # The operator sees the transport's bound, and that chunks went out the direct way.
        metrics = {name.split("{")[0]: value for name, value in scrape(metrics_port).items()}
        assert metrics["smg_servicer_link_max_concurrent_streams"] == MAX_CONCURRENT_STREAMS > calls
        assert metrics["smg_servicer_link_direct_writes"] > calls
        # Every call's headers went one way or the other; its OK trailers at most once from an engine frame.
        assert metrics["smg_servicer_grpc_direct_headers"] + metrics["smg_servicer_grpc_grpclib_headers"] == calls
        assert metrics["smg_servicer_grpc_direct_headers"] > 0
        assert 0 < metrics["smg_servicer_grpc_direct_trailers"] <= calls
        # ... and the asyncio loop's bound on callbacks per trio round (runtime/rpc/fastpath.py).
        assert metrics["smg_servicer_asyncio_ready_callbacks_max"] == READY_CALLBACKS_MAX
        assert "smg_servicer_asyncio_full_passes" in metrics


@pytest.mark.process
def test_the_engines_nice_value_leaves_the_shared_autogroup_alone():
    """The engine shares the servicer's session, so its autogroup too: lowering the engine lowers its
    processes alone, never the group (that would lower the servicer with it)."""
    import subprocess

    from enginelink.runtime.engine.placement import lower_priority

    before = autogroup("self")
    child = subprocess.Popen(["sleep", "30"], process_group=0)
    try:
        applied = lower_priority(child.pid, 5)
        assert applied == {"levels": 5, "nice": min(19, os.getpriority(os.PRIO_PROCESS, 0) + 5)}
        assert os.getpriority(os.PRIO_PROCESS, child.pid) == applied["nice"]
        assert autogroup(child.pid) == autogroup("self") == before
    finally:
        child.kill()
        child.wait()


# -- placement: off the CPUs the engine binds (ENGINELINK_PLACEMENT, opt-in) --------------

PLACED = {"ENGINELINK_PLACEMENT": "auto"}


def placement_record(journal: Path) -> dict | None:
    with open_reader(journal) as reader:
        steps = [r.payload for r in reader.records(kinds=[KIND_ENGINE_HANDSHAKE])]
    return next((s["message"] for s in steps if s["step"] == "placement"), None)


def thread_affinities(pid: int) -> dict[str, set[int]]:
    """Each thread's CPUs, keyed ``tid name``."""
    found = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            found[f"{tid} {name}"] = os.sched_getaffinity(int(tid))
        except (FileNotFoundError, ProcessLookupError):
            pass
    return found


def two_cpus() -> set[int]:
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip(f"placement needs 2 CPUs to choose between; this process may use {sorted(allowed)}")
    return allowed


@pytest.mark.process
def test_servicer_and_unbound_engine_threads_keep_off_the_cpu_the_engine_binds(tmp_path, test_model_dir):
    """The sim engine binds one thread to a CPU, as vLLM's CPU backend binds its Worker's OpenMP thread."""
    allowed = two_cpus()
    bound = min(allowed)
    front_end = allowed - {bound}
    with Servicer(tmp_path, model_dir=test_model_dir, engine_args=["--bind-cpu", str(bound)], env=PLACED) as servicer:
        servicer_threads = thread_affinities(servicer.process.pid)
        assert len(servicer_threads) > 1 and set(map(frozenset, servicer_threads.values())) == {frozenset(front_end)}, \
            servicer_threads
        engine = thread_affinities(engine_pid(servicer.journal))
        # The engine's bound thread stays where it bound itself; every other engine thread moved.
        assert sorted(map(sorted, engine.values())) == sorted([[bound]] + [sorted(front_end)] * (len(engine) - 1)), \
            engine
        record = placement_record(servicer.journal)
        assert record["bound_cpus"] == [bound] and record["front_end_cpus"] == sorted(front_end)
        # Threads started later inherit their creator's CPUs: the counts are those moved at the handshake.
        assert record["servicer_threads"] >= 1 and record["engine_threads"] >= 1
        assert f"placement: the engine binds CPU {bound}; the servicer's " in servicer.log()
        # It still serves.
        with grpc.insecure_channel(f"127.0.0.1:{servicer.port}") as channel:
            stub = pb_grpc.VllmEngineStub(channel)
            responses = list(stub.Generate(generate_request("placed", PROMPT, stream=True, max_tokens=4, ignore_eos=True),
                                           timeout=30))
        assert responses[-1].complete.finish_reason == "length"


@pytest.mark.process
def test_an_engine_that_binds_nothing_leaves_every_cpu_to_everyone(tmp_path, test_model_dir):
    allowed = two_cpus()
    with Servicer(tmp_path, model_dir=test_model_dir, env=PLACED) as servicer:
        assert set(map(frozenset, thread_affinities(servicer.process.pid).values())) == {frozenset(allowed)}
        assert placement_record(servicer.journal)["skipped"] == "the engine binds no thread to particular CPUs"
        assert "placement: unchanged: the engine binds no thread to particular CPUs" in servicer.log()


@pytest.mark.process
@pytest.mark.parametrize("env", [{}, {"ENGINELINK_PLACEMENT": "off"}], ids=["default", "off"])
def test_placement_off_by_default_leaves_affinity_alone(tmp_path, test_model_dir, env):
    allowed = two_cpus()
    with Servicer(tmp_path, model_dir=test_model_dir, engine_args=["--bind-cpu", str(min(allowed))],
                  env=env) as servicer:
        assert set(map(frozenset, thread_affinities(servicer.process.pid).values())) == {frozenset(allowed)}
        assert placement_record(servicer.journal) is None


def test_cpu_lists_read_like_the_kernels():
    assert cpu_list([1]) == "CPU 1"
    assert cpu_list([5, 0, 1, 2, 7, 8]) == "CPUs 0-2,5,7-8"
    assert describe_placement({"skipped": "the engine binds every CPU the servicer may use"}) == \
        "unchanged: the engine binds every CPU the servicer may use"
