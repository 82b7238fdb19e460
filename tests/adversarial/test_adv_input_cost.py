"""Inputs whose cost is not what their size says (issue 38, item 4).

Four attacks of the second pass, each legal-looking on the wire:

1. ``choice`` = ``[""] x 30,000,000``: empty strings counted as 0 bytes passed
   the 64 KiB constraint limit; the list was copied, made a grammar and
   encoded once per engine request, stalling every client for 37 s;
2. ``stop_token_ids`` of 4M ids with n = 64 (an 8 MB request): no count
   limit, and each of the 64 engine requests carries a copy;
3. a 32M-token prompt (64 MB): refused, but only after it was copied into a
   Python list (RSS 73 MB -> 1.56 GB, kept);
4. legal calls with n = 64 and top-20 (or, with ``--max-logprobs -1``,
   vocabulary-wide) logprobs: a Python object per position when the
   engine's rows came in, and every position filled into protobuf at once
   when the response was built, both on the event loop.

What holds now: lists are refused by their number of items before anything
copies or walks them (``ENGINELINK_MAX_CHOICES``, ``_STOP_TOKEN_IDS``,
``_LOGIT_BIAS_ENTRIES``, ``_ABORT_IDS``); a choice costs its bytes plus
``CHOICE_OVERHEAD_BYTES``; a prompt is judged by its length before it is
copied (a truncated one is cut first); logprobs are kept as the engine's
rows (a few C copies per output) and serialized by the call's writer in
slices of ``SLICE_ENTRIES`` entries. docs/limits.md has the figures
(``tests/adversarial/measure_inputs.py``).
"""

from __future__ import annotations

import array
import os
import threading
import time
import tracemalloc

import grpc
import msgspec
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sg_pb, tokenspeed_scheduler_pb2 as ts_pb
from smg_grpc_proto.generated import vllm_engine_pb2 as pb, vllm_engine_pb2_grpc

from enginelink.machines.link import LinkEvent, LinkMachine
from enginelink.machines.request_api import Complete
from enginelink.runtime.errors import ClientError
from enginelink.runtime.contracts.sglang import edge as contract_sglang
from enginelink.runtime.contracts.tokenspeed import edge as contract_tokenspeed
from enginelink.runtime.contracts.vllm import edge as contract_vllm
from enginelink.runtime.contracts.vllm.edge import VLLM_EDGE
from enginelink.runtime.requests.hub import RequestHub
from enginelink.runtime.requests.inputs import InputLimits, validate_abort_ids
from enginelink.runtime.requests.validate import EngineLimits
from enginelink.wire import vllm
from enginelink.wire.engine import OutputBatch
from tests.adversarial.conftest import rss_bytes
from tests.harness import VLLM_SERVICE, ListJournal, Servicer, generate_request

LIMITS = InputLimits()
ENGINE = EngineLimits(max_model_len=2048, vocab_size=4096, eos_token_ids=(2,))
MiB = 1 << 20
# The defaults of ENGINELINK_MAX_CHOICES, _LOGIT_BIAS_ENTRIES, _STOP_TOKEN_IDS and _ABORT_IDS, as docs/limits.md
# states them (written out, so a test fails for what the servicer takes, not for a missing name).
COUNT_MAX = 1024
STOP_IDS_MAX = 256
ABORT_IDS_MAX = 4096


def _refused(request, validate=contract_vllm.validate_generate, engine=ENGINE) -> ClientError:
    with pytest.raises(ClientError) as error:
        validate(request, engine, 0.0)
    return error.value


def _vllm(**sampling) -> pb.GenerateRequest:
    return generate_request("cost", [5, 6, 7], max_tokens=4, **sampling)


def _sglang(**sampling) -> sg_pb.GenerateRequest:
    return sg_pb.GenerateRequest(request_id="cost", tokenized=sg_pb.TokenizedInput(input_ids=[5, 6, 7]),
                                 sampling_params=sg_pb.SamplingParams(max_new_tokens=4, **sampling))


