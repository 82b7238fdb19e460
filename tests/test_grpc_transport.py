"""The header blocks the direct path writes without h2's encoder (runtime/fastpath.py)."""

from __future__ import annotations

import hpack

from enginelink.runtime.fastpath import header_block


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
