"""The load of ``enginelink bench``: the servicer process, the client processes, the measurement.

Used by ``bench.py`` (the command, with the sim engine) and ``bench_engine.py``
(``--engine vllm``); it imports neither, so the three are a chain, not a cycle.

Theory of operation. The bench starts ``enginelink serve`` on a free loopback
port with the sim engine (zero cost unless ``--engine-args`` gives it one) and
its own temporary journal, or drives an existing servicer (``--target``). Once
grpc.health.v1 says SERVING it starts ``--client-procs`` load processes
(grpcio asyncio clients, one channel each by default), lets each warm its
connection, then says "go" to all at once. Each keeps its share of
``--concurrency`` streaming Generate calls open (``ignore_eos``, so every call
yields exactly ``max_tokens``) until ``--requests`` are done or
``--duration-s`` is up, timing every message. The load window runs from "go"
to the last call's end; the servicer's CPU (user + sys of its process only,
from ``/proc/<pid>/stat``; the engine child is read apart) is read at both
ends of it.

Rules:
- the figure that matters is servicer CPU seconds per output token; on a
  shared, noisy machine wall-clock rates are only comparable side by side;
- the load generator must not be what limits throughput: it runs in its own
  processes and reports its own CPU, so a saturated client is visible;
- every run is checked: each call must end with a ``complete`` after exactly
  ``max_tokens`` streamed tokens; short or failed calls are counted, never
  hidden;
- no global state survives a run: the servicer (when the bench started it)
  and the client processes are always stopped, the temporary journal removed.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
import traceback
import uuid
from array import array
from pathlib import Path

# Longest the bench waits for the servicer (and its engine) to say SERVING.
SERVING_TIMEOUT_S = 120.0
# Longest a client process may take to connect and warm up.
CLIENT_READY_TIMEOUT_S = 60.0
# After the load window is due to end, how long stragglers get.
STRAGGLER_GRACE_S = 120.0
# Without --requests or --duration-s, the load lasts this long.
DEFAULT_DURATION_S = 10.0
VLLM_SERVICE = "vllm.grpc.engine.VllmEngine"
# The gRPC contract a servicer speaks (the sim's ``serve --wire``, or ``--engine mlx``'s MlxEngine): service,
# stub modules and class, and the SamplingParams field of the output length. The load is the same calls in each.
CONTRACTS = {
    "vllm": (VLLM_SERVICE, "vllm_engine_pb2", "VllmEngineStub", "max_tokens"),
    "mlx": ("mlx.grpc.engine.MlxEngine", "mlx_engine_pb2", "MlxEngineStub", "max_tokens"),
    "tokenspeed": ("tokenspeed.grpc.scheduler.TokenSpeedScheduler", "tokenspeed_scheduler_pb2",
                   "TokenSpeedSchedulerStub", "max_new_tokens"),
    "sglang": ("sglang.grpc.scheduler.SglangScheduler", "sglang_scheduler_pb2", "SglangSchedulerStub",
               "max_new_tokens"),
}


def contract(wire: str):
    """(service name, its messages module, its grpcio stub class, the max-tokens field) of the contract ``wire``."""
    import importlib

    service, messages, stub, max_field = CONTRACTS[wire]
    pb = importlib.import_module(f"smg_grpc_proto.generated.{messages}")
    pb_grpc = importlib.import_module(f"smg_grpc_proto.generated.{messages}_grpc")
    return service, pb, getattr(pb_grpc, stub), max_field
CLK_TCK = os.sysconf("SC_CLK_TCK")




def proc_cpu_s(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of one process: all its threads, not its children."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    # The command name is in parentheses and may hold spaces: split after it.
    fields = stat[stat.rindex(b")") + 2:].split()
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK  # utime, stime (fields 14, 15)


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds per thread name (``comm``) of one process; same-named threads summed."""
    by_name: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return by_name
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended meanwhile
        name = stat[stat.index(b"(") + 1:stat.rindex(b")")].decode(errors="replace")
        if tid == str(pid):
            name = "main"
        fields = stat[stat.rindex(b")") + 2:].split()
        by_name[name] = by_name.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / CLK_TCK
    return by_name


def proc_rss_mib(pid: int) -> tuple[float, float] | None:
    """(resident now, peak resident) of one process, MiB, from ``/proc/<pid>/status``; None if it is gone."""
    found = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    found[line[:5]] = int(line.split()[1]) / 1024
    except OSError:
        return None
    return found.get("VmRSS", 0.0), found.get("VmHWM", 0.0)


