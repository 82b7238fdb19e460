"""Where the engine's KV publisher and the relay meet (``runtime/kv/kv_config.py``): pure planning."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from enginelink.runtime.kv.kv_config import KvConfigError, RankEndpoints, engine_ranks, plan_kv_events
from enginelink.wire import kv_events as kv

DIR = Path("/tmp/smg-zmq-test")


def plan(engine="sim", args=(), env=None):
    return plan_kv_events(engine, list(args), env or {}, socket_dir=DIR, prefix="enginelink-42-sim")


def given(args: list[str]) -> dict:
    return json.loads(args[args.index("--kv-events-config") + 1])


def test_on_by_default_with_ipc_sockets_in_the_private_directory():
    args, p = plan(args=["--step-us", "5"])
    assert args[:2] == ["--step-us", "5"]
    config = given(args)
    assert config == {**kv.KvEventsConfig(enable_kv_cache_events=True, publisher="zmq", topic="kv").to_dict(),
                      "endpoint": f"ipc://{DIR}/enginelink-42-sim-kv.sock",
                      "replay_endpoint": f"ipc://{DIR}/enginelink-42-sim-kv-replay.sock"}  # fmt: skip
    assert p.ranks == (RankEndpoints(0, config["endpoint"], False, config["replay_endpoint"]),)
    assert kv.publisher_binds(config["endpoint"])  # the engine binds; nothing listens beyond this host
    assert p.paths == (DIR / "enginelink-42-sim-kv.sock", DIR / "enginelink-42-sim-kv-replay.sock")
    assert p.relay.replay and not p.explicit and p.topic == b"kv"


@pytest.mark.parametrize("env", [{"SMG_VLLM_SERVICER_KV_EVENTS": "0"}, {"ENGINELINK_KV_EVENTS": "off"},
                                 {"SMG_VLLM_SERVICER_KV_EVENTS": "false"}])  # fmt: skip
def test_the_knob_leaves_it_off(env):
    assert plan(args=["--step-us", "5"], env=env) == (["--step-us", "5"], None)


def test_a_bad_knob_is_refused():
    with pytest.raises(KvConfigError, match="SMG_VLLM_SERVICER_KV_EVENTS"):
        plan(env={"SMG_VLLM_SERVICER_KV_EVENTS": "maybe"})
    with pytest.raises(KvConfigError, match="SMG_KV_EVENT_HISTORY_BATCHES"):
        plan(env={"SMG_KV_EVENT_HISTORY_BATCHES": "0"})


def test_history_bounds_come_from_the_environment():
    _, p = plan(env={"SMG_KV_EVENT_HISTORY_BATCHES": "8", "SMG_KV_EVENT_HISTORY_BYTES": "4096"})
    assert (p.relay.history_batches_max, p.relay.history_bytes_max) == (8, 4096)


def test_several_dp_ranks_get_loopback_tcp_with_the_relay_binding_the_pub_side():
    args, p = plan("vllm", ["--data-parallel-size", "2"])
    config = given(args)
    assert config["endpoint"].startswith("tcp://127.0.0.1:") and config["replay_endpoint"].startswith("tcp://127.0.0.1:")
    assert not kv.publisher_binds(config["endpoint"])  # each rank's PUB connects to the relay
    pub, replay = int(config["endpoint"].rsplit(":", 1)[1]), int(config["replay_endpoint"].rsplit(":", 1)[1])
    assert p.ranks == (
        RankEndpoints(0, f"tcp://127.0.0.1:{pub}", True, f"tcp://127.0.0.1:{replay}"),
        RankEndpoints(1, f"tcp://127.0.0.1:{pub + 1}", True, f"tcp://127.0.0.1:{replay + 1}"),
    )
    assert [kv.endpoint_for_rank(config["endpoint"], r) for r in (0, 1)] == [e.pub for e in p.ranks]


def test_an_explicit_config_is_kept_and_followed():
    text = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}'
    args, p = plan(args=["--kv-events-config", text], env={"SMG_VLLM_SERVICER_KV_EVENTS": "0"})
    assert args == ["--kv-events-config", text]
    assert p.explicit and not p.relay.replay and p.paths == ()
    assert p.ranks == (RankEndpoints(0, "tcp://127.0.0.1:5557", False, None),)

    text = '{"enable_kv_cache_events":true,"endpoint":"tcp://127.0.0.1:6000","replay_endpoint":"tcp://*:6001"}'
    _, p = plan("vllm", [f"--kv-events-config={text}", "-dp", "2"])
    assert p.ranks == (RankEndpoints(0, "tcp://127.0.0.1:6000", True, "tcp://127.0.0.1:6001"),
                       RankEndpoints(1, "tcp://127.0.0.1:6001", True, "tcp://127.0.0.1:6002"))  # fmt: skip


def test_an_explicit_config_that_does_not_publish_means_off():
    for text in ('{"enable_kv_cache_events": false}', '{"enable_kv_cache_events": true, "publisher": "null"}'):
        assert plan(args=["--kv-events-config", text]) == (["--kv-events-config", text], None)


def test_port_zero_is_learned_from_the_ready_response_for_one_rank_only():
    text = '{"enable_kv_cache_events":true,"endpoint":"tcp://*:0","replay_endpoint":"tcp://*:0"}'
    _, p = plan(args=["--kv-events-config", text])
    assert p.ranks == (RankEndpoints(0, None, False, None, replay_late=True),)
    with pytest.raises(KvConfigError, match="port 0"):
        plan("vllm", ["--kv-events-config", text, "--data-parallel-size", "2"])
    with pytest.raises(KvConfigError, match="needs a port"):
        plan(args=["--kv-events-config", '{"enable_kv_cache_events":true,"endpoint":"tcp://127.0.0.1:0"}'])


def test_a_bad_explicit_config_is_refused():
    with pytest.raises(KvConfigError, match="kv-events-config"):
        plan(args=["--kv-events-config", '{"enable_kv_cache_events": true, "no_such_key": 1}'])


def test_ranks_of_each_engine():
    assert engine_ranks("sim", []) == (0,)
    assert engine_ranks("sim", ["--rank", "3"]) == (3,)
    assert engine_ranks("vllm", []) == (0,)
    assert engine_ranks("vllm", ["--data-parallel-size", "4"]) == (0, 1, 2, 3)


# ---- SGLang's and TokenSpeed's dialects (wire/kv_engines.py) -----------------------------


def test_sglangs_own_config_form_is_relayed():
    """The reference's example, SGLang's keys only: it publishes (its publisher is zmq), so the relay follows it."""
    text = '{"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558"}'
    args, p = plan_kv_events("sglang", ["--kv-events-config", text], {}, socket_dir=DIR, prefix="p", dialect="sglang")
    assert args == ["--kv-events-config", text]  # kept as given
    assert p is not None and p.explicit and p.relay.replay and p.topic == b""
    assert p.ranks == (RankEndpoints(0, "tcp://127.0.0.1:5557", False, "tcp://127.0.0.1:5558"),)
    # SGLang binds 0.0.0.0 and honours its bind; vLLM's rule would have the relay bind there instead.
    text = '{"publisher":"zmq","endpoint":"tcp://0.0.0.0:5557"}'
    _, p = plan_kv_events("sglang", ["--kv-events-config", text], {}, socket_dir=DIR, prefix="p", dialect="sglang")
    assert p.ranks == (RankEndpoints(0, "tcp://127.0.0.1:5557", False, None),)
    text = '{"publisher":"zmq","endpoint":"tcp://127.0.0.1:5557","bind":true}'
    _, p = plan_kv_events("sglang", ["--kv-events-config", text], {}, socket_dir=DIR, prefix="p", dialect="sglang")
    assert p.ranks == (RankEndpoints(0, "tcp://127.0.0.1:5557", False, None),)
    # What SGLang reads as not publishing is not relayed: vLLM's switch alone, or the null publisher.
    for off in ('{"enable_kv_cache_events":true}', '{"publisher":"null"}'):
        assert plan_kv_events("sglang", ["--kv-events-config", off], {}, socket_dir=DIR, prefix="p",
                              dialect="sglang")[1] is None  # fmt: skip


def test_the_default_config_is_written_in_the_engines_dialect():
    for dialect, switch in (("sglang", {"publisher": "zmq"}),
                            ("tokenspeed", {"enable_kv_cache_events": True, "publisher": "zmq"})):
        args, p = plan_kv_events(dialect, [], {}, socket_dir=DIR, prefix="p", dialect=dialect)
        assert given(args) == {**switch, "endpoint": f"ipc://{DIR}/p-kv.sock",
                               "replay_endpoint": f"ipc://{DIR}/p-kv-replay.sock", "topic": "kv"}
        assert p.config.publishing and p.ranks[0].pub == f"ipc://{DIR}/p-kv.sock"
        knob = f"SMG_{dialect.upper()}_SERVICER_KV_EVENTS"
        assert plan_kv_events(dialect, [], {knob: "0"}, socket_dir=DIR, prefix="p", dialect=dialect,
                              knobs=("ENGINELINK_KV_EVENTS", knob))[1] is None  # fmt: skip


def test_a_port_0_is_refused_where_the_engines_report_cannot_name_it():
    for dialect, text in (("sglang", '{"publisher":"zmq","endpoint":"tcp://*:0"}'),
                          ("tokenspeed", '{"enable_kv_cache_events":true,"replay_endpoint":"tcp://*:0"}')):
        with pytest.raises(KvConfigError, match="port 0 cannot be followed"):
            plan_kv_events(dialect, ["--kv-events-config", text], {}, socket_dir=DIR, prefix="p", dialect=dialect)
    with pytest.raises(KvConfigError, match="unknown publisher"):
        plan_kv_events("sglang", ["--kv-events-config", '{"publisher":"kafka"}'], {}, socket_dir=DIR, prefix="p",
                       dialect="sglang")  # fmt: skip
