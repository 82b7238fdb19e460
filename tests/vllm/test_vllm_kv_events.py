"""KV events from a real vLLM 0.32 engine on CPU, through enginelink's relay (issue 5).

``enginelink serve --engine vllm`` with no KV flag turns vLLM's publisher on
(ipc sockets in the private socket directory) and relays it: a subscriber
from 0 receives BlockStored events whose token ids and parent chain match
the prompts sent (longer than one block: vLLM's CPU block size is 128), and
a FlushCache produces a cleared event (vLLM publishes it with its next step).
On the session's ``vllm_quiet`` (tests/vllm/conftest.py): no warm-up, so its
history holds only the tests' batches, from batch 0 (the sim suite covers the
warm-up's ordering); the constraint tests that share it send a few hundred
batches at most, far below the history bound (10,000). Skipped, with the
reason, when there is no vLLM installation (``tools/setup-vllm``), unless
``ENGINELINK_REQUIRE_VLLM=1``.
"""

from __future__ import annotations

import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2 as pb

from tests.kv.conftest import sequence_base
from tests.kv.kv_client import Chain, KvSubscription, generate, prompt

pytestmark = pytest.mark.vllm


@pytest.fixture
def vllm_kv(vllm_quiet):
    return vllm_quiet


def test_vllm_block_stored_events_carry_the_prompts_and_their_chain(vllm_kv):
    block = vllm_kv.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).block_size
    assert block > 0
    p1 = prompt(501, 2 * block + 10)
    p2 = p1[:block] + prompt(502, block + 3)  # shares p1's first block
    generate(vllm_kv, "kv-vllm-1", p1)
    with KvSubscription(vllm_kv, 0) as sub:
        sub.wait(lambda s: Chain().apply(s.kv_batches()).prefix_of(p1, block) == 2, 60, "p1's two blocks")
        batches = sub.kv_batches()
        assert batches[0].sequence_number == sequence_base(vllm_kv)  # the whole history, from vLLM's batch 0
        assert all(b.dp_rank == 0 and b.HasField("load") for b in batches)
        chain = Chain().apply(batches)
        first = next(h for h, (parent, tokens) in chain.blocks.items() if tokens == tuple(p1[:block]))
        assert chain.blocks[first][0] is None
        second = next(h for h, (parent, tokens) in chain.blocks.items() if tokens == tuple(p1[block : 2 * block]))
        assert chain.blocks[second][0] == first
        stored = [e.stored for b in batches for e in b.events if e.WhichOneof("data") == "stored"]
        assert all(s.tier == common_pb2.KV_CACHE_TIER_DEVICE for s in stored)
        assert all(blk.block_size == block for s in stored for blk in s.blocks)

        seen = len(batches)
        generate(vllm_kv, "kv-vllm-2", p2)
        sub.wait(lambda s: Chain().apply(s.kv_batches()).prefix_of(p2, block) == 2, 60, "p2's second block")
        new = [e.stored for b in sub.kv_batches()[seen:] for e in b.events if e.WhichOneof("data") == "stored"]
        mine = [s for s in new if any(tuple(blk.token_ids) == tuple(p2[block : 2 * block]) for blk in s.blocks)]
        assert len(mine) == 1 and mine[0].parent_block_hash == first  # only the new block, under p1's first

        sub.caught_up(30)
        reply = vllm_kv.stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=10), timeout=60)
        assert reply.success, reply.message
        seen = len(sub.kv_batches())
        generate(vllm_kv, "kv-vllm-3", prompt(503, block + 1))  # vLLM publishes the clear with its next step
        sub.wait(lambda s: any(e.WhichOneof("data") == "cleared" for b in s.kv_batches()[seen:] for e in b.events),
                 60, "a cleared event")  # fmt: skip
        assert Chain().apply(sub.kv_batches()).prefix_of(p1, block) == 0