def proc_children(pid: int) -> list[int]:
    children: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                children += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return children


def machine_cpu_s() -> tuple[float, float, float]:
    """Whole-machine (busy, softirq, steal) CPU seconds so far, from /proc/stat."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (values + [0] * 8)[:8]
    busy = user + nice + system + irq + softirq
    return busy / CLK_TCK, softirq / CLK_TCK, steal / CLK_TCK


def code_version() -> str | None:
    """The enginelink checkout's commit, with ``-dirty`` when it has local changes."""
    here = Path(__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + ("-dirty" if dirty else "")


def machine_facts() -> dict:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_1m": os.getloadavg()[0],
        "code": code_version(),
    }


# -- the servicer -----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(target: str, timeout_s: float, process: subprocess.Popen | None = None, wire: str = "vllm") -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    with grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"servicer exited with status {process.returncode} before SERVING")
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(service=CONTRACTS[wire][0]), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError as error:
                last = error
            time.sleep(0.1)
    raise TimeoutError(f"{target} not SERVING within {timeout_s:g} s (last error: {last!r})")


def server_facts(target: str, wire: str = "vllm") -> dict:
    """What the servicer says about itself (GetServerInfo, GetModelInfo)."""
    import grpc

    _, pb, stub_class, _ = contract(wire)
    with grpc.insecure_channel(target) as channel:
        stub = stub_class(channel)
        info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        model = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    if wire == "tokenspeed":  # TokenSpeed's GetServerInfo: its own message (Structs, the release)
        kind, seqs = f"tokenspeed-{info.tokenspeed_version}", int(info.scheduler_info["max_running_requests"])
    elif wire == "sglang":  # SGLang's: server_type is always "grpc"; the release and the limit are elsewhere
        kind, seqs = f"sglang-{info.sglang_version}", int(info.server_args["max_running_requests"])
    else:
        kind, seqs = info.server_type, getattr(info, "max_num_seqs", 0)  # MLX's has none
    return {
        "wire": wire,
        "server_type": kind,
        "max_num_seqs": seqs,
        "served_model_name": model.served_model_name,
        "vocab_size": model.vocab_size,
        "max_context_length": model.max_context_length,
    }


def bench_model_dir() -> Path:
    """The bench's own copy of the tiny test model (built once, rebuilt when its recipe changes).

    Its own, so a bench never depends on, or rewrites, the copy ``serve`` keeps.
    """
    import platformdirs

    from enginelink.tools.test_model import make_test_model

    path = Path(platformdirs.user_cache_dir("enginelink")) / "bench-test-model"
    try:
        return make_test_model(path)
    except FileExistsError:  # an older recipe's build: this folder is the bench's to replace
        return make_test_model(path, force=True)


class Servicer:
    """``enginelink serve`` in a subprocess with a temporary journal."""

    def __init__(self, args: argparse.Namespace, tmp: Path, engine: str = "sim", model_dir: Path | None = None,
                 engine_args: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.wire = getattr(args, "wire", "vllm")  # the sim's wire, and so the contract served
        self.contract = "mlx" if engine == "mlx" else self.wire  # MLX's engine speaks vLLM's wire, serves MlxEngine
        tmp.mkdir(parents=True, exist_ok=True)
        self.log_path = tmp / "servicer.log"
        engine_args = engine_args_of(args) if engine_args is None else engine_args
        # /metrics on, for the output-delay histogram (run_load reads it at both ends of the window).
        self.metrics_port: int | None = free_port()
        self.argv = [
            sys.executable, "-m", "enginelink.tools.cli", "serve", "--port", str(self.port),
            "--metrics-port", str(self.metrics_port),
            "--journal", str(tmp / "journal.sqlite"), "--log-level", "WARNING", *(["--engine", engine]),
            *(["--wire", self.wire] if self.wire != "vllm" else []),
            "--model", str(model_dir or args.model or bench_model_dir()), "--", *engine_args,
        ]
        self.env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen | None = None
        self._log = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = SERVING_TIMEOUT_S) -> None:
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        try:
            wait_serving(self.target, timeout_s, self.process, self.contract)
        except BaseException as error:
            # SystemExit too: a bench's SIGTERM (bench.run) lands here while a slow start-up waits, and
            # the servicer and its engine must stop with it, not run on orphaned.
            self.stop()
            if not isinstance(error, Exception):
                raise
            raise RuntimeError(f"servicer did not start: {error}") from None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None