def _tokenspeed(**sampling) -> ts_pb.GenerateRequest:
    return ts_pb.GenerateRequest(request_id="cost", tokenized=ts_pb.TokenizedInput(input_ids=[5, 6, 7]),
                                 sampling_params=ts_pb.SamplingParams(max_new_tokens=4, **sampling))


WIRES = {
    "vllm": (_vllm, contract_vllm.validate_generate),
    "sglang": (_sglang, contract_sglang.validate_generate),
    "tokenspeed": (_tokenspeed, contract_tokenspeed.validate_generate),
}


def _peak_python_bytes(fn) -> int:
    """The most Python memory ``fn`` held at once (upb's own arena, the request's, is not traced)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        try:
            fn()
        except ClientError:
            pass
        return tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


# -- 1. empty choices ---------------------------------------------------------------------------


def test_the_count_limits_are_the_documented_defaults():
    assert (LIMITS.choices, LIMITS.logit_bias_entries, LIMITS.stop_token_ids) == (COUNT_MAX, COUNT_MAX, STOP_IDS_MAX)
    assert LIMITS.abort_ids == ABORT_IDS_MAX


def test_many_empty_choices_are_refused_by_their_count():
    request = _vllm()
    request.sampling_params.choice.choices.extend([""] * 30_000)  # the report's 30,000,000, scaled down
    error = _refused(request)
    assert error.field == "sampling_params.choice" and "ENGINELINK_MAX_CHOICES" in str(error)
    assert "30000 choices; at most 1024" in str(error)


def test_a_choice_costs_its_bytes_and_its_place_in_the_grammar():
    """1024 choices of 60 bytes: 61,440 bytes of text, under the 64 KiB cap, but 69,632 with their overhead."""
    request = _vllm()
    request.sampling_params.choice.choices.extend([f"{i:060d}" for i in range(COUNT_MAX)])
    error = _refused(request)
    from enginelink.runtime.requests.inputs import CHOICE_OVERHEAD_BYTES

    assert "ENGINELINK_MAX_CONSTRAINT_BYTES" in str(error) and f"{CHOICE_OVERHEAD_BYTES} a choice" in str(error)
    # The largest legal set: count and bytes both at their limits.
    each = LIMITS.constraint_bytes // COUNT_MAX - CHOICE_OVERHEAD_BYTES
    legal = _vllm()
    legal.sampling_params.choice.choices.extend([f"{i:0{each}d}" for i in range(COUNT_MAX)])
    call = contract_vllm.validate_generate(legal, ENGINE, 0.0)
    assert call.constraint == "sampling_params.choice"


# -- 2. stop token ids (and the other lists each choice gets a copy of) -------------------------


@pytest.mark.parametrize("wire", sorted(WIRES))
def test_stop_token_ids_are_refused_by_their_count_on_every_wire(wire):
    make, validate = WIRES[wire]
    error = _refused(make(stop_token_ids=[300] * (STOP_IDS_MAX + 1), n=64), validate)
    assert error.field == "sampling_params.stop_token_ids" and "ENGINELINK_MAX_STOP_TOKEN_IDS" in str(error)
    call = validate(make(stop_token_ids=[300] * STOP_IDS_MAX, n=2), ENGINE, 0.0)
    assert len(call.specs[0].sampling.stop_token_ids) == STOP_IDS_MAX


@pytest.mark.parametrize("wire", sorted(WIRES))
def test_logit_bias_is_refused_by_its_count_on_every_wire(wire):
    make, validate = WIRES[wire]
    keys = range(COUNT_MAX + 1)
    bias = {k: 1.0 for k in keys} if wire == "vllm" else {str(k): 1.0 for k in keys}
    error = _refused(make(logit_bias=bias), validate)
    assert error.field == "sampling_params.logit_bias" and "ENGINELINK_MAX_LOGIT_BIAS_ENTRIES" in str(error)


def test_the_reported_stop_token_ids_are_refused_without_being_copied():
    """4M ids with n = 64: refused, and validation held no Python copy of them."""
    request = _vllm(stop_token_ids=[300] * 4_000_000, n=64)
    peak = _peak_python_bytes(lambda: contract_vllm.validate_generate(request, ENGINE, 0.0))
    assert "ENGINELINK_MAX_STOP_TOKEN_IDS" in str(_refused(request))
    assert peak < MiB, f"validation held {peak / MiB:.1f} MiB"


def test_an_abort_of_many_ids_is_refused_by_their_count():
    with pytest.raises(ClientError, match="ENGINELINK_MAX_ABORT_IDS"):
        validate_abort_ids([""] * (ABORT_IDS_MAX + 1), LIMITS)
    assert len(validate_abort_ids([""] * ABORT_IDS_MAX, LIMITS)) == ABORT_IDS_MAX


# -- 3. a prompt far over the context -----------------------------------------------------------


def _long(make, tokens: int):
    request = make()
    request.tokenized.ClearField("input_ids")
    request.tokenized.input_ids.extend([300] * tokens)
    return request


@pytest.mark.parametrize("wire", sorted(WIRES))
def test_a_prompt_over_the_context_is_refused_before_it_is_copied(wire):
    make, validate = WIRES[wire]
    request = _long(make, 1_000_000)
    peak = _peak_python_bytes(lambda: validate(request, ENGINE, 0.0))
    error = _refused(request, validate)
    assert error.field == "tokenized.input_ids" and "prompt has 1000000 tokens" in str(error)
    assert peak < MiB, f"validation held {peak / MiB:.1f} MiB for a refused prompt"


def test_a_prompt_to_truncate_is_cut_before_it_is_copied():
    request = _long(_vllm, 1_000_000)
    request.tokenized.input_ids[-1] = 7
    request.sampling_params.truncate_prompt_tokens = -1  # keep the last max_model_len - 1
    request.sampling_params.max_tokens = 1  # the room that leaves
    calls = []
    peak = _peak_python_bytes(lambda: calls.append(contract_vllm.validate_generate(request, ENGINE, 0.0)))
    (call,) = calls
    assert len(call.prompt_token_ids) == ENGINE.max_model_len - 1 and call.prompt_token_ids[-1] == 7
    assert peak < MiB, f"validation held {peak / MiB:.1f} MiB to keep {ENGINE.max_model_len - 1} ids"


# -- 4. logprobs: the engine's rows in, the response out -----------------------------------------


def _engine_rows(rows: int, cols: int, first_token: int) -> list:
    ids = array.array("i", [first_token + r if c == 0 else c for r in range(rows) for c in range(cols)])
    values = array.array("f", [-0.5 - c for _ in range(rows) for c in range(cols)])
    ext = msgspec.msgpack.Ext  # raw bytes inline, as vLLM's encoder sends small arrays
    return [["<i4", [rows, cols], ext(3, ids.tobytes())], ["<f4", [rows, cols], ext(3, values.tobytes())],
            ["<i8", [rows], ext(3, array.array("q", [0] * rows).tobytes())]]


def test_a_frame_of_prompt_logprobs_costs_a_few_objects_per_choice_not_per_position():
    """64 choices, each with 2000 prompt positions of top-20 in one engine frame: what the receive loop
    allocates is counted in blocks, and it does not grow with the positions."""
    link = LinkMachine("sim-0", 0.0)
    link.handle(LinkEvent.HANDSHAKE_DONE, 0.0)
    link.handle(LinkEvent.WARMUP_DONE, 0.0)
    hub = RequestHub(link=link, codec=vllm.VllmCodec(), send_frames=lambda frames, rank=0: None,
                     journal=ListJournal(), edge=VLLM_EDGE)
    prompt = [10 + i for i in range(2001)]
    request = generate_request("lp", prompt, max_tokens=4, n=64, logprobs=20, prompt_logprobs=20)
    engine = EngineLimits(max_model_len=4096, vocab_size=4096, eos_token_ids=(2,))
    call = hub.admit(contract_vllm.validate_generate(request, engine, 0.0), 0.0)
    rows = _engine_rows(2000, 21, 11)
    sample = _engine_rows(1, 21, 99)
    outputs = [vllm.EngineCoreOutput(choice.engine_id, [99], new_logprobs=sample, new_prompt_logprobs_tensors=rows)
               for choice in call.choices]
    batch = OutputBatch(0, outputs)
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        hub.on_batch(batch, 1.0)
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    blocks = sum(stat.count_diff for stat in after.compare_to(before, "filename") if stat.count_diff > 0)
    assert call.error is None
    assert all(choice.logprobs.prompt is not None for choice in call.choices)
    # Per position (the former tuples and array slices) would be 64 x 2000 x 3 = 384,000 blocks.
    assert blocks < 64 * 60, f"{blocks} blocks for 64 choices of 2000 prompt positions"


def _complete_with_logprobs(positions: int, top: int) -> Complete:
    from enginelink.machines.logprobs import LogprobRun, PromptLogprobs

    cols = top + 1
    ids = array.array("i", [7 + r if c == 0 else 100 + c for r in range(positions) for c in range(cols)])
    values = array.array("f", [-float(r % 7) - c / 8 for r in range(positions) for c in range(cols)])
    run = LogprobRun(positions, cols, top, ids, values)
    prompt = PromptLogprobs(top, [3] + [7 + r for r in range(positions)], [run])
    return Complete(0, [7 + r for r in range(positions)], "length", positions + 1, 0, logprobs=[run],
                    logprobs_top=top, prompt_logprobs=prompt, completion_tokens=positions)


@pytest.mark.parametrize("top", [20, 4096])
def test_a_response_with_many_logprobs_is_built_by_its_writer_a_slice_at_a_time(top):
    """A non-streaming choice of 2000 prompt and 2000 output positions (top-20: 84,000 entries;
    vocabulary-wide, 16.4M): ``encode`` does none of it; each writer step fills at most one slice."""
    from enginelink.machines.logprobs import SLICE_ENTRIES
    from enginelink.runtime.requests.logprob_bytes import SlicedResponse

    positions = 2000 if top == 20 else 100
    m = _complete_with_logprobs(positions, top)
    (sliced,) = contract_vllm.encode([m])
    assert type(sliced) is SlicedResponse
    steps = sum(1 for _ in sliced.steps())
    entries = 2 * positions * (top + 1)
    assert steps >= entries // SLICE_ENTRIES, (steps, entries)
    # What the client gets is the message built at once.
    whole = contract_vllm.encode_complete(m)
    assert pb.GenerateResponse.FromString(sliced.body) == whole


# -- through a servicer ------------------------------------------------------------------------


class HealthProbe:
    """grpc.health Check, over and over on its own channel: how long the servicer's event loop kept
    another client waiting (the engine is not asked).

    Judged by the servicer's own CPU seconds while each check was pending, not by the check's wall
    time: on the CI box a dozen test workers share two cores, and a check that waited 3 s there
    while the servicer ran 0.3 s of it was the scheduler's doing, not the loop's (CI, stop 40: one
    such miss). With a core of its own (production) the two are the same; a loop held by the
    servicer's own work spends its CPU holding it, so a stall the probe must catch still shows in
    full. (A loop blocked in a system call, CPU idle, would not show; the attacks here cost CPU.) A
    check is given ``WALL_LIMIT_S`` of wall time; one that fails or runs out counts as missed."""

    WALL_LIMIT_S = 60.0

    def __init__(self, port: int, pid: int) -> None:
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = health_pb2_grpc.HealthStub(self.channel)
        self.pid = pid
        self.latencies: list[float] = []  # wall seconds per check
        self.held: list[float] = []  # the servicer's CPU seconds while each check was pending
        self.missed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _cpu_s(self) -> float:
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    def _run(self) -> None:
        while not self._stop.is_set():
            cpu0, started = self._cpu_s(), time.monotonic()
            try:
                self.stub.Check(health_pb2.HealthCheckRequest(service=VLLM_SERVICE), timeout=self.WALL_LIMIT_S)
            except grpc.RpcError:
                self.missed += 1
            latency = time.monotonic() - started
            self.latencies.append(latency)
            self.held.append(min(latency, self._cpu_s() - cpu0))
            time.sleep(0.02)

    def slowest(self, since: int = 0) -> dict:
        """The slowest check from the ``since``-th on: the servicer's CPU seconds and the wall seconds."""
        if len(self.held) <= since:
            return {"held_s": 0.0, "wall_s": 0.0}
        i = max(range(since, len(self.held)), key=self.held.__getitem__)
        return {"held_s": round(self.held[i], 2), "wall_s": round(self.latencies[i], 2)}

    def __enter__(self) -> "HealthProbe":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(self.WALL_LIMIT_S + 10)
        self.channel.close()


