"""The KV-event wire codec (vLLM --kv-events-config, PUB framing, replay); the neutral batch as
protobuf is tests/kv/test_kv_messages.py's."""

from __future__ import annotations

import msgspec
import pytest

from enginelink.wire import kv_events as kv
from enginelink.wire.engine import WireError

# ---- config and endpoints --------------------------------------------------------


def test_config_has_vllms_keys_and_defaults():
    config = kv.parse_config('{"enable_kv_cache_events": true}')
    assert (config.publisher, config.endpoint, config.replay_endpoint) == ("zmq", "tcp://*:5557", None)
    assert (config.buffer_steps, config.hwm, config.max_queue_size, config.topic) == (10_000, 100_000, 100_000, "")
    assert config.publishing
    assert kv.parse_config("{}").publisher == "null" and not kv.parse_config("{}").publishing
    assert not kv.parse_config('{"publisher": "zmq"}').publishing  # vLLM needs both switches
    assert kv.parse_config('{"enable_kv_cache_events": true, "topic": "kv"}').to_dict()["topic"] == "kv"


@pytest.mark.parametrize(
    "text", ["not json", '{"endpoint": 5}', '{"publisher": "kafka"}', '{"surprise": 1}', '{"buffer_steps": 0}']
)
def test_a_bad_config_says_why(text):
    with pytest.raises(ValueError, match="--kv-events-config"):
        kv.parse_config(text)


@pytest.mark.parametrize(
    ("endpoint", "rank", "want"),
    [
        ("tcp://*:5557", 0, "tcp://*:5557"),
        ("tcp://*:5557", 2, "tcp://*:5559"),
        ("tcp://127.0.0.1:6000", 1, "tcp://127.0.0.1:6001"),
        ("tcp://127.0.0.1:0", 3, "tcp://127.0.0.1:0"),  # the OS picks, per socket
        ("inproc://kv", 1, "inproc://kv_dp1"),
        ("ipc:///tmp/kv", 0, "ipc:///tmp/kv"),
    ],
)
def test_endpoints_are_offset_by_rank_as_vllm_does(endpoint, rank, want):
    assert kv.endpoint_for_rank(endpoint, rank) == want


def test_an_ipc_endpoint_cannot_serve_two_ranks():
    with pytest.raises(ValueError, match="DP rank 1"):
        kv.endpoint_for_rank("ipc:///tmp/kv", 1)


@pytest.mark.parametrize(
    ("endpoint", "binds"),
    [("tcp://*:5557", True), ("tcp://[::]:5557", True), ("ipc:///tmp/x", True), ("inproc://x", True),
     ("tcp://127.0.0.1:5557", False), ("tcp://localhost:1", False)],
)  # fmt: skip
def test_the_pub_socket_binds_only_where_vllm_binds(endpoint, binds):
    assert kv.publisher_binds(endpoint) is binds


def test_connectable_turns_wildcards_into_loopback():
    assert kv.connectable("tcp://*:5557") == "tcp://127.0.0.1:5557"
    assert kv.connectable("tcp://0.0.0.0:9") == "tcp://127.0.0.1:9"


# ---- what a publisher sends -------------------------------------------------------