def engine_args_of(args: argparse.Namespace) -> list[str]:
    engine_args = shlex.split(args.engine_args_text) + list(args.engine_args)
    if not any(a.split("=", 1)[0] == "--max-num-seqs" for a in engine_args):
        # The sim engine runs 128 sequences at once by default; the bench measures
        # the servicer, so every open call should be running in the engine.
        engine_args += ["--max-num-seqs", str(max(128, args.concurrency))]
    return engine_args


# -- the load -----------------------------------------------------------------------------


def _client_main(conn, index: int, plan: dict) -> None:
    """A client process: connect, report ready, wait for go, run its share, report."""
    try:
        if plan["cpus"]:
            os.sched_setaffinity(0, plan["cpus"])
        if plan["client"] == "h2":
            result = _h2_client(conn, index, plan)
        else:
            import asyncio

            result = asyncio.run(_client(conn, index, plan))
        conn.send(("done", result))
    except BaseException:  # a separate process: report everything, then exit
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def call_numbers(requests: int | None, stop_at: float | None):
    """``take()``: the next call's number (1, 2, ...), or None once ``requests`` calls were taken
    or, without a count, once ``stop_at`` (time.monotonic) has passed."""
    left = [requests]
    taken = [0]

    def take() -> int | None:
        if requests is not None:
            if left[0] <= 0:
                return None
            left[0] -= 1
        elif time.monotonic() >= stop_at:
            return None
        taken[0] += 1
        return taken[0]

    return take


# A 64x48 PNG (one colour), as a data: URL: the default media ref of --media-ref-share.
DEFAULT_MEDIA_URL = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAEAAAAAwCAIAAAAuKetIAAAAQ0lEQVR42u3P"
                     "AQ0AAAQAMATRP4pYWthsf4PndMdnFc8JCAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgI3FmvFwFkpERfBAAAAABJRU5ErkJggg==")


def media_every(share: float) -> int:
    """Every how many calls one carries a media ref (0: none), for ``--media-ref-share``."""
    if not share:
        return 0
    if not 0 < share <= 1:
        raise ValueError(f"--media-ref-share {share}: expected a fraction in (0, 1]")
    return max(1, round(1 / share))


def carries_media(plan: dict, n: int) -> bool:
    every = plan.get("media_every") or 0
    return bool(every) and n >= 0 and n % every == 0


def _request_factory(plan: dict, index: int):
    """``request(n, tokens)``: call number ``n`` of this client process, the same for either client."""
    import random

    _, pb, _, max_field = contract(plan.get("wire", "vllm"))

    # Ids 0-2 are special in the test model; stay inside any vocabulary.
    span = max(1, min(61, plan["vocab_size"] - 3))
    prompt = [3 + (i % span) for i in range(plan["prompt_tokens"])]
    temperature = plan.get("temperature", 0.0)
    rng = random.Random() if plan.get("random_prompt") else None
    tag = f"bench-{plan['tag']}-{index}"

    def request(n: int, tokens: int) -> pb.GenerateRequest:
        call = pb.GenerateRequest(
            request_id=f"{tag}-{n}",
            tokenized=pb.TokenizedInput(
                input_ids=prompt if rng is None else [3 + rng.randrange(max(1, plan["vocab_size"] - 3)) for _ in prompt]),
            sampling_params=pb.SamplingParams(temperature=temperature, ignore_eos=True, **{max_field: tokens}),
            stream=True,
        )
        if carries_media(plan, n):  # the router's worker-side form: the image by URL, for this worker to fetch
            from smg_grpc_proto.generated import common_pb2

            call.media_refs.items.add(modality=common_pb2.IMAGE, url=plan["media_url"])
        return call

    return request


