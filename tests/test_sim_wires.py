"""The sim engine's TokenSpeed and SGLang personalities, as processes, driven from the servicer side.

Each test starts ``python -m enginelink.tools.sim_engine --wire ...`` and
talks to it with the servicer-side codecs (``TokenSpeedCodec``,
``SglangCodec``) and, for TokenSpeed, the servicer's own handshake machine.
Token expectations come from the vLLM personality's core, fed the same
request in process: the core is shared, so the wires must agree with it.
Waits are bounded polls; every engine is stopped by its test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import zmq

from enginelink.machines.handshake import EngineHandshake, HandshakeDone, SendInit
from enginelink.machines.sim_core import SimConfig, SimEngineCore, sim_embedding
from enginelink.wire import codecs, kv_events, sglang, tokenspeed, vllm
from enginelink.wire.engine import FinishReason, GenerateSpec, OutputBatch, PoolingSpec, SamplingSpec
from tests.test_sim_engine_process import WAIT_MS, recv, stop

EOS = 2
VOCAB, MAX_LEN = 512, 128
PROMPT = list(range(3, 40))


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB, "max_position_embeddings": MAX_LEN,
                                                      "eos_token_id": EOS, "hidden_size": 24}))
    return tmp_path


def vllm_tokens(spec: GenerateSpec) -> tuple[list[int], int | None]:
    """What the vLLM personality's core generates for ``spec`` (the reference every wire must match)."""
    core = SimEngineCore(SimConfig(vocab_size=VOCAB, max_model_len=MAX_LEN, eos_token_id=EOS))
    codec = vllm.VllmCodec()
    core.handle_input(*codec.encode_add(spec), 0.0)
    tokens, finish = [], None
    while core.has_work:
        messages, _ = core.step(0.0)
        for message in messages:
            for out in codec.decode_output(message).outputs:
                tokens += out.new_token_ids
                finish = out.finish_reason
    return tokens, finish


def spec(rid: str, max_tokens: int = 8, prompt: list[int] = PROMPT, **sampling) -> GenerateSpec:
    return GenerateSpec(request_id=rid, prompt_token_ids=prompt,
                        sampling=SamplingSpec(max_tokens=max_tokens, eos_token_ids=(EOS,), **sampling))


def engine_argv(model_dir: Path, wire: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "enginelink.tools.sim_engine", "--wire", wire, "--model", str(model_dir), *extra]


def collect(next_batch, rid: str) -> tuple[list[int], list]:
    """Every output of ``rid`` until it finishes: (tokens, the outputs)."""
    tokens, outs = [], []
    while not outs or outs[-1].finish_reason is None:
        for out in next_batch().outputs:
            if out.request_id == rid:
                tokens += out.new_token_ids
                outs.append(out)
    return tokens, outs


def subscribe(ctx: zmq.Context, endpoint: str) -> tuple[zmq.Socket, zmq.Socket]:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sub.connect(endpoint)
    recv(monitor)  # connected; the subscription follows behind a few round trips (no engine step)
    return sub, monitor


# --------------------------------------------------------------------------
# TokenSpeed: the handshake machine on the servicer side, BatchTokenIDOutSlim back
# --------------------------------------------------------------------------


