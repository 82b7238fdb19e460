"""``enginelink bench``: a short real run, checked for consistent counts (never for speed).

The bench starts its own servicer on the sim engine (zero cost), so these
tests need nothing but the venv. Timing figures are not asserted: they
depend on the machine; only what must hold on any machine is.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import time

import pytest

from enginelink.tools import bench, bench_load
from tests.harness import VENV_BIN

# Enough tokens that the servicer's CPU shows: the bench reads it from /proc in clock ticks (10 ms),
# and at ~15 us a token a run of 128 tokens (8 x 16) once read 0 ticks in CI.
REQUESTS = 32
MAX_TOKENS = 128
SMALL_REQUESTS, SMALL_MAX_TOKENS = 16, 128  # 2,048 tokens: some 30 ms of servicer CPU, three ticks or more
SMALL = ("--requests", str(SMALL_REQUESTS), "--max-tokens", str(SMALL_MAX_TOKENS))


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


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.parametrize("client", ["h2", "grpcio"])
def test_cli_json_report_counts_are_consistent(test_model_dir, client):
    """The command as a user runs it: two client processes, JSON on stdout, with either load client."""
    result = subprocess.run(
        [str(VENV_BIN / "enginelink"), "bench", "--model", str(test_model_dir), "--json",
         "--requests", str(REQUESTS), "--max-tokens", str(MAX_TOKENS), "--concurrency", "8",
         "--client-procs", "2", "--client", client],
        capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    _check_counts(report, REQUESTS, MAX_TOKENS)
    assert report["config"]["client_procs"] == 2
    assert report["config"]["client"] == client
    assert report["config"]["engine_args"] == ["--max-num-seqs", "128"]


@pytest.mark.process
@pytest.mark.slow
def test_engine_args_reach_the_engine(test_model_dir):
    """A cost model given with --engine-args shapes the run; counts still hold."""
    args = _args("--model", str(test_model_dir), *SMALL,
                 "--concurrency", "4", "--engine-args=--step-us 2000 --max-num-seqs 2")
    report = bench.measure(args)
    _check_counts(report, SMALL_REQUESTS, SMALL_MAX_TOKENS)
    assert report["config"]["engine_args"] == ["--step-us", "2000", "--max-num-seqs", "2"]
    assert report["server"]["max_num_seqs"] == 2  # as the engine reported it


@pytest.mark.process
@pytest.mark.slow
def test_the_tokenspeed_contract_is_measured_the_same_way(test_model_dir):
    """``--wire tokenspeed``: the sim speaks TokenSpeed's wire and the load speaks its contract; counts hold."""
    args = _args("--model", str(test_model_dir), "--wire", "tokenspeed", *SMALL,
                 "--concurrency", "4", "--engine-args=--max-num-seqs 3")
    report = bench.measure(args)
    _check_counts(report, SMALL_REQUESTS, SMALL_MAX_TOKENS)
    assert report["server"]["wire"] == "tokenspeed"
    assert report["server"]["server_type"] == "tokenspeed-0.1.1"
    assert report["server"]["max_num_seqs"] == 3  # from TokenSpeed's scheduler_info, as the engine reported it
    assert "tokenspeed contract" in bench.format_report(report).splitlines()[0]


@pytest.mark.process
@pytest.mark.slow
def test_the_sglang_contract_is_measured_the_same_way(test_model_dir):
    """``--wire sglang``: the sim speaks SGLang's scheduler wire, the load SglangScheduler; counts hold."""
    args = _args("--model", str(test_model_dir), "--wire", "sglang", *SMALL,
                 "--concurrency", "4", "--engine-args=--max-num-seqs 3")
    report = bench.measure(args)
    _check_counts(report, SMALL_REQUESTS, SMALL_MAX_TOKENS)
    assert report["server"]["wire"] == "sglang"
    assert report["server"]["server_type"] == "sglang-0.5.23"
    assert report["server"]["max_num_seqs"] == 3  # SGLang's max_running_requests, as the engine reported it
    assert "sglang contract" in bench.format_report(report).splitlines()[0]


