"""A streamed chunk's response bytes without protobuf objects, for every contract's fast path.

Why: the hub's direct path (``runtime/requests/hub.py``, ``_write_touched``)
writes one chunk per call per engine frame, and building it as upb messages
(two messages, their arena, five field sets, ``SerializeToString``) was the
largest single cost of a streamed token between engine steps
(docs/benchmarks.md, stop 15, and "Per-token cost of the SGLang and TokenSpeed
contracts"). Every contract's stream chunk is the same shape: a
``GenerateResponse`` whose chunk field holds a ``GenerateStreamChunk`` of
packed ``token_ids`` = 1, ``prompt_tokens`` = 2, ``completion_tokens`` = 3,
``cached_tokens`` = 4 and an ``index`` whose number differs (vLLM 7, SGLang
8, TokenSpeed and MLX 6); the response's own chunk field differs (vLLM and
MLX 1, SGLang and TokenSpeed 2, after TokenSpeed's ``request_id`` = 1).

The bytes are upb's: fields in number order, proto3 zeros left out, the
token ids packed (``tests/test_chunk_bytes.py`` compares them with
``SerializeToString`` for each contract, over random and edge values).
An edge's ``chunk_body(call, choice, tokens)`` (``contract.ContractEdge``)
reads its values off the core's call and choice and calls ``stream_chunk``
with its layout's constants (vLLM's ``completion_tokens`` is the chunk's own
count, the others' a running total).
"""

from __future__ import annotations

_VARINTS = [bytes((value,)) for value in range(0x80)]


def varint(value: int) -> bytes:
    """A protobuf varint (non-negative values: every field here is uint32).

    One to three bytes (every token id of today's vocabularies, every count
    below 2M) without a loop: this runs for every streamed token.
    """
    if value < 0x80:
        return _VARINTS[value]
    if value < 0x4000:
        return bytes((value & 0x7F | 0x80, value >> 7))
    if value < 0x200000:
        return bytes((value & 0x7F | 0x80, value >> 7 & 0x7F | 0x80, value >> 14))
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def string_field(key: bytes, value: str) -> bytes:
    """A length-delimited string field (``key`` its tag byte), or nothing for proto3's empty string.

    Computed once per call (TokenSpeed's ``request_id``), not per token."""
    if not value:
        return b""
    data = value.encode()
    return key + varint(len(data)) + data


def stream_chunk(head: bytes, chunk_key: bytes, tokens: list[int], prompt_tokens: int, completion_tokens: int,
                 cached_tokens: int, index_key: bytes, index: int) -> bytes:
    """``head`` + the response's chunk field (tag byte ``chunk_key``) holding a ``GenerateStreamChunk``.

    ``head``: the response's fields numbered before the chunk, already
    encoded (TokenSpeed's ``request_id``; empty for the others).
    ``completion_tokens``: the running count, never 0 here (the chunk has a
    token). The message is one ``join`` of its pieces: each ``+`` would copy
    what came before it.
    """
    if len(tokens) == 1:  # the common chunk, at one token per engine step
        packed = varint(tokens[0])
    else:
        packed = b"".join(map(varint, tokens))
    tail = b"\x18" + varint(completion_tokens)
    if prompt_tokens:
        tail = b"\x10" + varint(prompt_tokens) + tail
    if cached_tokens:
        tail += b"\x20" + varint(cached_tokens)
    if index:
        tail += index_key + varint(index)
    packed_size = varint(len(packed))
    chunk_size = 1 + len(packed_size) + len(packed) + len(tail)  # field 1 (length-delimited): the tokens
    return b"".join((head, chunk_key, varint(chunk_size), b"\x0a", packed_size, packed, tail))
