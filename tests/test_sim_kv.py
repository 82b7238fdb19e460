"""The sim engine's KV-event publisher: prefix-hash semantics, one batch per step,
replay, fault switches — sans-io, and as a process on real sockets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from enginelink.machines.sim_core import SimConfig, SimEngineCore, block_hash
from enginelink.tools.sim_kv import KvEventHooks, SimKvFaults, SimKvPublisher
from enginelink.wire import kv_events as kv
from enginelink.wire import vllm
from enginelink.wire.engine import GenerateSpec, SamplingSpec

CODEC = vllm.VllmCodec()
BS = 4


def engine(num_gpu_blocks: int = 64, faults: SimKvFaults | None = None, **config) -> tuple[SimEngineCore, KvEventHooks]:
    cfg = kv.KvEventsConfig(enable_kv_cache_events=True, topic="kv", buffer_steps=config.pop("buffer_steps", 100))
    hooks = KvEventHooks(SimKvPublisher(cfg, 0, faults), BS)
    core = SimEngineCore(SimConfig(vocab_size=100, max_model_len=128, block_size=BS, num_gpu_blocks=num_gpu_blocks),
                         hooks)  # fmt: skip
    return core, hooks


def add(core: SimEngineCore, rid: str, prompt: list[int], max_tokens: int = 1, salt: str | None = None) -> None:
    spec = GenerateSpec(request_id=rid, prompt_token_ids=prompt, sampling=SamplingSpec(max_tokens=max_tokens),
                        cache_salt=salt)  # fmt: skip
    core.handle_input(*CODEC.encode_add(spec), 0.0)


def run(core: SimEngineCore, hooks: KvEventHooks) -> list[tuple[int, list]]:
    """Step until idle: the (seq, events) of every PUB message, decoded as a relay would."""
    t = 0.0
    while core.has_work:
        t += 1.0
        core.step(t)
    out = []
    for message in hooks.take_messages():
        topic, seq, payload = kv.parse_pub_message(message)
        assert topic == b"kv"
        out.append((seq, list(kv.decode_batch(payload).events)))
    return out


def test_full_blocks_are_stored_with_their_parent_and_tokens():
    core, hooks = engine()
    prompt = list(range(10, 20))  # 2 full blocks + 2 tokens
    add(core, "a", prompt, max_tokens=3)
    batches = run(core, hooks)
    stored = [e for _, events in batches for e in events]
    h0 = block_hash(None, prompt[:4])
    h1 = block_hash(h0, prompt[4:8])
    assert [e.block_hashes for e in stored[:1]] == [(kv.fold_hash(h0), kv.fold_hash(h1))]
    assert stored[0].parent_block_hash is None and stored[0].token_ids == tuple(prompt[:8])
    assert (stored[0].block_size, stored[0].medium, stored[0].group_idx, stored[0].kv_cache_spec_kind) == (
        4, "GPU", 0, "full_attention")  # fmt: skip
    # the third block fills with generated tokens: its parent is block 1
    assert stored[1].parent_block_hash == kv.fold_hash(h1) and len(stored[1].token_ids) == 4
    assert [seq for seq, _ in batches] == list(range(len(batches)))


def test_a_cached_prefix_is_not_stored_again_and_a_run_split_by_one_is_two_events():
    core, hooks = engine(num_gpu_blocks=64)
    prompt = list(range(10, 26))  # 4 blocks
    add(core, "a", prompt)
    run(core, hooks)
    add(core, "b", prompt + [1, 2, 3, 4])
    (batch,) = run(core, hooks)
    (event,) = batch[1]
    assert event.parent_block_hash == kv.fold_hash(core_hashes(prompt)[3]) and len(event.block_hashes) == 1
    # Evict block 0 only, then recompute: blocks 0 and 2.. are new, 1 is cached -> two events.
    core._cache.pop(core_hashes(prompt)[0])
    core._cache.pop(core_hashes(prompt)[2])
    add(core, "c", prompt)
    (batch,) = run(core, hooks)
    first, second = batch[1]
    hashes = [kv.fold_hash(h) for h in core_hashes(prompt)]
    assert (first.parent_block_hash, first.block_hashes, len(first.token_ids)) == (None, (hashes[0],), 4)
    assert (second.parent_block_hash, second.block_hashes, len(second.token_ids)) == (hashes[1], (hashes[2],), 4)


def core_hashes(prompt: list[int]) -> list[int]:
    hashes, parent = [], None
    for i in range(len(prompt) // BS):
        parent = block_hash(parent, prompt[i * BS : (i + 1) * BS])
        hashes.append(parent)
    return hashes


def test_the_cache_salt_enters_the_first_blocks_extra_keys():
    core, hooks = engine()
    add(core, "a", list(range(10, 19)), salt="tenant")
    ((_, (event,)),) = run(core, hooks)
    assert event.extra_keys == (("tenant",), None) and event.cache_salt == "tenant"


def test_eviction_is_a_removal_and_a_reset_is_a_clear_published_on_the_next_step():
    core, hooks = engine(num_gpu_blocks=3)
    add(core, "a", list(range(10, 18)))
    ((_, (first,)),) = run(core, hooks)
    add(core, "b", list(range(30, 38)))  # 2 more blocks into a 3-block cache: a's oldest goes
    ((_, events),) = run(core, hooks)
    assert [type(e).__name__ for e in events] == ["WireStored", "WireRemoved"]
    assert events[1].block_hashes == first.block_hashes[:1]
    core.handle_input(*CODEC.encode_utility(1, "reset_prefix_cache", ()), 0.0)
    assert run(core, hooks) == []  # idle: vLLM publishes only when it steps
    add(core, "b", [50, 51])
    ((seq, events),) = run(core, hooks)
    assert seq == 2 and events == [kv.WireCleared()]


def test_replay_answers_from_the_buffer_then_the_end_marker():
    core, hooks = engine(buffer_steps=2)
    for i in range(3):
        add(core, f"r{i}", [60 + i] * 4)
        run(core, hooks)
    replies = hooks.publisher.replay(0)
    assert [kv.parse_replay_reply(r) for r in replies][-1] == kv.ReplayEnd()
    assert [kv.parse_replay_reply(r)[0] for r in replies[:-1]] == [1, 2]  # the buffer keeps 2
    assert replies[0][1] == b"kv"  # vLLM's form carries the topic
    hooks.publisher.faults = SimKvFaults(replay_topic=False)
    assert len(hooks.publisher.replay(2)[0]) == 3  # SGLang's does not


def test_fault_switches_skip_drop_and_restart():
    core, hooks = engine(faults=SimKvFaults(skip_seqs=frozenset({1}), drop_seqs=frozenset({2})))
    for i in range(4):
        add(core, f"r{i}", [70 + i] * 4)
        run_all = run(core, hooks)
        assert [seq for seq, _ in run_all] == ([] if i in (1, 2) else [i])
    assert [kv.parse_replay_reply(r)[0] for r in hooks.publisher.replay(0)[:-1]] == [0, 2, 3]
    assert core.num_cached_blocks == 4
    # restart through the utility call, as a process test would
    (reply,) = core.handle_input(*CODEC.encode_utility(9, "enginelink_sim_kv_fault", ("restart",)), 0.0)
    assert CODEC.decode_output(reply).utility.failure is None
    assert core.num_cached_blocks == 0 and hooks.publisher.replay(0) == [kv.replay_end()]
    add(core, "after", [80] * 4)
    ((seq, events),) = run(core, hooks)
    assert seq == 0 and events[0] == kv.WireCleared() and type(events[1]).__name__ == "WireStored"
    (reply,) = core.handle_input(*CODEC.encode_utility(9, "enginelink_sim_kv_fault", ("melt", 1)), 0.0)
    assert "unknown KV fault" in CODEC.decode_output(reply).utility.failure


def test_kv_faults_without_a_publisher_are_refused():
    core = SimEngineCore(SimConfig(vocab_size=100, max_model_len=64))
    (reply,) = core.handle_input(*CODEC.encode_utility(9, "enginelink_sim_kv_fault", ("skip", 1)), 0.0)
    assert "KV events are off" in CODEC.decode_output(reply).utility.failure


def test_a_planned_restart_happens_once_after_n_batches():
    core, hooks = engine(faults=SimKvFaults(restart_after_batches=2))
    seqs = []
    for i in range(4):
        add(core, f"r{i}", [90 + i] * 4)
        seqs += [seq for seq, _ in run(core, hooks)]
    assert seqs == [0, 1, 0, 1] and hooks.publisher.restarts == 1


# ---- the process, on real sockets ------------------------------------------------------


@pytest.mark.process
def test_the_sim_engine_process_publishes_and_replays(tmp_path: Path):
    from tests.test_sim_engine_process import FrontEnd, recv, stop

    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 512, "max_position_embeddings": 128}))
    ipc = f"ipc://{tmp_path}/kv-pub"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": ipc,
              "replay_endpoint": "tcp://127.0.0.1:0", "topic": "kv"}  # fmt: skip
    front = FrontEnd()
    argv = [sys.executable, "-m", "enginelink.tools.sim_engine", "--handshake", front.handshake_address,
            "--model", str(tmp_path), "--kv-events-config", json.dumps(config), "--kv-fault-drop", "1"]  # fmt: skip
    engine_proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        identity, ready = front.handshake_engine()
        resolved = ready.kv_events_config
        assert resolved["endpoint"] == ipc and resolved["replay_endpoint"].startswith("tcp://127.0.0.1:")
        assert not resolved["replay_endpoint"].endswith(":0")
        sub = front.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sub.connect(resolved["endpoint"])
        # A PUB drops what nobody subscribed to yet: wait until the SUB is connected, then let
        # its subscription reach the engine behind a few utility round trips (no engine step).
        recv(monitor)
        for i in range(20):
            front.send(identity, CODEC.encode_utility(i, "is_sleeping", ()))
            front.next_batch()
        for i, prompt in enumerate(([5] * 16, [6] * 16, [7] * 16)):
            spec = GenerateSpec(request_id=f"r{i}", prompt_token_ids=prompt, sampling=SamplingSpec(max_tokens=1))
            front.send(identity, CODEC.encode_add(spec))
            while not front.next_batch().finished_requests:
                pass
        got = [kv.parse_pub_message(recv(sub)) for _ in range(2)]
        assert [seq for _, seq, _ in got] == [0, 2]  # 1 was dropped on the wire
        stored = kv.decode_batch(got[0][2]).events[0]
        assert stored.token_ids == tuple([5] * 16) and stored.parent_block_hash is None
        dealer = front.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(resolved["replay_endpoint"])
        dealer.send_multipart(kv.replay_request(1))
        replies = []
        while not replies or replies[-1] != kv.ReplayEnd():
            replies.append(kv.parse_replay_reply(recv(dealer)))
        assert [r[0] for r in replies[:-1]] == [1, 2]
        assert kv.decode_batch(replies[0][1]).events[0].token_ids == tuple([6] * 16)
        # restart the publisher at run time: the next batch is 0 again, opening with a clear
        front.send(identity, CODEC.encode_utility(99, "enginelink_sim_kv_fault", ("restart",)))
        assert front.next_batch().utility.failure is None
        spec = GenerateSpec(request_id="r9", prompt_token_ids=[8] * 16, sampling=SamplingSpec(max_tokens=1))
        front.send(identity, CODEC.encode_add(spec))
        _, seq, payload = kv.parse_pub_message(recv(sub))
        events = kv.decode_batch(payload).events
        assert seq == 0 and events[0] == kv.WireCleared()
    finally:
        status = stop(engine_proc)
        front.close()
    assert status == 0, engine_proc.stderr.read().decode()


@pytest.mark.process
def test_a_relay_over_real_sockets_repairs_a_drop_and_records_a_skip(tmp_path: Path):
    """The shell's part, done by hand: SUB → on_live, FetchReplay → DEALER → on_replay."""
    from enginelink.machines.kv_relay import FetchReplay, KvRelay, KvRelayConfig
    from tests.machines.kv_pair import Subscriber
    from tests.test_sim_engine_process import FrontEnd, recv, stop

    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 512, "max_position_embeddings": 128}))
    front = FrontEnd()
    # The PUB connects to a tcp endpoint without a wildcard: the relay's SUB binds (vLLM's rule).
    sub = front.ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}",
              "replay_endpoint": "tcp://127.0.0.1:0"}  # fmt: skip
    argv = [sys.executable, "-m", "enginelink.tools.sim_engine", "--handshake", front.handshake_address,
            "--model", str(tmp_path), "--kv-events-config", json.dumps(config),
            "--kv-fault-drop", "1", "--kv-fault-skip", "3"]  # fmt: skip
    engine_proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    relay = KvRelay([0], KvRelayConfig())
    try:
        identity, ready = front.handshake_engine()
        assert not kv.publisher_binds(ready.kv_events_config["endpoint"])
        recv(monitor)
        # A bound SUB sends its subscription to a connecting PUB only once the application
        # touches the socket (libzmq #2267): the relay's shell must keep polling it, as we do.
        for i in range(20):
            sub.poll(0)
            front.send(identity, CODEC.encode_utility(i, "is_sleeping", ()))
            front.next_batch()
        dealer = front.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(ready.kv_events_config["replay_endpoint"])

        def shell(actions: list) -> None:
            for action in actions:
                if isinstance(action, FetchReplay):
                    dealer.send_multipart(kv.replay_request(action.start_seq))
                    replies = []
                    while not replies or kv.parse_replay_reply(replies[-1]) != kv.ReplayEnd():
                        replies.append(recv(dealer))
                    shell(relay.on_replay(0, action.token, replies, True, 0.0))

        for i in range(6):
            prompt = [10 + i] * 16  # one full block (the sim's default block size is 16)
            spec = GenerateSpec(request_id=f"r{i}", prompt_token_ids=prompt, sampling=SamplingSpec(max_tokens=1))
            front.send(identity, CODEC.encode_add(spec))
            while not front.next_batch().finished_requests:
                pass
        for _ in range(4):  # 0, 2, 4, 5 arrive; 1 dropped (replayable), 3 skipped (gone)
            shell(relay.on_live(0, recv(sub), 0.0))
        counters = relay.counters()
        assert (counters["relayed"], counters["holes"], relay.gauges()[0]["newest"]) == (5, 1, 5)
        assert counters["recovered"] >= 1  # 1 at least; 4 and 5 too when the replay got there first
        fresh = Subscriber(relay, 0)
        fresh.drain()
        assert fresh.modes == {0: "snapshot"} and fresh.blocks == relay.live_set()
        assert len(relay.live_set()) == 5 and fresh.received[0].snapshot.unknown_before == 1
    finally:
        status = stop(engine_proc)
        front.close()
    assert status == 0, engine_proc.stderr.read().decode()
