"""Responses whose logprobs are serialized in slices (``runtime/requests/logprob_bytes.py``) are the messages
built at once, for every contract that carries logprobs, stamped ones included.

The pieces are protobuf's own serializations of part of the positions each,
joined under their fields' tags; the client parses one message. Compared
here by parsing: byte order differs (a packed field comes in several runs),
what the client reads does not.
"""

from __future__ import annotations

import array

import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sg_pb, tokenspeed_scheduler_pb2 as ts_pb
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb

from enginelink.machines.logprobs import SLICE_ENTRIES, LogprobRun, PromptLogprobs
from enginelink.machines.request_api import Chunk, Complete
from enginelink.runtime.contracts.sglang import edge as contract_sglang
from enginelink.runtime.contracts.tokenspeed import edge as contract_tokenspeed
from enginelink.runtime.contracts.vllm import edge as contract_vllm
from enginelink.runtime.contracts.shared.call_stamp import CallStamp
from enginelink.runtime.requests.logprob_bytes import LogprobBudget, SlicedResponse
from enginelink.runtime.rpc.codec import ServicerCodec

# (encode_chunk, encode_complete, the response class, carries prompt logprobs, top-k)
CONTRACTS = {
    "vllm": (contract_vllm.encode_chunk, contract_vllm.encode_complete, vllm_pb.GenerateResponse, True, True),
    "sglang": (contract_sglang.encode_chunk, contract_sglang.encode_complete, sg_pb.GenerateResponse, True, True),
    "tokenspeed": (contract_tokenspeed._chunk, contract_tokenspeed._complete, ts_pb.GenerateResponse, False, False),
}


def _runs(positions: int, top: int, first_token: int, pieces: int = 3) -> list[LogprobRun]:
    """``positions`` rows in ``pieces`` runs (one per engine output, as the core keeps them)."""
    cols = top + 1
    runs, row = [], 0
    for piece in range(pieces):
        rows = positions // pieces + (1 if piece < positions % pieces else 0)
        ids = array.array("i", [first_token + row + r if c == 0 else 200 + c for r in range(rows) for c in range(cols)])
        values = array.array("f", [-(row + r) / 16 - c / 4 for r in range(rows) for c in range(cols)])
        runs.append(LogprobRun(rows, cols, top, ids, values))
        row += rows
    return runs


def _messages(positions: int, top: int, with_prompt: bool):
    runs = _runs(positions, top, 7)
    tokens = [7 + i for i in range(positions)]
    prompt = PromptLogprobs(top, [3] + [50 + i for i in range(positions)], _runs(positions, top, 50)) \
        if with_prompt else None
    chunk = Chunk(2, tokens, positions + 1, 1, runs, top, prompt, completion_tokens=positions)
    complete = Complete(2, tokens, "length", positions + 1, 1, logprobs=runs, logprobs_top=top,
                        prompt_logprobs=prompt, completion_tokens=positions)
    return chunk, complete


@pytest.mark.parametrize("contract", sorted(CONTRACTS))
@pytest.mark.parametrize("positions, top", [(1, 20), (700, 20), (300, 0), (40, 4096)])
def test_sliced_responses_parse_as_the_message_built_at_once(contract, positions, top):
    encode_chunk, encode_complete, response_type, prompts, tops = CONTRACTS[contract]
    top = top if tops else 0
    chunk, complete = _messages(positions, top, prompts)
    for m, encode in ((chunk, encode_chunk), (complete, encode_complete)):
        whole = encode(m)  # no budget: built at once
        sliced = encode(m, LogprobBudget(0))  # no budget left: sliced
        assert type(sliced) is SlicedResponse
        steps = sum(1 for _ in sliced.steps())
        entries = positions * (top + 1) * (2 if prompts else 1)
        assert steps >= entries // SLICE_ENTRIES
        assert response_type.FromString(sliced.body) == whole
        # The stamped contracts' responses repeat the call's id: on bytes too.
        stamped = CallStamp("rid-1").stamp(sliced.body)
        if contract != "vllm":
            whole.request_id = "rid-1"
            assert response_type.FromString(stamped) == whole


def test_one_encode_fills_at_most_its_budget_and_slices_the_rest():
    """Several messages of one take: each is built at once while the budget lasts; the rest is sliced, in order."""
    small = _messages(10, 20, False)[0]  # 210 entries
    large = _messages(SLICE_ENTRIES, 20, True)[1]
    out = contract_vllm.encode([small, large, small])
    assert [type(m) is SlicedResponse for m in out] == [False, True, False]
    many = contract_vllm.encode([small] * (SLICE_ENTRIES // 210 + 2))
    assert type(many[0]) is not SlicedResponse and type(many[-1]) is SlicedResponse


def test_the_codec_passes_bytes_and_checks_messages():
    codec = ServicerCodec()
    assert codec.encode(b"\x0a\x00", vllm_pb.GenerateResponse) == b"\x0a\x00"
    message = vllm_pb.GenerateResponse()
    message.chunk.token_ids.append(5)
    assert codec.encode(message, vllm_pb.GenerateResponse) == message.SerializeToString()
    with pytest.raises(TypeError):
        codec.encode(vllm_pb.GenerateRequest(), vllm_pb.GenerateResponse)