class CallRecorder:
    """What a client process reports of its calls, whichever client made them: counts, TTFT and the gaps."""

    def __init__(self, max_tokens: int, plan: dict | None = None, window: tuple[float, float] | None = None) -> None:
        self.max_tokens = max_tokens
        self.plan = plan or {}  # --media-ref-share: which calls carry a media ref
        self.ttft, self.gap_msg, self.gap_tok = array("d"), array("d"), array("d")
        self.counts = {"requests": 0, "ok": 0, "short": 0, "errors": 0, "tokens": 0, "messages": 0, "chunks": 0,
                       "media_requests": 0, "media_tokens": 0}
        self.error_codes: dict[str, int] = {}
        self.open: dict[int, list] = {}  # call number -> [start, last chunk, tokens, complete seen]
        # The steady window (time.monotonic, as the bench's parent reads it): latency samples and
        # window_tokens only from inside it; None: every call and chunk counts.
        self.window = window
        self.window_tokens = 0
        self.media_window_tokens = 0  # of window_tokens, those of calls carrying a media ref
        self.clock = time.monotonic  # CLOCK_MONOTONIC: the parent's window is on the same clock

    def _inside(self, t: float) -> bool:
        return self.window is None or self.window[0] <= t < self.window[1]

    def start(self, n: int) -> None:
        self.counts["requests"] += 1
        now = self.clock()
        self.open[n] = [now, now, 0, False]

    def on_response(self, n: int, response) -> None:
        now = self.clock()
        state = self.open[n]
        self.counts["messages"] += 1
        if response.WhichOneof("response") == "chunk":
            got = len(response.chunk.token_ids)
            inside = self._inside(now)
            if inside:
                self.window_tokens += got
                if carries_media(self.plan, n):
                    self.media_window_tokens += got
            if state[2] == 0:
                if self._inside(state[0]):  # a call started in the window: its first token counts
                    self.ttft.append(now - state[0])
            elif got and inside:
                gap = now - state[1]
                self.gap_msg.append(gap)
                self.gap_tok.append(gap / got)
            self.counts["chunks"] += 1
            state[2] += got
            state[1] = now
        else:
            state[3] = True

    def end(self, n: int, error: str | None) -> None:
        """The call ended: OK (``error`` None) or with the gRPC status named ``error``."""
        _, _, tokens, completed = self.open.pop(n)
        self.counts["tokens"] += tokens
        if carries_media(self.plan, n):
            self.counts["media_requests"] += 1
            self.counts["media_tokens"] += tokens
        if error is not None:
            self.counts["errors"] += 1
            self.error_codes[error] = self.error_codes.get(error, 0) + 1
        elif completed and tokens == self.max_tokens:
            self.counts["ok"] += 1
        elif completed:
            self.counts["short"] += 1

    def report(self, cpu_s: float) -> dict:
        return {
            **self.counts,
            "window_tokens": self.window_tokens,
            "media_window_tokens": self.media_window_tokens,
            "error_codes": self.error_codes,
            "cpu_s": cpu_s,
            "ttft": self.ttft.tobytes(),
            "gap_msg": self.gap_msg.tobytes(),
            "gap_tok": self.gap_tok.tobytes(),
        }


def _h2_client(conn, index: int, plan: dict) -> dict:
    """A client process's load over the lean HTTP/2 client (``tools/bench_h2client.py``), one connection."""
    import grpc

    from enginelink.tools.bench_h2client import Connection, run_calls

    service, pb, _, _ = contract(plan.get("wire", "vllm"))
    status_names = {code.value[0]: code.name for code in grpc.StatusCode}
    request = _request_factory(plan, index)
    parse = pb.GenerateResponse.FromString

    def calls(record: CallRecorder, tokens: int):
        def make_request(n: int) -> bytes:
            record.start(n)
            return request(n, tokens).SerializeToString()

        def on_end(n: int, code: int, text: str) -> None:
            record.end(n, None if code == 0 else status_names.get(code, str(code)))

        return make_request, lambda n, body: record.on_response(n, parse(body)), on_end

    connection = Connection(plan["target"], f"/{service}/Generate")
    try:
        # Warm-up: one short call, so the connection and the server's call path are up before "go".
        warm, warm_ids = CallRecorder(2), iter([-1])
        run_calls(connection, 1, lambda: next(warm_ids, None), *calls(warm, 2))
        if warm.counts["ok"] != 1:
            raise RuntimeError(f"the warm-up call failed: {warm.counts} {warm.error_codes}")

        conn.send(("ready", None))
        message, stop_at, window = conn.recv()
        assert message == "go", message
        record = CallRecorder(plan["max_tokens"], plan, window)
        cpu0 = time.process_time()
        run_calls(connection, plan["concurrency"], call_numbers(plan["requests"], stop_at),
                  *calls(record, plan["max_tokens"]), ramp_s=plan.get("ramp_s", 0.0))
        cpu1 = time.process_time()
    finally:
        connection.close()
    return record.report(cpu1 - cpu0)