CHANNEL = [("grpc.max_send_message_length", 64 * MiB), ("grpc.max_receive_message_length", 256 * MiB)]


@pytest.fixture(scope="module")
def costly(tmp_path_factory, test_model_dir):
    """A servicer whose engine serves vocabulary-wide logprobs (``--max-logprobs -1``)."""
    with Servicer(tmp_path_factory.mktemp("adv-cost"), model_dir=test_model_dir,
                  engine_args=["--max-logprobs", "-1", "--step-us", "5000"],
                  env={"SMG_VLLM_SERVICER_WARMUP": "off"}) as running:
        running.attack = grpc.insecure_channel(f"127.0.0.1:{running.port}", options=CHANNEL)
        yield running
        running.attack.close()


def _attack(servicer, requests: list, timeout_s: float = 120) -> list:
    stub = vllm_engine_pb2_grpc.VllmEngineStub(servicer.attack)
    answers: list = []

    def one(request) -> None:
        try:
            answers.append(list(stub.Generate(request, timeout=timeout_s)))
        except grpc.RpcError as error:
            answers.append(error)

    threads = [threading.Thread(target=one, args=(r,)) for r in requests]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + 10)
    return answers


@pytest.mark.process
@pytest.mark.slow
def test_refused_attacks_leave_others_served_and_memory_where_it_was(costly):
    """The three amplified inputs over gRPC: each refused INVALID_ARGUMENT, health answered within
    3 s of the servicer's time throughout, and the servicer's memory back near where it started."""
    rss0 = rss_bytes(costly.process.pid)
    choices = _vllm()
    choices.sampling_params.choice.choices.extend([""] * 4_000_000)
    attacks = {
        "choice": choices,
        "stop_token_ids": _vllm(stop_token_ids=[300] * 4_000_000, n=64),
        "prompt": generate_request("long", [300] * 32_000_000, max_tokens=4),
    }
    slowest: dict[str, dict] = {}
    with HealthProbe(costly.port, costly.process.pid) as probe:
        for name, request in attacks.items():
            seen = len(probe.held)
            (answer,) = _attack(costly, [request])
            assert isinstance(answer, grpc.RpcError), name
            assert answer.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, answer.details())
            slowest[name] = probe.slowest(seen)
    print("slowest health check per attack:", slowest)
    assert probe.held and probe.missed == 0, f"{probe.missed} health checks failed: {slowest}"
    assert max(probe.held) < 3.0, f"the servicer held a health check over 3 s: {slowest}"
    grown = rss_bytes(costly.process.pid) - rss0
    assert grown < 400 * MiB, f"RSS grew {grown / MiB:.0f} MiB"  # was +1.5 GB for the prompt alone


