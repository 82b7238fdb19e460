"""The header blocks the direct path writes without h2's encoder (runtime/rpc/fastpath.py)."""

from __future__ import annotations

import hpack

from enginelink.runtime.rpc.fastpath import header_block


def test_a_header_block_says_its_headers_and_leaves_the_peers_table_alone():
    headers = ((":status", "200"), ("content-type", "application/grpc+proto"))
    decoder = hpack.Decoder()
    # The peer's table already holds what h2's encoder put there (grpclib's own responses):
    # the block must decode the same after it, and add nothing to it.
    primed = hpack.Encoder()
    decoder.decode(primed.encode([("content-type", "application/grpc+proto"), ("grpc-status", "0")]))
    entries = list(decoder.header_table.dynamic_entries)
    assert decoder.decode(header_block(headers)) == list(headers)
    assert decoder.decode(header_block((("grpc-status", "0"),))) == [("grpc-status", "0")]
    assert list(decoder.header_table.dynamic_entries) == entries
    # ... so h2's encoder, which never saw the blocks, still speaks the peer's table.
    assert decoder.decode(primed.encode([("grpc-status", "0")])) == [("grpc-status", "0")]


def test_the_fast_path_knob_reads_on_and_off_words_and_names_itself_otherwise():
    from enginelink.runtime.rpc.fastpath import FAST_PATH_ENV, fast_path_from_env

    assert fast_path_from_env({}) is True  # default on
    for word in ("1", "on", "ON", " true ", "yes"):
        assert fast_path_from_env({FAST_PATH_ENV: word}) is True
    for word in ("0", "off", "Off", "false", "no"):
        assert fast_path_from_env({FAST_PATH_ENV: word}) is False
    try:
        fast_path_from_env({FAST_PATH_ENV: "fast"})
    except ValueError as error:
        assert FAST_PATH_ENV in str(error)
    else:
        raise AssertionError("a value that is neither on nor off was taken")