def test_a_batch_encodes_as_vllm_does():
    batch = kv.KVEventBatch(
        12.5,
        [
            kv.BlockStored(block_hashes=[2**64 - 1, 5], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2,
                           lora_id=None, medium="GPU", lora_name=None, extra_keys=[None, None], group_idx=0,
                           kv_cache_spec_kind="full_attention"),
            kv.BlockRemoved(block_hashes=[5], medium="GPU", group_idx=0),
            kv.AllBlocksCleared(),
        ],
        0,
    )  # fmt: skip
    ts, events, rank = msgspec.msgpack.decode(kv.encode_batch(batch))
    assert (ts, rank) == (12.5, 0)
    stored, removed, cleared = events
    assert list(stored) == [
        "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
        "extra_keys", "group_idx", "kv_cache_spec_kind",
    ]  # fmt: skip  # required fields always, defaulted ones only when set
    assert stored["type"] == "BlockStored" and stored["block_hashes"] == [2**64 - 1, 5]
    assert removed == {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU", "group_idx": 0}
    assert cleared == {"type": "AllBlocksCleared"}


def test_pub_messages_round_trip_and_bad_ones_are_the_engines_fault():
    frames = kv.pub_message(b"kv", 2**40 + 3, b"payload")
    assert frames[1] == (2**40 + 3).to_bytes(8, "big")
    assert kv.parse_pub_message(frames) == (b"kv", 2**40 + 3, b"payload")
    for bad in ([b"kv", b"\x00" * 8], [b"kv", b"\x00" * 7, b"p"], [b"a", b"b", b"c", b"d"]):
        with pytest.raises(WireError):
            kv.parse_pub_message(bad)


# ---- replay --------------------------------------------------------------------------


def test_replay_request_and_replies_in_both_forms():
    assert kv.replay_request(19) == [b"", (19).to_bytes(8, "big")]
    assert kv.parse_replay_request(kv.replay_request(19)) == 19
    with pytest.raises(WireError):
        kv.parse_replay_request([(19).to_bytes(8, "big")])
    # vLLM: [b"", topic, seq, payload] ... [b"", b"", 0xFF×8, b""]
    assert kv.replay_reply(b"kv", 19, b"p") == [b"", b"kv", (19).to_bytes(8, "big"), b"p"]
    assert kv.replay_end() == [b"", b"", b"\xff" * 8, b""]
    # SGLang: no topic frame
    assert kv.replay_reply(None, 19, b"p") == [b"", (19).to_bytes(8, "big"), b"p"]
    assert kv.replay_end(False) == [b"", b"\xff" * 8, b""]
    for topic in (b"kv", None):
        assert kv.parse_replay_reply(kv.replay_reply(topic, 19, b"p")) == (19, b"p")
        assert kv.parse_replay_reply(kv.replay_end(topic is not None)) == kv.ReplayEnd()
    for bad in ([b"x", b"kv", b"\x00" * 8, b"p"], [b"", b"\x00" * 3, b"p"], [b""]):
        with pytest.raises(WireError):
            kv.parse_replay_reply(bad)


# ---- what a relay reads ---------------------------------------------------------------


def test_hashes_fold_to_int64():
    assert kv.fold_hash(5) == 5
    assert kv.fold_hash(2**64 - 1) == -1  # vLLM's unsigned ints keep their bit pattern
    assert kv.fold_hash(2**63) == -(2**63)
    assert kv.fold_hash(-7) == -7  # SGLang's signed ints
    assert kv.fold_hash(2**70 + 9) == 9  # low 64 bits
    digest = bytes(range(32))
    assert kv.fold_hash(digest) == int.from_bytes(digest[-8:], "big")  # the int vLLM would send
    assert kv.fold_hash(b"\xff" * 32) == -1
    assert kv.fold_hash(True) is None and kv.fold_hash("x") is None


def test_decode_reads_tagged_maps_with_everything_folded():
    payload = msgspec.msgpack.encode([
        3.0,
        [{"type": "BlockStored", "block_hashes": [2**64 - 2, b"\x00" * 24 + b"\x00\x00\x00\x00\x00\x00\x00\x07"],
          "parent_block_hash": 2**64 - 1, "token_ids": [[1, 2], [3, 4], 5, 6], "block_size": 2, "lora_id": None,
          "medium": "CPU", "lora_name": None, "extra_keys": [["salt"], None], "group_idx": 1,
          "kv_cache_spec_kind": "full_attention", "locality": "LOCAL", "session_id": "s", "future_key": 1}],
        2,
    ])  # fmt: skip
    batch = kv.decode_batch(payload)
    assert (batch.ts, batch.dp_rank) == (3.0, 2)
    (event,) = batch.events
    assert event.block_hashes == (-2, 7) and event.parent_block_hash == -1
    assert event.token_ids == (1, 3, 5, 6)  # bigrams fold to their first token
    assert (event.medium, event.group_idx, event.locality, event.session_id) == ("CPU", 1, "LOCAL", "s")
    assert event.cache_salt == "salt"  # vLLM's salt rides in the first block's extra keys


def test_decode_reads_legacy_tag_first_arrays_and_map_batches():
    payload = msgspec.msgpack.encode({
        "ts": 1.0,
        "events": [["BlockStored", [1], None, [7, 8], 2, None, "GPU"], ["BlockRemoved", [1], "GPU"],
                   ["AllBlocksCleared"]],
        "data_parallel_rank": 1,
    })  # fmt: skip
    batch = kv.decode_batch(payload)
    stored, removed, cleared = batch.events
    assert (stored.block_hashes, stored.token_ids, stored.block_size, stored.medium) == ((1,), (7, 8), 2, "GPU")
    assert (removed.block_hashes, removed.medium) == ((1,), "GPU")
    assert cleared == kv.WireCleared() and batch.dp_rank == 1


@pytest.mark.parametrize(
    ("event", "want"),
    [
        ({"type": "BlockMoved"}, kv.WireUnknown("BlockMoved")),
        ({"block_hashes": [1]}, kv.WireMalformed("type")),
        (42, kv.WireMalformed("type")),
        ({"type": "BlockStored", "block_hashes": [1.5], "token_ids": [1], "block_size": 1}, kv.WireMalformed("block_hashes")),
        ({"type": "BlockStored", "block_hashes": [1], "token_ids": [-1], "block_size": 1}, kv.WireMalformed("token_ids")),
        ({"type": "BlockStored", "block_hashes": [1], "token_ids": [2**32], "block_size": 1}, kv.WireMalformed("token_ids")),
        ({"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": "1"}, kv.WireMalformed("block_size")),
        ({"type": "BlockStored", "block_hashes": [1], "parent_block_hash": "p", "token_ids": [1], "block_size": 1},
         kv.WireMalformed("parent_block_hash")),
        ({"type": "BlockRemoved", "block_hashes": None}, kv.WireMalformed("block_hashes")),
    ],
)  # fmt: skip
def test_an_unreadable_event_is_named_and_the_batch_survives(event, want):
    batch = kv.decode_batch(msgspec.msgpack.encode([0.0, [event, {"type": "AllBlocksCleared"}]]))
    assert batch.events == (want, kv.WireCleared()) and batch.dp_rank is None


@pytest.mark.parametrize("payload", [b"\xc1", msgspec.msgpack.encode([1.0]), msgspec.msgpack.encode("x"),
                                     msgspec.msgpack.encode(["ts", []]), msgspec.msgpack.encode([1.0, {}])])  # fmt: skip
def test_an_unreadable_batch_is_a_wire_error(payload):
    with pytest.raises(WireError):
        kv.decode_batch(payload)