@pytest.mark.process
@pytest.mark.slow
def test_vocabulary_wide_logprobs_do_not_hold_the_loop(costly):
    """One non-streaming n = 8 call with logprobs -1 and prompt logprobs -1 (each of its eight responses
    ~16 MiB, 2.5M logprob entries): served whole, while health keeps answering within 2 s of the servicer's time. Before, the
    eight responses were built at once when the call ended, and health waited seconds."""
    prompt = [5 + i % 4000 for i in range(300)]
    request = generate_request("all-lp", prompt, max_tokens=300, ignore_eos=True, n=8, logprobs=-1,
                               prompt_logprobs=-1)
    with HealthProbe(costly.port, costly.process.pid) as probe:
        (answer,) = _attack(costly, [request])
    assert not isinstance(answer, grpc.RpcError), answer
    completes = [m.complete for m in answer if m.WhichOneof("response") == "complete"]
    assert sorted(c.index for c in completes) == list(range(8))
    for c in completes:
        assert len(c.output_logprobs.top_logprobs) == 300 and len(c.output_logprobs.top_logprobs[0].values) == 4096
        assert len(c.input_logprobs.token_logprobs) == 300
    assert probe.held and probe.missed == 0, f"{probe.missed} health checks failed"
    assert max(probe.held) < 2.0, f"the servicer held a health check over 2 s: {probe.slowest()}"