async def _client(conn, index: int, plan: dict) -> dict:
    """A client process's load over grpc.aio, ``--channels`` channels."""
    import asyncio

    import grpc

    stub_class = contract(plan.get("wire", "vllm"))[2]
    channels = [
        grpc.aio.insecure_channel(plan["target"], options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(plan["channels"])
    ]
    stubs = [stub_class(c) for c in channels]
    max_tokens = plan["max_tokens"]
    request = _request_factory(plan, index)

    # Warm-up: one short call per channel, so connections exist before "go".
    for i, stub in enumerate(stubs):
        async for _ in stub.Generate(request(-1 - i, 2)):
            pass

    conn.send(("ready", None))
    message, stop_at, window = await asyncio.get_running_loop().run_in_executor(None, conn.recv)
    assert message == "go", message
    record = CallRecorder(max_tokens, plan, window)
    take = call_numbers(plan["requests"], stop_at)
    ramp_s = plan.get("ramp_s", 0.0)

    async def one(stub, n: int) -> None:
        record.start(n)
        try:
            async for response in stub.Generate(request(n, max_tokens)):
                record.on_response(n, response)
        except grpc.aio.AioRpcError as error:
            record.end(n, error.code().name)
        else:
            record.end(n, None)

    async def worker(stub, delay_s: float) -> None:
        await asyncio.sleep(delay_s)  # the ramp (run_calls' ramp_s)
        while (n := take()) is not None:
            await one(stub, n)

    cpu0 = time.process_time()  # all of this process's threads, grpc's own included
    await asyncio.gather(*(worker(stubs[i % len(stubs)], i * ramp_s / plan["concurrency"])
                           for i in range(plan["concurrency"])))
    cpu1 = time.process_time()
    for c in channels:
        await c.close()
    return record.report(cpu1 - cpu0)


def _shares(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def run_load(args: argparse.Namespace, target: str, servicer_pid: int | None, metrics_port: int | None = None) -> dict:
    """Start the client processes, run the load window, return the report.

    With ``args.warm_s`` (a steady window): the clients open their slots over ``warm_s`` and keep
    them busy; only ``[go + warm_s, go + warm_s + duration_s)`` is measured (tokens, latency, CPU,
    the servicer's /metrics histograms when ``metrics_port``), so neither the ramp nor the tail of
    stragglers is in the figures."""
    procs = args.client_procs
    warm_s = getattr(args, "warm_s", None)
    duration_s = args.duration_s if args.duration_s is not None else (
        None if args.requests is not None and warm_s is None else DEFAULT_DURATION_S)
    tag = uuid.uuid4().hex[:8]
    wire = getattr(args, "contract", None) or getattr(args, "wire", "vllm")  # the contract's CONTRACTS key
    server = server_facts(target, wire)
    if args.prompt_tokens + args.max_tokens > server["max_context_length"]:
        raise RuntimeError(f"--prompt-tokens + --max-tokens exceed the model's context ({server['max_context_length']})")
    conc = _shares(args.concurrency, procs)
    reqs = _shares(args.requests, procs) if args.requests is not None else [None] * procs
    ctx = multiprocessing.get_context("spawn")
    clients = []
    spy = None
    try:
        for i in range(procs):
            parent, child = ctx.Pipe()
            plan = {
                "target": target, "tag": tag, "channels": args.channels, "concurrency": conc[i], "wire": wire,
                "client": args.client,
                "requests": reqs[i], "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens,
                "vocab_size": server["vocab_size"],
                "temperature": getattr(args, "temperature", 0.0), "random_prompt": getattr(args, "random_prompt", False),
                "media_every": media_every(getattr(args, "media_ref_share", 0.0)),
                "media_url": getattr(args, "media_ref_url", None) or DEFAULT_MEDIA_URL,
                # The client stands for the router: it runs where the servicer runs, so off the CPUs
                # an engine binds when the servicer keeps off them (ENGINELINK_PLACEMENT).
                "cpus": sorted(os.sched_getaffinity(servicer_pid)) if servicer_pid else None,
                "ramp_s": warm_s or 0.0,
            }
            proc = ctx.Process(target=_client_main, args=(child, i, plan), daemon=False)
            proc.start()
            child.close()
            clients.append((proc, parent))
        for proc, conn in clients:
            _expect(conn, "ready", CLIENT_READY_TIMEOUT_S)

        engine_pids = proc_children(servicer_pid) if servicer_pid else []
        spy = None

        def read_start():
            nonlocal spy
            spy = _start_py_spy(args.py_spy, servicer_pid) if args.py_spy and servicer_pid else None
            return (machine_cpu_s(), proc_cpu_s(servicer_pid) if servicer_pid else None,
                    thread_cpu_s(servicer_pid) if servicer_pid else {}, sum(map(_cpu_or_zero, engine_pids)),
                    scrape_histograms(metrics_port), time.monotonic())

        def read_end():
            return (machine_cpu_s(), _cpu_if_alive(servicer_pid) if servicer_pid else None,
                    thread_cpu_s(servicer_pid) if servicer_pid else {}, sum(map(_cpu_or_zero, engine_pids)),
                    proc_rss_mib(servicer_pid) if servicer_pid else None, scrape_histograms(metrics_port),
                    time.monotonic())

        go = time.monotonic()
        window = None if warm_s is None else (go + warm_s, go + warm_s + duration_s)
        stop_at = window[1] if window else (go + duration_s if duration_s is not None else None)
        if window is None:
            machine0, cpu0, threads0, engine0, hist0, t0 = read_start()
        for _, conn in clients:
            conn.send(("go", stop_at, window))
        if window is not None:
            _sleep_until(window[0], clients)
            machine0, cpu0, threads0, engine0, hist0, t0 = read_start()
            _sleep_until(window[1], clients)
            machine1, cpu1, threads1, engine1, rss, hist1, t1 = read_end()
        limit = (warm_s or 0) + (duration_s or 0) + STRAGGLER_GRACE_S + (args.requests or 0) * args.max_tokens * 1e-3
        results = [_expect(conn, "done", limit) for _, conn in clients]
        if window is None:
            machine1, cpu1, threads1, engine1, rss, hist1, t1 = read_end()
    finally:
        if spy is not None:
            _stop_py_spy(spy)
        for proc, conn in clients:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
            conn.close()

    servicer_cpu = None if cpu0 is None else (cpu1[0] - cpu0[0], cpu1[1] - cpu0[1])
    # Threads that ended within the window are missing here; the process total is exact.
    threads = {name: round(cpu - threads0.get(name, 0.0), 3) for name, cpu in threads1.items()}
    report = summarize(args, results, t1 - t0, servicer_cpu, engine1 - engine0 if engine_pids else None,
                       steady=window is not None)
    report["server"] = server
    report["output_delay_ms"] = output_delay(hist0, hist1)
    if "frames_received" in hist1 and "frames_received" in hist0 and t1 > t0:
        # The engine's side of the rate: its steps/s and tokens per step (≈ requests running per step).
        steps = hist1["frames_received"][0][1] - hist0["frames_received"][0][1]
        report["engine_frames_per_s"] = steps / (t1 - t0)
        report["tokens_per_engine_frame"] = report["output_tokens"] / steps if steps else None
    if spy is not None and args.py_spy.suffix != ".svg" and args.py_spy.exists():
        report["profile"] = {"samples_file": str(args.py_spy), "activities": profile_activities(args.py_spy)}
    report["servicer_threads_cpu_s"] = dict(sorted(threads.items(), key=lambda kv: -kv[1]))
    # The servicer's memory at the end of the window (every call still open then counts) and its peak so far.
    report["servicer_rss_mib"], report["servicer_rss_peak_mib"] = rss if rss else (None, None)
    busy, softirq, steal = (b - a for a, b in zip(machine0, machine1))
    ours = (report["servicer_cpu_s"] or 0.0) + (report["engine_cpu_s"] or 0.0) + report["client_cpu_s"]
    report["machine_cpu"] = {
        "busy_s": busy,
        "softirq_s": softirq,
        "steal_s": steal,
        # Busy time the bench's own processes do not explain: other work on the machine.
        "others_s": max(0.0, busy - ours),
        "capacity_s": (os.cpu_count() or 1) * report["wall_s"],
    }
    return report


def _sleep_until(when: float, clients) -> None:
    """Sleep until ``when`` (time.monotonic); a client that reports early (it failed) ends it."""
    while (left := when - time.monotonic()) > 0:
        if any(conn.poll(0) for _, conn in clients):
            return
        time.sleep(min(left, 0.05))


OUTPUT_DELAY = "smg_servicer_output_delay_seconds"


def scrape_histograms(metrics_port: int | None) -> dict[str, list[tuple[float, float]]]:
    """The servicer's output-delay histogram per stage, [(le, cumulative count)], from its /metrics;
    {} without an endpoint or when it cannot be read (the figures are then left out, never guessed)."""
    if metrics_port is None:
        return {}
    import re
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
    except OSError:
        return {}
    out: dict[str, list[tuple[float, float]]] = {}
    for m in re.finditer(rf'^{OUTPUT_DELAY}_bucket{{([^}}]*)}} (\S+)$', text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        le = float("inf") if labels["le"] == "+Inf" else float(labels["le"])
        out.setdefault(labels.get("stage", ""), []).append((le, float(m.group(2))))
    # The engine frames the link received: over a window, the engine's steps (one frame per step).
    frames = re.search(r'^smg_servicer_link_frames_received{[^}]*} (\S+)$', text, re.M)
    if frames:
        out["frames_received"] = [(0.0, float(frames.group(1)))]
    return out


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus's ``histogram_quantile``: linear within the bucket the rank falls in."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_le, lower_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return lower_le
            return lower_le + (le - lower_le) * ((rank - lower_count) / (count - lower_count) if count > lower_count else 1)
        lower_le, lower_count = le, count
    return buckets[-2][0] if len(buckets) > 1 else None


def output_delay(before: dict, after: dict) -> dict | None:
    """The output-delay histogram over the window (after minus before), per stage: frames, p50/p90/p99 ms."""
    if not after:
        return None
    out = {}
    for stage, buckets in after.items():
        if stage == "frames_received":
            continue
        base = dict(before.get(stage, []))
        delta = [(le, count - base.get(le, 0.0)) for le, count in buckets]
        frames = max((c for _, c in delta), default=0.0)
        out[stage] = {"frames": int(frames),
                      **{f"p{q}": (None if (v := histogram_quantile(q / 100, delta)) is None else v * 1e3)
                         for q in (50, 90, 99)}}
    return out


def _expect(conn, what: str, timeout_s: float):
    if not conn.poll(timeout_s):
        raise TimeoutError(f"a client process did not report {what!r} within {timeout_s:g} s")
    message, payload = conn.recv()
    if message == "error":
        raise RuntimeError(f"a client process failed:\n{payload}")
    assert message == what, (message, what)
    return payload


def _cpu_if_alive(pid: int) -> tuple[float, float]:
    try:
        return proc_cpu_s(pid)
    except OSError:
        raise RuntimeError(f"the servicer (pid {pid}) exited during the load window") from None


def _cpu_or_zero(pid: int) -> float:
    try:
        return sum(proc_cpu_s(pid))
    except OSError:
        return 0.0


def _start_py_spy(out: Path, pid: int) -> subprocess.Popen:
    exe = Path(sys.executable).parent / "py-spy"
    fmt = "flamegraph" if out.suffix == ".svg" else "raw"
    return subprocess.Popen(
        [str(exe) if exe.exists() else "py-spy", "record", "--pid", str(pid), "--output", str(out),
         "--format", fmt, "--rate", "250", "--nonblocking"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


def _stop_py_spy(spy: subprocess.Popen) -> None:
    spy.send_signal(signal.SIGINT)
    try:
        spy.wait(timeout=30)
    except subprocess.TimeoutExpired:
        spy.kill()
        spy.wait()


# -- the profile ------------------------------------------------------------------------

# Activities of the servicer, by a marker frame anywhere in a sampled stack;
# the first rule that matches wins, so the order matters.
PROFILE_ACTIVITIES: list[tuple[str, tuple[str, ...]]] = [
    ("journal writer thread (SQLite)", ("WorkerThread._work",)),
    ("snapshot fold task", ("run_snapshots",)),
    ("engine frames: zmq recv, journal append, decode, fan-out", ("receive_frames", "EngineLink.handle_frames")),
    ("response headers + trailers", ("send_initial_metadata", "send_trailing_metadata", "Stream.__aexit__",
                                     "Stream.send_headers")),
    ("response messages: take, protobuf, grpclib, h2, socket write",
     ("Stream.send_message", "RequestHub.take", "RequestCore.take", "vllm/edge.py", "Stream.send_data", "H2Connection.send_data",
      "send_message (grpclib/stream", "data_send_process")),
    ("request intake: h2 receive, accept, parse, validate, admit, zmq send",
     ("_io_task", "data_received", "Handler.accept", "validate_generate", "RequestHub.admit", "recv_message",
      "request_handler")),
    ("trio + trio-asyncio scheduling", ("_main_loop_one", "unrolled_run")),
]


def profile_activities(collapsed: Path) -> dict[str, float]:
    """Share of py-spy samples per activity, from its raw (collapsed stacks) output."""
    counts: dict[str, int] = {}
    total = 0
    for line in collapsed.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        total += int(n)
        name = next((name for name, marks in PROFILE_ACTIVITIES if any(m in stack for m in marks)), "other")
        counts[name] = counts.get(name, 0) + int(n)
    return {name: n / total for name, n in sorted(counts.items(), key=lambda kv: -kv[1])} if total else {}


# -- the report ---------------------------------------------------------------------------


def percentile(sorted_values, q: float) -> float | None:
    """Nearest-rank percentile of an already sorted sequence (None when empty)."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q * len(sorted_values) / 100))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def _samples(results: list[dict], key: str) -> list[float]:
    values = array("d")
    for r in results:
        values.frombytes(r[key])
    return sorted(values)


def summarize(args, results: list[dict], wall_s: float, servicer_cpu: tuple[float, float] | None,
              engine_cpu_s: float | None, steady: bool = False) -> dict:
    """The report: counts, rates, latency percentiles and CPU per output token.

    ``steady``: the rates and CPU per token are over the window's tokens (``window_tokens``), not
    every call's; the counts and checks are still every call's."""
    servicer_cpu_s = None if servicer_cpu is None else sum(servicer_cpu)
    total = {k: sum(r.get(k, 0) for r in results)
             for k in ("requests", "ok", "short", "errors", "tokens", "messages", "chunks", "media_requests",
                       "media_tokens")}  # fmt: skip
    all_tokens = total["tokens"]
    if steady:  # the window's tokens, media calls' among them, as the CPU is the window's
        total["tokens"] = sum(r["window_tokens"] for r in results)
        total["media_tokens"] = sum(r.get("media_window_tokens", 0) for r in results)
    codes: dict[str, int] = {}
    for r in results:
        for code, n in r["error_codes"].items():
            codes[code] = codes.get(code, 0) + n
    client_cpu_s = sum(r["cpu_s"] for r in results)
    tokens = total["tokens"]

    def ms(values, q):
        v = percentile(values, q)
        return None if v is None else v * 1e3

    ttft, gap_msg, gap_tok = (_samples(results, k) for k in ("ttft", "gap_msg", "gap_tok"))
    per_token = (lambda cpu: None if cpu is None or not tokens else cpu / tokens * 1e6)
    return {
        "config": {
            "target": args.target, "concurrency": args.concurrency, "requests": args.requests,
            "duration_s": args.duration_s, "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens,
            "client": args.client, "client_procs": args.client_procs, "channels": args.channels,
            "engine_args": None if args.target else engine_args_of(args),
        },
        "machine": machine_facts(),
        "wall_s": wall_s,
        **total,
        "error_codes": codes,
        "output_tokens": tokens,
        "tokens_per_s": tokens / wall_s if wall_s else 0.0,
        # Steady: the window's rates, from its tokens (calls and messages are counted per call, not per window).
        "requests_per_s": (tokens / args.max_tokens if steady else total["ok"]) / wall_s if wall_s else 0.0,
        "messages_per_s": ((tokens * total["chunks"] / all_tokens if all_tokens else 0.0) if steady
                           else total["messages"]) / wall_s if wall_s else 0.0,
        "tokens_per_chunk": all_tokens / total["chunks"] if total["chunks"] else 0.0,
        "steady": steady,
        "all_calls_tokens": all_tokens,
        "ttft_ms": {"p50": ms(ttft, 50), "p90": ms(ttft, 90), "p99": ms(ttft, 99)},
        "itl_token_ms": {"p50": ms(gap_tok, 50), "p90": ms(gap_tok, 90), "p99": ms(gap_tok, 99)},
        "itl_message_ms": {"p50": ms(gap_msg, 50), "p90": ms(gap_msg, 90), "p99": ms(gap_msg, 99)},
        "servicer_cpu_s": servicer_cpu_s,
        "servicer_cpu_user_s": None if servicer_cpu is None else servicer_cpu[0],
        "servicer_cpu_sys_s": None if servicer_cpu is None else servicer_cpu[1],
        "servicer_cpu_us_per_token": per_token(servicer_cpu_s),
        # --media-ref-share: all the servicer's CPU (the media calls' fetch and refit included) over the text
        # calls' tokens only, the conservative reading of "the text calls' CPU per token".
        "servicer_cpu_us_per_text_token": None if servicer_cpu_s is None or tokens <= total["media_tokens"]
        else servicer_cpu_s / (tokens - total["media_tokens"]) * 1e6,
        "servicer_cpu_util": None if servicer_cpu_s is None else servicer_cpu_s / wall_s,
        "engine_cpu_s": engine_cpu_s,
        "engine_cpu_us_per_token": per_token(engine_cpu_s),
        "client_cpu_s": client_cpu_s,
        "client_cpu_us_per_token": per_token(client_cpu_s),
        "client_cpu_util": client_cpu_s / wall_s if wall_s else 0.0,
    }