def test_refused_options_exit_2(capsys):
    assert bench.run(_args("--concurrency", "0")) == 2
    assert "--concurrency must be >= 1" in capsys.readouterr().err
    assert bench.run(_args("--servicer-pid", "1")) == 2
    assert bench.run(_args("--channels", "2")) == 2
    assert "--channels goes with --client grpcio" in capsys.readouterr().err
    assert bench.run(_args("--wire", "tokenspeed", "--engine", "vllm")) == 2
    assert "--wire goes with the sim engine" in capsys.readouterr().err


@pytest.mark.process
@pytest.mark.slow
def test_a_steady_window_measures_after_the_warm_up_and_reads_the_servicers_output_delay(test_model_dir):
    """--warm-s: calls open over the warm-up, then only the window after it counts (its tokens, its
    latency percentiles); the servicer's own output-delay histogram is read over the same window."""
    result = subprocess.run(
        [str(VENV_BIN / "enginelink"), "bench", "--model", str(test_model_dir), "--json", "--concurrency", "8",
         "--warm-s", "1", "--duration-s", "2", "--max-tokens", "32", "--engine-args=--step-us 20000"],
        capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    # The window is the --duration-s asked for, give or take the time its two /metrics reads take on a
    # loaded box (a wall time bounded loosely: no timed assertion in tests).
    assert report["steady"] and 1.0 <= report["wall_s"] < 12.0, report["wall_s"]
    assert report["errors"] == report["short"] == 0 and report["ok"] == report["requests"]
    # The window's tokens only: fewer than every call streamed (the warm-up and the tail are out).
    assert 0 < report["output_tokens"] < report["all_calls_tokens"]
    for key in ("ttft_ms", "itl_token_ms"):
        assert report[key]["p50"] <= report[key]["p90"] <= report[key]["p99"]
    assert report["itl_token_ms"]["p50"] >= 15  # the engine's 20 ms a token
    for stage in ("received", "engine"):
        delay = report["output_delay_ms"][stage]
        assert delay["frames"] > 0 and delay["p50"] <= delay["p90"] <= delay["p99"]
    # Read at the frame, written at the flush: never more than the engine's timestamp to the write.
    assert report["output_delay_ms"]["received"]["p50"] <= report["output_delay_ms"]["engine"]["p99"]


def test_histogram_quantile_interpolates_as_prometheus_does():
    buckets = [(0.001, 10.0), (0.01, 90.0), (0.1, 100.0), (float("inf"), 100.0)]
    assert bench_load.histogram_quantile(0.05, buckets) == pytest.approx(0.0005)
    assert bench_load.histogram_quantile(0.5, buckets) == pytest.approx(0.001 + 0.009 * 40 / 80)
    assert bench_load.histogram_quantile(0.99, buckets) == pytest.approx(0.01 + 0.09 * 9 / 10)
    assert bench_load.histogram_quantile(0.5, [(0.001, 0.0), (float("inf"), 0.0)]) is None
    before = {"received": [(0.001, 5.0), (float("inf"), 5.0)]}
    after = {"received": [(0.001, 5.0), (float("inf"), 9.0)]}
    assert bench_load.output_delay(before, after)["received"]["frames"] == 4


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert bench_load.percentile(values, 50) == 50.0
    assert bench_load.percentile(values, 99) == 99.0
    assert bench_load.percentile(values, 100) == 100.0
    assert bench_load.percentile([], 50) is None
    assert bench_load.percentile([7.0], 99) == 7.0


def test_proc_cpu_counts_this_process():
    user, system = bench_load.proc_cpu_s(os.getpid())
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:  # burn CPU, so the counter must move
        pass
    later = bench_load.proc_cpu_s(os.getpid())
    assert later[0] + later[1] > user + system


def test_engine_vllm_options_parse_without_starting_anything(capsys):
    # Several concurrencies are for --engine vllm only; the sim bench refuses them.
    assert bench.run(_args("--concurrency", "32", "128")) == 2
    assert "--engine vllm" in capsys.readouterr().err
    assert bench.run(_args("--client", "h2", "grpcio")) == 2
    assert "several --client values go with --engine vllm" in capsys.readouterr().err
    args = _args("--engine", "vllm", "--concurrency", "32", "128", "--rounds", "0", "--client", "h2", "grpcio")
    assert args.concurrency == [32, 128]
    assert args.client == ["h2", "grpcio"]
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


# -- the lean load client (tools/bench_h2client.py) ----------------------------------------


@pytest.fixture(scope="module")
def servicer(test_model_dir, tmp_path_factory):
    from tests.harness import Servicer, shared

    with shared(Servicer(tmp_path_factory.mktemp("h2client"), model_dir=test_model_dir)) as running:
        yield running


def _h2_calls(servicer, requests: dict, **connection_options) -> tuple[dict, int]:
    """Run ``requests`` (n -> GenerateRequest) over one h2 client connection.

    Returns n -> (tokens, complete seen, (status, message)), and the DATA bytes the connection carried."""
    from smg_grpc_proto.generated import vllm_engine_pb2 as pb

    from enginelink.tools.bench_h2client import Connection, run_calls

    seen = {n: [[], False, None] for n in requests}
    pending = iter(sorted(requests))

    def on_message(n, body):
        response = pb.GenerateResponse.FromString(body)
        if response.WhichOneof("response") == "chunk":
            seen[n][0] += list(response.chunk.token_ids)
        else:
            seen[n][1] = True

    def on_end(n, code, text):
        seen[n][2] = (code, text)

    connection = Connection(f"127.0.0.1:{servicer.port}", f"/{bench_load.VLLM_SERVICE}/Generate", **connection_options)
    try:
        run_calls(connection, 4, lambda: next(pending, None), lambda n: requests[n].SerializeToString(),
                  on_message, on_end)
    finally:
        connection.close()
    return {n: tuple(v) for n, v in seen.items()}, connection.data_received


def test_h2_client_streams_what_grpcio_streams(servicer):
    """The bench's own client reads the same greedy tokens a real gRPC library gets, and the OK status."""
    from tests.harness import generate_request

    prompts = {n: [5 + n, 17, 42 + 3 * n, 9] for n in range(6)}
    requests = {n: generate_request(f"h2-same-{n}", p, stream=True, max_tokens=12, temperature=0.0, ignore_eos=True)
                for n, p in prompts.items()}
    seen, _ = _h2_calls(servicer, requests)
    for n, prompt in prompts.items():
        expected = []
        for reply in servicer.stub.Generate(generate_request(f"grpcio-same-{n}", prompt, stream=True, max_tokens=12,
                                                             temperature=0.0, ignore_eos=True)):
            if reply.WhichOneof("response") == "chunk":
                expected += list(reply.chunk.token_ids)
        assert len(expected) == 12
        assert seen[n] == (expected, True, (0, "")), n


def test_h2_client_reports_a_refused_call_and_the_others_finish(servicer):
    """A call the servicer refuses ends with its gRPC status; the calls beside it on the connection go on."""
    from tests.harness import generate_request

    requests = {n: generate_request(f"h2-mixed-{n}", [7, 8, 9], stream=True, max_tokens=8, ignore_eos=True)
                for n in range(5)}
    requests[2] = generate_request("h2-mixed-bad", [], stream=True, max_tokens=8)  # no prompt: refused
    seen, _ = _h2_calls(servicer, requests)
    tokens, complete, (code, text) = seen[2]
    assert (tokens, complete, code) == ([], False, 3)  # INVALID_ARGUMENT, before any chunk
    assert text
    for n in (0, 1, 3, 4):
        assert len(seen[n][0]) == 8 and seen[n][1:] == (True, (0, "")), n


def test_h2_client_tops_up_small_windows(servicer):
    """With small windows the calls only finish if the client gives the server more room as it reads.

    Each stream's window is 4 KiB and the connection's is HTTP/2's initial 64 KiB; the streams carry more
    than that, each and together (checked, so the test cannot pass without a top-up)."""
    from tests.harness import generate_request

    # 64 streams of 1500 tokens: at least ~190 KB of token ids alone (the sim's ids are 2-byte varints but for
    # 1 in 32), however many tokens each chunk carries; with 32, the per-wake-up chunks of a loaded box (one
    # chunk per call for every frame the engine ran ahead) came to 105 KB, under the margin below.
    requests = {n: generate_request(f"h2-window-{n}", [3 + n, 4], stream=True, max_tokens=1500, ignore_eos=True)
                for n in range(64)}
    seen, data_bytes = _h2_calls(servicer, requests, window=4096, timeout_s=30.0)
    assert data_bytes > 2 * 65_535
    for n in requests:
        assert len(seen[n][0]) == 1500 and seen[n][1:] == (True, (0, "")), n


def test_the_contract_path_bench_reports_every_contract(capsys):
    """``tools/bench_contracts.py``, tiny: a figure per contract and its ratio to vLLM's (never a speed)."""
    from enginelink.tools import bench_contracts

    assert bench_contracts.main(["--calls", "4", "--steps", "3", "--rounds", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["us_per_token"]) == {"vllm", "sglang", "tokenspeed"}
    assert all(v > 0 for v in report["us_per_token"].values())
    assert report["ratio_to_vllm"]["vllm"] == 1.0


def _descendants(pid: int) -> list[int]:
    found, todo = [], bench_load.proc_children(pid)
    while todo:
        child = todo.pop()
        found.append(child)
        todo += bench_load.proc_children(child)
    return found


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.process
@pytest.mark.slow
def test_sigterm_stops_the_servicer_and_engine_the_bench_started(test_model_dir):
    """``kill`` of a running bench ends it as Ctrl-C does: the servicer and engine it started stop with it
    (they kept running, orphaned, when SIGTERM's default action ended the bench)."""
    proc = subprocess.Popen(
        [str(VENV_BIN / "enginelink"), "bench", "--model", str(test_model_dir), "--against", "grpclib-floor",
         "--rounds", "1", "--concurrency", "4", "--max-tokens", "16", "--duration-s", "120"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    started: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            started = _descendants(proc.pid)
            commands = [_cmdline(pid) for pid in started]
            if any("sim_engine" in c for c in commands) and any(" serve " in c for c in commands):
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the bench never had its servicer and engine running: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(2.0)  # serving, under load
        started = _descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=60)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_running(pid) for pid in started):
            time.sleep(0.2)
        left = {pid: _cmdline(pid) for pid in started if _running(pid)}
        assert not left, f"still running after the bench ended: {left}"
        assert status == 128 + signal.SIGTERM  # as a shell reports a process ended by SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in started:  # what a failed check left behind
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.process
@pytest.mark.parametrize("args, words", [
    (["--latency-plot", "x.svg"], "it goes with --against or --engine vllm"),
    (["--against", "grpclib-floor", "--latency-plot", "x.png"], "an SVG file (FILE.svg)"),
    (["--soak", "60", "--latency-plot", "x.svg"], "--plot draws its curves"),
])
def test_a_latency_plot_it_cannot_draw_is_refused_before_the_run(tmp_path, args, words):
    """--latency-plot draws arms side by side (--plot is the run's tokens/s and CPU figure): without arms, or
    not an SVG, the bench says so and exits 2 before it starts anything."""
    done = subprocess.run([str(VENV_BIN / "enginelink"), "bench", *args], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert words in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_a_media_ref_share_puts_the_image_ref_on_every_nth_call_and_splits_the_text_tokens_out():
    from enginelink.tools import bench_load

    assert [bench_load.media_every(s) for s in (0.0, 0.1, 0.25, 1.0)] == [0, 10, 4, 1]
    with pytest.raises(ValueError, match="--media-ref-share 1.5"):
        bench_load.media_every(1.5)
    plan = {"wire": "vllm", "vocab_size": 4096, "prompt_tokens": 4, "tag": "t", "media_every": 10,
            "media_url": bench_load.DEFAULT_MEDIA_URL}
    request = bench_load._request_factory(plan, 0)
    carrying = [n for n in range(30) if request(n, 8).HasField("media_refs")]
    assert carrying == [0, 10, 20] and request(10, 8).media_refs.items[0].url.startswith("data:image/png;base64,")
    record = bench_load.CallRecorder(8, plan)
    for n in (0, 1, 2):
        record.start(n)
        record.open[n][2] = 5 if n == 0 else 8  # the tokens its chunks brought (on_response counts them)
        record.end(n, None)
    report = record.report(0.0)
    assert (report["media_requests"], report["media_tokens"], report["tokens"]) == (1, 5, 21)
