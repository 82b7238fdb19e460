"""Figures for docs/limits.md, "Request input" (issue 38 item 4): another client's latency while an input attack runs.

Not a test: it starts ``enginelink serve`` on the sim engine (defaults unless a
scenario names a knob), keeps bystanders calling it (a grpc.health Check over
and over on one connection, a 4-token Generate over and over on another),
sends the attack from a third connection, and prints the attack's answer,
the longest step the servicer's event loop took during it in servicer CPU
time (the servicer runs under ``loop_steps.py``), the bystanders' latency
before and during it, and the servicer's RSS around it. Run from the
repository root (loopback only, each scenario well under a minute):

    .venv/bin/python -m tests.adversarial.measure_inputs [--only NAME ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as pb, vllm_engine_pb2_grpc as pb_grpc

from enginelink.tools.test_model import make_test_model
from tests.adversarial.conftest import rss_bytes
from tests.harness import VLLM_SERVICE, Servicer, free_port, generate_request

MiB = 1 << 20
# The client side of every channel takes what the servicer may send and receive (64 MiB).
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 64 * MiB), ("grpc.max_receive_message_length", 256 * MiB)]


class Bystander:
    """Other clients, each on its own connection and thread: one calling health over and over, one
    a 4-token Generate over and over.

    Health is answered by the servicer alone: its latency is how long the
    servicer's event loop kept another client waiting. The Generate also
    waits for the engine, which the attack may keep busy (the sim engine has
    its own CPU cost per token and logprob), so it is reported apart.
    """

    def __init__(self, port: int) -> None:
        self.channels = [grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) for _ in range(2)]
        self.health = health_pb2_grpc.HealthStub(self.channels[0])
        self.stub = pb_grpc.VllmEngineStub(self.channels[1])
        self.checks: list[tuple[float, float]] = []  # (started, seconds)
        self.generates: list[tuple[float, float]] = []
        self.failures = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._checking, daemon=True),
                         threading.Thread(target=self._generating, daemon=True)]

    def _timed(self, into: list, call) -> None:
        started = time.monotonic()
        try:
            call()
        except grpc.RpcError:
            self.failures += 1
        into.append((started, time.monotonic() - started))
        time.sleep(0.01)

    def _checking(self) -> None:
        while not self._stop.is_set():
            self._timed(self.checks, lambda: self.health.Check(
                health_pb2.HealthCheckRequest(service=VLLM_SERVICE), timeout=120))

    def _generating(self) -> None:
        n = 0
        while not self._stop.is_set():
            self._timed(self.generates, lambda: list(self.stub.Generate(generate_request(
                f"bystander-{n}", [5, 6, 7], max_tokens=4, ignore_eos=True), timeout=120)))
            n += 1

    def __enter__(self) -> "Bystander":
        for thread in self._threads:
            thread.start()
        time.sleep(2.0)  # a baseline
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(130)
        for channel in self.channels:
            channel.close()


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _latencies(rounds: list[tuple[float, float]], start: float, end: float) -> str:
    before = [took for began, took in rounds if began + took < start]
    during = [took for began, took in rounds if began <= end and began + took >= start]
    return (f"before median {_ms(statistics.median(before))} / max {_ms(max(before))}; during {len(during)} calls, "
            f"median {_ms(statistics.median(during))}, max {_ms(max(during))}")


def _longest_step(path: Path, start: float, end: float) -> str:
    """The longest task step ``loop_steps`` recorded in [start, end]: servicer CPU, and the task."""
    steps = []
    for line in path.read_text().splitlines() if path.exists() else []:
        at, ms, task = line.split(" ", 2)
        if start <= float(at) <= end:
            steps.append((float(ms), task.rsplit(".", 1)[-1]))
    if not steps:
        return "none of 5 ms or more"
    ms, task = max(steps)
    return f"{ms:.0f} ms of CPU ({task}); {len(steps)} steps of 5 ms or more"


def report(name: str, bystander: Bystander, attack_start: float, attack_end: float, answer: str,
           rss: tuple[int, int, int], steps: Path) -> None:
    print(f"{name}: {answer}; attack {attack_end - attack_start:.1f} s")
    print(f"   longest event-loop step during the attack: {_longest_step(steps, attack_start, attack_end + 1)}")
    print(f"   bystander health: {_latencies(bystander.checks, attack_start, attack_end)}")
    print(f"   bystander Generate: {_latencies(bystander.generates, attack_start, attack_end)}; "
          f"failures {bystander.failures}")
    print(f"   servicer RSS {rss[0] / MiB:.0f} -> {rss[1] / MiB:.0f} MiB after the attack -> "
          f"{rss[2] / MiB:.0f} MiB 3 s later")


def attack(s: Servicer, name: str, requests: list[pb.GenerateRequest]) -> None:
    """Send ``requests`` at once (one thread each) while a bystander runs; print what it saw."""
    channel = grpc.insecure_channel(f"127.0.0.1:{s.port}", options=CHANNEL_OPTIONS)
    stub = pb_grpc.VllmEngineStub(channel)
    answers: list[str] = []

    def one(request) -> None:
        try:
            out = list(stub.Generate(request, timeout=300))
            answers.append(f"OK ({len(out)} messages, {sum(m.ByteSize() for m in out) / MiB:.1f} MiB)")
        except grpc.RpcError as error:
            answers.append(f"{error.code().name}: {error.details()[:90]}")

    pid = s.process.pid
    with Bystander(s.port) as bystander:
        rss0 = rss_bytes(pid)
        threads = [threading.Thread(target=one, args=(r,)) for r in requests]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        ended = time.monotonic()
        rss1 = rss_bytes(pid)
        time.sleep(3)
        rss2 = rss_bytes(pid)
    channel.close()
    answer = answers[0] if len(set(answers)) == 1 else "; ".join(answers)
    if len(requests) > 1:
        answer = f"{len(requests)} x {answer}"
    report(name, bystander, started, ended, answer, (rss0, rss1, rss2), s.steps)


def _servicer(tmp: Path, model: Path, engine_args: list[str] | None = None) -> Servicer:
    steps = tmp / "loop-steps.txt"
    servicer = Servicer(tmp, model_dir=model, extra=["--metrics-port", str(free_port())], engine_args=engine_args,
                        env={"SMG_VLLM_SERVICER_WARMUP": "off", "ENGINELINK_DRAIN_SECS": "0.2",
                             "ENGINELINK_MEASURE_STEPS": str(steps)})
    # The CLI with a trio instrument recording long task steps (loop_steps.py), run from the repository root.
    servicer.argv[0:1] = [sys.executable, "-m", "tests.adversarial.loop_steps"]
    servicer.steps = steps
    return servicer


def empty_choices(tmp, model, count: int = 8_000_000) -> None:
    request = generate_request("empty-choices", [5, 6, 7], max_tokens=4,
                               choice=pb.ChoiceConstraint(choices=[""] * count))
    with _servicer(tmp, model) as s:
        attack(s, f"choice = [''] x {count:,} ({request.ByteSize() / MiB:.0f} MiB)", [request])


def stop_token_ids(tmp, model, count: int = 2_000_000, n: int = 64) -> None:
    request = generate_request("stop-ids", [5, 6, 7], max_tokens=4, n=n, stop_token_ids=[300] * count)
    with _servicer(tmp, model) as s:
        attack(s, f"stop_token_ids x {count:,}, n = {n} ({request.ByteSize() / MiB:.0f} MiB)", [request])


def long_prompt(tmp, model, tokens: int = 32_000_000) -> None:
    request = generate_request("long-prompt", [300] * tokens, max_tokens=4)
    with _servicer(tmp, model) as s:
        attack(s, f"a {tokens:,}-token prompt ({request.ByteSize() / MiB:.0f} MiB)", [request])


def logprobs(tmp, model, prompt: int = 1000, max_tokens: int = 500) -> None:
    requests = [generate_request(f"logprobs-{i}", [5 + j % 4000 for j in range(prompt)], max_tokens=max_tokens,
                                 ignore_eos=True, n=64, logprobs=20, prompt_logprobs=20) for i in range(4)]
    # Room for all 256 sequences and the bystander's (its Generate waits for no slot), and an engine
    # step of 10 ms: the sim engine at zero cost would run ahead of any servicer, and the bystander's
    # tokens would wait behind the engine's backlog of frames, whatever the servicer does per frame.
    with _servicer(tmp, model, ["--max-num-seqs", "512", "--step-us", "10000"]) as s:
        attack(s, f"4 non-streaming calls, n = 64, logprobs 20, prompt logprobs 20, {prompt}-token prompt, "
                  f"{max_tokens} tokens", requests)


def logprobs_zero_cost(tmp, model, prompt: int = 1000, max_tokens: int = 1000) -> None:
    """The report's shape on the sim engine at zero cost: it runs ahead of any servicer, so the bystander's
    Generate waits behind the engine's backlog; health shows the servicer's own loop."""
    requests = [generate_request(f"logprobs-{i}", [5 + j % 4000 for j in range(prompt)], max_tokens=max_tokens,
                                 ignore_eos=True, n=64, logprobs=20, prompt_logprobs=20) for i in range(4)]
    with _servicer(tmp, model, ["--max-num-seqs", "512"]) as s:
        attack(s, f"zero-cost engine: 4 non-streaming calls, n = 64, logprobs 20, prompt logprobs 20, "
                  f"{prompt}-token prompt, {max_tokens} tokens", requests)


def logprobs_vocab(tmp, model, prompt: int = 200, max_tokens: int = 200) -> None:
    request = generate_request("logprobs-all", [5 + j % 4000 for j in range(prompt)], max_tokens=max_tokens,
                               ignore_eos=True, n=4, logprobs=-1, prompt_logprobs=-1)
    with _servicer(tmp, model, ["--max-logprobs", "-1", "--step-us", "10000"]) as s:
        attack(s, f"--max-logprobs -1: one non-streaming call, n = 4, logprobs -1, prompt logprobs -1, "
                  f"{prompt}-token prompt, {max_tokens} tokens", [request])


SCENARIOS = {f.__name__: f for f in (empty_choices, stop_token_ids, long_prompt, logprobs, logprobs_vocab,
                                     logprobs_zero_cost)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=sorted(SCENARIOS), default=list(SCENARIOS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="el-inputs-") as tmp:
        model = make_test_model(Path(tmp) / "tiny-test-model")
        for name in args.only:
            work = Path(tmp) / name
            work.mkdir()
            SCENARIOS[name](work, model)


if __name__ == "__main__":
    main()