class TokenSpeedFront:
    """The servicer's sockets (all bound) and its handshake machine with TokenSpeed's wire."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.codec = codecs.get("tokenspeed")
        self.handshake, self.handshake_address = self._bind(zmq.ROUTER)
        self.inputs, self.inputs_address = self._bind(zmq.ROUTER)
        self.outputs, self.outputs_address = self._bind(zmq.PULL)
        self.identity = b""

    def _bind(self, kind: int) -> tuple[zmq.Socket, str]:
        socket = self.ctx.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        return socket, f"tcp://127.0.0.1:{socket.bind_to_random_port('tcp://127.0.0.1')}"

    def run_handshake(self, ranks: tuple[int, ...] = (0,)) -> HandshakeDone:
        machine = EngineHandshake(codecs.handshake("tokenspeed"), ranks, [self.inputs_address], [self.outputs_address],
                                  expected_version=tokenspeed.ready_version())
        poller = zmq.Poller()
        poller.register(self.handshake, zmq.POLLIN)
        poller.register(self.inputs, zmq.POLLIN)
        while machine.done is None:
            events = dict(poller.poll(WAIT_MS))
            assert events, "handshake stalled"
            actions = []
            if self.handshake in events:
                identity, payload = self.handshake.recv_multipart()
                actions += machine.on_status(identity, payload)
            if self.inputs in events:
                identity, payload = self.inputs.recv_multipart()
                actions += machine.on_ready_response(identity, payload)
            for action in actions:
                if isinstance(action, SendInit):
                    self.handshake.send_multipart([action.identity, action.payload])
        self.identity = machine.identity(0)
        return machine.done

    def send(self, frames: list[bytes]) -> None:
        self.inputs.send_multipart([self.identity, *frames])

    def next_batch(self) -> OutputBatch:
        return self.codec.decode_output(recv(self.outputs))

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@pytest.fixture
def ts_engine(model_dir: Path, tmp_path: Path):
    front = TokenSpeedFront()
    kv = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{tmp_path}/ts-kv", "topic": ""}
    proc = subprocess.Popen(engine_argv(model_dir, "tokenspeed", "--handshake", front.handshake_address,
                                        "--step-us", "2000", "--kv-events-config", json.dumps(kv)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        yield front, proc
    finally:
        status = stop(proc)
        front.close()
    assert status == 0, proc.stderr.read().decode()


@pytest.mark.process
def test_tokenspeed_handshake_runs_on_the_servicers_machine(ts_engine):
    front, _ = ts_engine
    done = front.run_handshake()
    assert done.incompatible is None
    facts = done.ready[0]
    assert facts["vllm_version"] == "tokenspeed-0.1.1"
    assert (facts["max_model_len"], facts["block_size"], facts["prefix_granularity"]) == (MAX_LEN, 16, 16)
    assert facts["kv_events_config"]["endpoint"].startswith("ipc://")


@pytest.mark.process
def test_tokenspeed_dp_ranks_each_run_their_handshake(model_dir):
    front = TokenSpeedFront()
    proc = subprocess.Popen(engine_argv(model_dir, "tokenspeed", "--handshake", front.handshake_address, "-dp", "2"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        done = front.run_handshake((0, 1))
        assert done.incompatible is None
        assert [done.ready[r]["data_parallel_rank"] for r in done.ranks] == [0, 1]
    finally:
        status = stop(proc)
        front.close()
    assert status == 0, proc.stderr.read().decode()


@pytest.mark.process
@pytest.mark.parametrize("argv, says", [
    (("--wire", "sglang"), "--wire sglang needs --scheduler-input-ipc and --tokenizer-ipc"),
    (("--wire", "sglang", "--scheduler-input-ipc", "ipc:///x", "--tokenizer-ipc", "ipc:///y",
      "--disaggregation-mode", "both"), "--disaggregation-mode: invalid choice: 'both'"),
    (("--wire", "tokenspeed"), "--wire tokenspeed needs --handshake"),
])
def test_a_wire_without_its_addresses_is_refused(model_dir, argv, says):
    done = subprocess.run([sys.executable, "-m", "enginelink.tools.sim_engine", "--model", str(model_dir), *argv],
                          capture_output=True, text=True, timeout=WAIT_MS / 1000)
    assert done.returncode == 2 and says in done.stderr


@pytest.mark.process
def test_tokenspeed_generates_the_vllm_personalitys_tokens_with_stop_ids_length_and_loads(ts_engine):
    front, _ = ts_engine
    front.run_handshake()
    greedy = spec("g", max_tokens=8, temperature=0.0, ignore_eos=True)
    expected, _ = vllm_tokens(greedy)
    front.send(front.codec.encode_add(greedy))
    tokens, outs = collect(front.next_batch, "g")
    assert tokens == expected and len(tokens) == 8
    assert outs[-1].finish_reason == FinishReason.LENGTH
    assert (outs[-1].prompt_tokens, outs[-1].completion_tokens) == (len(PROMPT), 8)  # running totals

    # A stop id: generation ends on it, and TokenSpeed's wire keeps it (the front end's codec trims it
    # and names it as the matched stop).
    stop_id = expected[3]
    stopped = spec("s", max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_id,))
    front.send(front.codec.encode_add(stopped))
    frames_seen = []

    def next_batch_keeping_frames():
        batch = front.next_batch()
        frames_seen.append(batch.frames)
        return batch

    tokens, outs = collect(next_batch_keeping_frames, "s")
    assert tokens == expected[: expected.index(stop_id)]
    assert outs[-1].finish_reason == FinishReason.STOP and outs[-1].stop_reason == stop_id
    on_wire = tokenspeed.decode_batch(frames_seen[-1])  # the engine's own step, before the codec trims
    (last_on_wire,) = [ids for rid, ids in zip(on_wire.rids, on_wire.output_ids) if rid == "s"]
    assert last_on_wire[-1] == stop_id
    # The second request found the first's prompt blocks cached.
    assert outs[0].cached_tokens == 32

    # Seeded sampling is the vLLM personality's too.
    seeded = spec("seeded", max_tokens=5, temperature=0.8, seed=7, ignore_eos=True)
    front.send(front.codec.encode_add(seeded))
    assert collect(front.next_batch, "seeded")[0] == vllm_tokens(seeded)[0]

    # The load tail: a running request shows in num_running and its KV pages.
    front.send(front.codec.encode_add(spec("load", max_tokens=4, ignore_eos=True)))
    batch = front.next_batch()
    assert batch.stats.num_running_reqs == 1 and 0 < batch.stats.kv_cache_usage < 1


@pytest.mark.process
def test_tokenspeed_abort_mid_generation_and_n_refused_on_the_wire(ts_engine):
    front, _ = ts_engine
    front.run_handshake()
    front.send(front.codec.encode_add(spec("long", max_tokens=100, ignore_eos=True)))
    first = front.next_batch()
    assert first.outputs[0].request_id == "long" and first.outputs[0].finish_reason is None
    front.send(front.codec.encode_abort(["long"]))
    tokens, outs = collect(front.next_batch, "long")
    generated = len(first.outputs[0].new_token_ids) + len(tokens)
    assert outs[-1].finish_reason == FinishReason.ABORT and generated < 100
    assert (outs[-1].prompt_tokens, outs[-1].completion_tokens) == (len(PROMPT), generated)  # the totals so far

    # n != 1 on the wire is answered with an abort at once (the front end fans n out as child ids).
    request = tokenspeed.request_for(spec("n2"))
    request = msgspec.structs.replace(request, sampling_params=msgspec.structs.replace(request.sampling_params, n=2))
    front.send([tokenspeed.REQ_ADD, msgspec.msgpack.encode(request)])
    tokens, outs = collect(front.next_batch, "n2")
    assert tokens == [] and outs[-1].finish_reason == FinishReason.ABORT

    # A prompt longer than the context is refused with an abort, not dropped.
    front.send(front.codec.encode_add(spec("huge", prompt=[7] * MAX_LEN)))
    assert collect(front.next_batch, "huge")[1][-1].finish_reason == FinishReason.ABORT


@pytest.mark.process
def test_tokenspeed_publishes_kv_events(ts_engine):
    front, _ = ts_engine
    done = front.run_handshake()
    sub, _ = subscribe(front.ctx, done.ready[0]["kv_events_config"]["endpoint"])
    for i in range(20):  # let the subscription reach the engine: requests that fill no block
        front.send(front.codec.encode_add(spec(f"w{i}", max_tokens=1, prompt=[4, 5])))
        collect(front.next_batch, f"w{i}")
    front.send(front.codec.encode_add(spec("kv", max_tokens=1, prompt=[9] * 33, ignore_eos=True)))
    collect(front.next_batch, "kv")
    _, _, payload = kv_events.parse_pub_message(recv(sub))
    stored = kv_events.decode_batch(payload).events[0]
    assert isinstance(stored, kv_events.WireStored) and stored.token_ids == tuple([9] * 32)


# --------------------------------------------------------------------------
# SGLang: the front end binds, the scheduler connects and reports ready on a pipe
# --------------------------------------------------------------------------


class SglangFront:
    """The TokenizerManager's sockets: PUSH to the scheduler's input, PULL for its outputs (both bound)."""

    def __init__(self, tmp_path: Path) -> None:
        self.ctx = zmq.Context()
        self.codec = sglang.SglangCodec()
        self.input_address = f"ipc://{tmp_path}/scheduler_input"
        self.tokenizer_address = f"ipc://{tmp_path}/tokenizer"
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.bind(self.input_address)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.bind(self.tokenizer_address)

    def send(self, frames: list[bytes]) -> None:
        self.push.send_multipart(frames)

    def next_batch(self) -> OutputBatch:
        return self.codec.decode_output(recv(self.pull))

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def start_sglang(model_dir: Path, tmp_path: Path, *extra: str):
    front = SglangFront(tmp_path)
    read_fd, write_fd = os.pipe()
    argv = engine_argv(model_dir, "sglang", "--scheduler-input-ipc", front.input_address,
                       "--tokenizer-ipc", front.tokenizer_address, "--ready-fd", str(write_fd), *extra)
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, pass_fds=(write_fd,))
    os.close(write_fd)
    with os.fdopen(read_fd) as pipe:
        report = json.loads(pipe.readline() or "null")  # EOF (the engine died) reads as None
    return front, proc, report


@pytest.fixture
def sgl_engine(model_dir: Path, tmp_path: Path):
    kv = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{tmp_path}/sgl-kv", "topic": ""}
    front, proc, report = start_sglang(model_dir, tmp_path, "--step-us", "2000", "--kv-events-config", json.dumps(kv))
    try:
        yield front, proc, report
    finally:
        status = stop(proc)
        front.close()
    assert status == 0, proc.stderr.read().decode()


@pytest.mark.process
def test_sglang_reports_ready_on_its_pipe_and_generates_the_vllm_personalitys_tokens(sgl_engine):
    front, _, report = sgl_engine
    assert report["status"] == "ready"
    assert report["max_total_num_tokens"] == 8192 * 16 and report["max_req_input_len"] == MAX_LEN - 1

    # Greedy goes out normalised (temperature 1.0, top_k 1) and comes back as greedy.
    greedy = spec("g", max_tokens=6, temperature=0.0, ignore_eos=True)
    expected, _ = vllm_tokens(greedy)
    front.send(front.codec.encode_add(greedy))
    tokens, outs = collect(front.next_batch, "g")
    assert tokens == expected and outs[-1].finish_reason == FinishReason.LENGTH
    assert (outs[-1].prompt_tokens, outs[-1].completion_tokens) == (len(PROMPT), 6)

    # A stop id: SGLang names the matched id.
    stop_id = expected[2]
    front.send(front.codec.encode_add(spec("s", max_tokens=6, temperature=0.0, ignore_eos=True,
                                           stop_token_ids=(stop_id,))))
    tokens, outs = collect(front.next_batch, "s")
    assert tokens == expected[: expected.index(stop_id) + 1]
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == (FinishReason.STOP, stop_id)


@pytest.mark.process
def test_sglang_n2_is_a_prefix_request_then_n_samples(sgl_engine):
    front, _, _ = sgl_engine
    # SGLang's n > 1: "<id>-prefix" with max_new_tokens 0 (prefill only), then one request per choice.
    front.send(front.codec.encode_add(spec("c-prefix", max_tokens=0, temperature=1.0)))
    tokens, outs = collect(front.next_batch, "c-prefix")
    assert tokens == [] and outs[-1].finish_reason == FinishReason.LENGTH and outs[-1].completion_tokens == 0
    choices = []
    for i in range(2):
        child = spec(f"c-{i}", max_tokens=5, temperature=1.0, ignore_eos=True)
        front.send(front.codec.encode_add(child))
        tokens, outs = collect(front.next_batch, f"c-{i}")
        assert tokens == vllm_tokens(child)[0]
        assert outs[0].cached_tokens == 32  # the prefix request's blocks
        choices.append(tokens)
    assert choices[0] != choices[1]  # unseeded sampling: each choice its own


@pytest.mark.process
def test_sglang_abort_mid_generation_flush_and_profile(sgl_engine):
    front, _, _ = sgl_engine
    front.send(front.codec.encode_add(spec("long", max_tokens=100, ignore_eos=True)))
    front.send(front.codec.encode_utility(1, "flush_cache", ()))
    replies = {}
    while 1 not in replies:  # the flush is answered at once: requests are pending, so it fails
        batch = front.next_batch()
        if batch.utility is not None:
            replies[batch.utility.call_id] = batch.utility
    assert replies[1].failure.startswith("Cache not flushed because there are pending requests")
    front.send(front.codec.encode_aborts(["long"])[0])
    tokens, outs = collect(front.next_batch, "long")
    assert outs[-1].finish_reason == FinishReason.ABORT and len(tokens) < 100
    assert sglang.abort_outcome(outs[-1].abort).code is None  # a plain cancel, no status

    front.send(front.codec.encode_utility(2, "flush_cache", ()))
    assert front.next_batch().utility == front.codec.decode_output(
        sglang.encode_outputs(sglang.s.FlushCacheReqOutput(rid="enginelink-control-2",
                                                           http_worker_ipc="enginelink-control-2",
                                                           success=True))).utility
    results = []
    for call_id, method in ((3, "start_profile"), (4, "stop_profile"), (5, "stop_profile")):
        front.send(front.codec.encode_utility(call_id, method, ()))
        reply = front.next_batch().utility
        assert reply.call_id == call_id
        results.append(reply.failure)
    assert results == [None, None, "Profiling is not in progress. Call /start_profile first."]


@pytest.mark.process
def test_sglang_publishes_kv_events_and_refuses_a_too_long_prompt(sgl_engine):
    front, _, _ = sgl_engine
    endpoint = f"ipc://{Path(front.input_address[len('ipc://'):]).parent}/sgl-kv"
    sub, _ = subscribe(front.ctx, endpoint)
    for i in range(20):  # round trips that take no engine step, so the subscription arrives first
        front.send(front.codec.encode_utility(10 + i, "start_profile" if i % 2 == 0 else "stop_profile", ()))
        assert front.next_batch().utility.failure is None
    front.send(front.codec.encode_add(spec("kv", max_tokens=1, prompt=[9] * 33, ignore_eos=True)))
    collect(front.next_batch, "kv")
    _, _, payload = kv_events.parse_pub_message(recv(sub))
    first, second = kv_events.decode_batch(payload).events
    # As SGLang's publisher: one BlockStored per page, each under the one before (wire/kv_engines.py).
    assert isinstance(first, kv_events.WireStored) and first.token_ids == tuple([9] * 16)
    assert second.token_ids == tuple([9] * 16) and second.parent_block_hash == first.block_hashes[0]

    front.send(front.codec.encode_add(spec("huge", prompt=[7] * MAX_LEN)))
    _, outs = collect(front.next_batch, "huge")
    outcome = sglang.abort_outcome(outs[-1].abort)
    assert outcome.code == "INVALID_ARGUMENT" and "exceeds the maximum allowed length" in outcome.message


@pytest.mark.process
def test_sglang_embedding_engine_answers_batch_embedding_output(model_dir, tmp_path):
    front, proc, report = start_sglang(model_dir, tmp_path, "--runner", "pooling")
    try:
        assert report["status"] == "ready"
        prompt = [5, 6, 7, 8, 9]
        front.send(front.codec.encode_add(GenerateSpec(request_id="e", prompt_token_ids=prompt,
                                                       sampling=SamplingSpec(max_tokens=1), pooling=PoolingSpec())))
        out = front.next_batch().outputs[0]
        assert (out.request_id, out.finish_reason, out.prompt_tokens) == ("e", FinishReason.STOP, len(prompt))
        assert out.pooling_output == pytest.approx(sim_embedding(prompt, 24), abs=1e-6)
        # A generate request to an embedding engine is refused with a status, not dropped.
        front.send(front.codec.encode_add(spec("g")))
        outcome = sglang.abort_outcome(front.next_batch().outputs[0].abort)
        assert outcome.code == "INVALID_ARGUMENT"
    finally:
        status = stop(proc)
        front.close()
    assert status == 0, proc.stderr.read().decode()


def test_tokenspeed_handshake_wire_refuses_other_engines_and_other_releases():
    from enginelink.tools.sim_wire_shell import ready_response

    wire = codecs.handshake("tokenspeed")
    config = SimConfig(vocab_size=VOCAB, max_model_len=MAX_LEN)

    def run(version: str, expected: str | None) -> HandshakeDone:
        machine = EngineHandshake(wire, [0], ["tcp://in"], ["tcp://out"], expected_version=expected)
        actions = machine.on_status(b"\x00\x00", tokenspeed.encode_handshake_status("HELLO"))
        assert any(isinstance(a, SendInit) for a in actions)
        # TokenSpeed's order: READY first, then the ready response.
        actions = machine.on_status(b"\x00\x00", tokenspeed.encode_handshake_status("READY"))
        assert machine.done is None and [a.step for a in actions] == ["READY"]
        ready = msgspec.structs.replace(ready_response(config), vllm_version=version)
        *_, done = machine.on_ready_response(b"\x00\x00", tokenspeed.encode_ready_response(ready))
        return done

    assert run("tokenspeed-0.1.1", tokenspeed.ready_version()).incompatible is None
    assert "the launch check verified TokenSpeed tokenspeed-0.1.1" in run("tokenspeed-0.1.0",
                                                                          tokenspeed.ready_version()).incompatible
    assert "it is sglang, not TokenSpeed" in run("sglang-0.5.23", None).incompatible
    assert "it is vLLM, not TokenSpeed" in run("0.32.0", None).incompatible


# --------------------------------------------------------------------------
# The personalities' frames, read by the real packages' own decoders (skipped without their venvs)
# --------------------------------------------------------------------------


def _run_sans_io(personality, inputs: list[list[bytes]]) -> list[list[bytes]]:
    sent = [m for frames in inputs for m in personality.handle(frames, 0.0)]
    while personality.has_work:
        sent += personality.step(0.0)[0]
    return sent


def _peer_cases(frames_list: list[list[bytes]], decode, name_of) -> list[dict]:
    from tests.wire.engine_venvs import fields_of

    cases = []
    for i, frames in enumerate(frames_list):
        ours = decode(frames)
        cases.append({"id": f"decode:{i}", "op": "decode", "name": name_of(ours), "fields": fields_of(ours),
                      "frames": frames})
    return cases


@pytest.mark.process
@pytest.mark.parametrize("wire", ["sglang", "tokenspeed"])
def test_the_personalitys_frames_decode_with_the_real_package_into_equal_structs(wire, tmp_path):
    from enginelink.machines.sim_wires import SglangPersonality, TokenSpeedPersonality
    from tests.wire.engine_venvs import run_peer, side_python_or_skip

    python = side_python_or_skip(wire)
    config = SimConfig(vocab_size=VOCAB, max_model_len=MAX_LEN, eos_token_id=EOS)
    if wire == "sglang":
        codec, s = sglang.SglangCodec(), sglang.s
        inputs = [codec.encode_add(spec("a", max_tokens=3, logprobs=2)), codec.encode_add(spec("b", stop_token_ids=(7,))),
                  codec.encode_aborts(["b"])[0], codec.encode_utility(1, "flush_cache", ()),
                  codec.encode_utility(2, "start_profile", ())]
        frames = _run_sans_io(SglangPersonality(SimEngineCore(config)), inputs)
        frames += _run_sans_io(SglangPersonality(SimEngineCore(msgspec.structs.replace(config, runner="pooling"))),
                               [codec.encode_add(GenerateSpec(request_id="e", prompt_token_ids=[4, 5, 6],
                                                              sampling=SamplingSpec(max_tokens=1),
                                                              pooling=PoolingSpec()))])
        cases = _peer_cases(frames, lambda f: sglang.decode_message(f), lambda m: s.STRUCTS_BY_TYPE[type(m)])
        kinds = {c["name"] for c in cases}
        assert {"BatchTokenIDOutput", "BatchEmbeddingOutput", "FlushCacheReqOutput", "ProfileReqOutput"} <= kinds
    else:
        codec = tokenspeed.TokenSpeedCodec()
        inputs = [codec.encode_add(spec("a", max_tokens=3, logprobs=0)), codec.encode_add(spec("b")),
                  codec.encode_abort(["b"])]
        frames = _run_sans_io(TokenSpeedPersonality(SimEngineCore(config)), inputs)
        cases = _peer_cases(frames, tokenspeed.decode_batch, lambda m: "BatchTokenIDOutSlim")
    results = run_peer(wire, python, cases, tmp_path)
    for case in cases:
        result = results[case["id"]]
        assert "error" not in result and result["equal"], (case["name"], result)
