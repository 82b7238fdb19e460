"""SGLang's and TokenSpeed's KV-event dialects (``wire/kv_engines.py``) against the engines' own code.

Real-package half (the struct-only venvs; required under
``ENGINELINK_REQUIRE_SGLANG=1`` / ``_TOKENSPEED=1``), one peer process per
engine (``kv_peer.py``): each ``--kv-events-config`` text means to us what
the engine's own ``EventPublisherFactory`` makes of it (publishing or not,
and with what endpoints, topic and buffers); the batches the sim publishes
in the engine's dialect decode with the engine's own ``KVEventBatch``
decoder into the batch the engine would build; the engine's own encoded
batches decode with the relay's decoder into the events we expect. Pure
half: the dialect rules on their own.
"""

from __future__ import annotations

import json

import msgspec
import pytest

from enginelink.wire import kv_engines as ke
from enginelink.wire import kv_events as kv
from tests.wire.engine_venvs import side_python_or_skip

PEER_TIMEOUT_S = 600.0

CONFIGS = {
    "sglang": {
        "reference_example": {"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"},
        "vllm_keys_only": {"enable_kv_cache_events": True},  # SGLang's publisher stays null: no "zmq"
        "vllm_form": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "ipc:///tmp/x.sock"},
        "bind_dynamo_topic": {"publisher": "zmq", "bind": True, "endpoint": "tcp://127.0.0.1:5557", "format": "dynamo",
                              "topic": "t", "buffer_steps": 7, "hwm": 9, "max_queue_size": 11},
        "null": {"publisher": "null", "endpoint": "tcp://*:1"},
        "empty": {},
    },
    "tokenspeed": {
        "enabled": {"enable_kv_cache_events": True},  # the publisher defaults to zmq once enabled
        "zmq_not_enabled": {"publisher": "zmq", "endpoint": "tcp://*:5557"},
        "enabled_null": {"enable_kv_cache_events": True, "publisher": "null"},
        "full": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:6000",
                 "replay_endpoint": "tcp://*:6001", "topic": "kv", "buffer_steps": 3, "hwm": 5, "max_queue_size": 6},
    },
}