# -- what a refused call held ------------------------------------------------------------------


def test_a_refused_calls_memory_is_freed_at_once_not_at_the_next_collection():
    """A handler's refusal left a reference cycle (the status error's traceback held the frame that
    named it), so everything the call held, its decoded request among it, waited for the cyclic
    collector; with the servicer's young threshold (gc_policy.py) a quiet servicer kept ~250 MB per
    refused 64 MiB request. Reference counting alone must free it."""
    import asyncio
    import gc
    import weakref

    from grpclib.exceptions import GRPCError

    from enginelink.runtime.errors import grpc_errors

    class Held:  # what the handler's frames hold: the request, in the servicer
        pass

    refs = []

    class Service:
        @grpc_errors
        async def Generate(self, stream) -> None:
            held = Held()
            refs.append(weakref.ref(held))
            raise ClientError("tokenized.input_ids", "prompt has 32000000 tokens")

    async def call() -> None:
        try:
            await Service().Generate(None)
        except GRPCError as error:
            assert error.status.name == "INVALID_ARGUMENT"

    gc.disable()
    try:
        asyncio.run(call())
        assert refs and refs[0]() is None, "the refused call's frame is still alive: a reference cycle holds it"
    finally:
        gc.enable()


def test_every_input_knob_is_in_the_limits_table_with_its_default():
    """docs/limits.md's "Request input" table mirrors ``InputLimits``: each knob, with its default."""
    from dataclasses import fields
    from pathlib import Path

    from enginelink.runtime.requests.inputs import INPUT_LIMIT_ENV

    text = (Path(__file__).parents[2] / "docs" / "limits.md").read_text()
    section = text.split("## Request input", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[2].startswith("`ENGINELINK_MAX_"):
            rows[cells[2].strip("`")] = cells[3]
    defaults = {INPUT_LIMIT_ENV[spec.name]: str(spec.default) for spec in fields(InputLimits)}
    assert rows == defaults


async def test_a_sliced_response_keeps_nothing_once_serialized():
    """The writer's slices run through trio-asyncio's bridge, whose futures sit in reference cycles the
    collector breaks only much later (the servicer's young threshold): what went through it was kept,
    ~90 MB per vocabulary-wide n = 4 call, growing with every call. Once serialized, the response's
    bytes belong to the writer alone, and what they were made of to nobody."""
    import gc
    import sys

    import trio_asyncio

    from enginelink.runtime.requests.generate import serialize_in_slices
    from enginelink.runtime.requests.logprob_bytes import LogprobBudget

    m = _complete_with_logprobs(50, 4096)
    sliced = contract_vllm.encode_complete(m, LogprobBudget(0))
    runs = m.logprobs
    del m
    gc.disable()
    try:
        async with trio_asyncio.open_loop():
            body = await trio_asyncio.aio_as_trio(serialize_in_slices)(sliced)
        assert sys.getrefcount(body) == 2, "something besides the writer holds the response's bytes"
        assert sliced.body is None and sliced.output is None and sliced.prompt is None
        assert sys.getrefcount(runs) == 2, "something still holds the logprobs the response was made of"
    finally:
        gc.enable()
    assert pb.GenerateResponse.FromString(body).complete.output_logprobs.top_logprobs[0].values