SALT = "salt-a"
# What the sim core reports (vLLM's form): a run of two blocks under a parent, a removal, a clear.
CORE_EVENTS = [
    kv.BlockStored(block_hashes=[2**64 - 3, 12], parent_block_hash=2**63 + 5, token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
                   block_size=4, lora_id=None, medium="GPU", lora_name=None, extra_keys=[[SALT], None]),
    kv.BlockRemoved(block_hashes=[2**64 - 3], medium="GPU"),
    kv.AllBlocksCleared(),
]
# The same events as each engine's publisher builds them (its own structs' fields).
ENGINE_BATCH = {
    "sglang": {"ts": 4.5, "attn_dp_rank": 1, "events": [
        {"type": "BlockStored", "block_hashes": [-3], "parent_block_hash": -(2**63) + 5, "token_ids": [1, 2, 3, 4],
         "block_size": 4, "lora_id": None, "medium": "GPU", "cache_salt": SALT},
        {"type": "BlockStored", "block_hashes": [12], "parent_block_hash": -3, "token_ids": [5, 6, 7, 8],
         "block_size": 4, "lora_id": None, "medium": "GPU", "cache_salt": SALT},
        {"type": "BlockRemoved", "block_hashes": [-3], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
    ]},
    "tokenspeed": {"ts": 4.5, "attn_dp_rank": 1, "events": [
        {"type": "BlockStored", "block_hashes": [2**64 - 3, 12], "parent_block_hash": 2**63 + 5,
         "token_ids": [1, 2, 3, 4, 5, 6, 7, 8], "block_size": 4},
        {"type": "BlockRemoved", "block_hashes": [2**64 - 3]},
    ]},
}


def run_kv_peer(engine: str, python: str, cases: list[dict], tmp) -> dict:
    import subprocess
    from pathlib import Path

    cases_path, results_path = tmp / "cases.msgpack", tmp / "results.msgpack"
    cases_path.write_bytes(msgspec.msgpack.encode(cases))
    peer = Path(__file__).with_name("kv_peer.py")
    done = subprocess.run([python, str(peer), engine, "cases", str(cases_path), str(results_path)],
                          capture_output=True, text=True, timeout=PEER_TIMEOUT_S)  # fmt: skip
    assert done.returncode == 0, f"the {engine} KV peer failed:\n{done.stderr[-3000:]}"
    return msgspec.msgpack.decode(results_path.read_bytes())


@pytest.fixture(scope="module", params=["sglang", "tokenspeed"])
def peer(request, tmp_path_factory):
    engine = request.param
    python = side_python_or_skip(engine)
    cases = [{"id": f"config:{name}", "op": "config", "text": json.dumps(body)}
             for name, body in CONFIGS[engine].items()]
    cases.append({"id": "decode", "op": "decode", "fields": ENGINE_BATCH[engine],
                  "payload": ke.encode_batch(engine, 4.5, CORE_EVENTS, 1)})
    cases.append({"id": "encode", "op": "encode", "fields": ENGINE_BATCH[engine]})
    return engine, run_kv_peer(engine, python, cases, tmp_path_factory.mktemp(f"{engine}-kv-peer"))


@pytest.mark.process
def test_each_config_means_to_us_what_the_engines_factory_makes_of_it(peer):
    engine, results = peer
    for name, body in CONFIGS[engine].items():
        made = results[f"config:{name}"]
        assert "error" not in made, (name, made)
        ours = ke.parse_config(json.dumps(body), engine)
        assert ours.publishing == (made["kind"] == "zmq"), (name, made)
        if made["kind"] == "zmq":
            for key, value in made["kwargs"].items():
                if key != "attn_dp_rank":
                    assert getattr(ours, key) == value, (name, key)


@pytest.mark.process
def test_the_engine_decodes_the_batch_the_sim_publishes_in_its_dialect(peer):
    engine, results = peer
    result = results["decode"]
    assert "error" not in result, result
    assert result["equal"], (result["got"], result["expected"])


@pytest.mark.process
def test_the_relay_reads_the_engines_own_batches(peer):
    engine, results = peer
    assert "error" not in results["encode"], results["encode"]
    batch = kv.decode_batch(results["encode"]["payload"])
    assert (batch.ts, batch.dp_rank) == (4.5, 1)
    stored = [e for e in batch.events if isinstance(e, kv.WireStored)]
    removed = [e for e in batch.events if isinstance(e, kv.WireRemoved)]
    # The same chain whichever engine: hashes folded to int64 (unsigned and signed alike), tokens per block.
    assert [h for e in stored for h in e.block_hashes] == [-3, 12]
    assert stored[0].parent_block_hash == -(2**63) + 5
    assert [t for e in stored for t in e.token_ids] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert removed[0].block_hashes == (-3,)
    if engine == "sglang":
        assert [e.cache_salt for e in stored] == [SALT, SALT] and stored[0].medium == "GPU"
        assert isinstance(batch.events[-1], kv.WireCleared)
    else:
        assert stored[0].cache_salt is None and len(batch.events) == 2


# ---- the pure half ----------------------------------------------------------------------


def test_sglangs_config_publishes_without_vllms_switch_and_ignores_unknown_keys():
    config = ke.parse_config('{"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558",'
                             '"future_key":1}', "sglang")  # fmt: skip
    assert config.publishing and config.replay_endpoint == "tcp://*:5558"
    assert not ke.parse_config('{"enable_kv_cache_events":true}', "sglang").publishing
    # vLLM's own config refuses a key it does not know, and needs its switch.
    assert not kv.parse_config('{"publisher":"zmq"}').publishing
    with pytest.raises(ValueError):
        kv.parse_config('{"publisher":"zmq","bind":true}')
    for bad in ('{"publisher":"kafka"}', '{"publisher":"zmq","buffer_steps":0}', "[1]", "{"):
        with pytest.raises(ValueError, match="--kv-events-config"):
            ke.parse_config(bad, "sglang")


def test_where_each_engine_binds_its_pub():
    sglang = ke.parse_config('{"publisher":"zmq"}', "sglang")
    assert ke.pub_binds(sglang, "tcp://0.0.0.0:5557")  # SGLang binds 0.0.0.0; vLLM and TokenSpeed connect there
    assert not kv.publisher_binds("tcp://0.0.0.0:5557")
    assert not ke.pub_binds(sglang, "tcp://127.0.0.1:5557")
    assert ke.pub_binds(ke.parse_config('{"publisher":"zmq","bind":true}', "sglang"), "tcp://127.0.0.1:5557")
    assert not ke.pub_binds(ke.parse_config('{"publisher":"zmq","bind":false}', "sglang"), "ipc:///x")
    ts = ke.parse_config('{"enable_kv_cache_events":true}', "tokenspeed")
    assert ke.pub_binds(ts, "ipc:///x") and not ke.pub_binds(ts, "tcp://0.0.0.0:1")
    assert not ke.learns_ports(sglang) and not ke.learns_ports(ts)
    assert ke.learns_ports(kv.KvEventsConfig(enable_kv_cache_events=True))


def test_our_default_config_is_written_in_the_engines_dialect():
    assert ke.publishing_config("sglang", endpoint="ipc:///a", topic="kv").to_dict() == {
        "publisher": "zmq", "endpoint": "ipc:///a", "topic": "kv"}
    assert ke.publishing_config("tokenspeed", endpoint="ipc:///a").to_dict() == {
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "ipc:///a"}
    assert ke.publishing_config("vllm", endpoint="ipc:///a").publishing


def test_tokenspeed_batches_are_tag_first_arrays_and_sglang_batches_tagged_maps():
    ts = msgspec.msgpack.decode(ke.encode_batch("tokenspeed", 1.0, CORE_EVENTS, None))
    assert ts[:2] == [1.0, [["BlockStored", [2**64 - 3, 12], 2**63 + 5, [1, 2, 3, 4, 5, 6, 7, 8], 4],
                            ["BlockRemoved", [2**64 - 3]]]]  # no clear
    sg = msgspec.msgpack.decode(ke.encode_batch("sglang", 1.0, CORE_EVENTS[2:], None))
    assert sg == [1.0, [{"type": "AllBlocksCleared"}], None]  # the rank slot is always there
    for dialect in ke.DIALECTS:
        batch = kv.decode_batch(ke.encode_batch(dialect, 1.0, CORE_EVENTS[:1], 3))
        assert batch.dp_rank == 3 and [h for e in batch.events for h in e.block_hashes] == [-3, 12]
    assert ke.replay_has_topic("sglang") and ke.replay_has_topic("vllm") and not ke.replay_has_topic("tokenspeed")
