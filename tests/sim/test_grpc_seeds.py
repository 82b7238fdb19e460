"""Simulation seeds' traffic through the real gRPC layer, with the fast path on and off.

``tests/sim`` drives ``runtime.generate.generate`` in memory on trio's
MockClock: it never runs grpclib, h2 or ``runtime/rpc/fastpath.py``. Here the
client plans of ``GRPC_SEEDS`` (seeds of the sweep with the most traffic)
run three ways against the same in-memory sim engine (``tests/grpc_pair.py``),
each on a fresh servicer:

- ``memory``: ``generate`` called directly, as ``tests/sim`` calls it;
- ``fast``: over one HTTP/2 connection on loopback (grpclib's client, as the
  router multiplexes every call over one), served with ``ENGINELINK_FAST_PATH`` on;
- ``grpclib``: the same, with it off (grpclib's own send path).

All three must give every call the same outcome: the same status (OK, or
INVALID_ARGUMENT for the plans drawn invalid, and nothing else), and per
choice the same token ids and the same complete (finish reason, counts,
matched stop), chunk boundaries and prefix-cache hits aside (they follow
timing). What is left out of the seed's run, and why: its timing (arrivals,
the engine's cost model, wire latency; real time here, every call sent at
once), its clients that go away, read slowly, retry or reuse an id (their
outcome depends on timing), its Abort RPCs, engine faults, warm-up and
SIGTERM (the in-memory suite covers those, on MockClock).
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import trio
import trio_asyncio
from grpclib.client import Channel
from grpclib.exceptions import GRPCError
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from enginelink.proto.vllm_engine_grpc import VllmEngineStub
from enginelink.runtime.errors import ServicerError
from enginelink.runtime.contracts.vllm.edge import VLLM_EDGE
from enginelink.runtime.requests.generate import generate
from enginelink.runtime.context.submit import TrioWake
from tests.grpc_pair import grpc_pair
from tests.sim.scenario import scenario

# Seeds of the default sweep (0..399) with 40 clients, the most a scenario draws.
GRPC_SEEDS = tuple(seed for seed in range(400) if len(scenario(seed).clients) == 40)[:3]
WAIT_S = 60.0


def plans(seed: int):
    return [p for p in scenario(seed).clients if p.duplicate_of is None and p.cancel_after_s is None and not p.retries]


def outcome(status: str, messages) -> tuple:
    tokens: dict[int, list[int]] = {}
    completes: dict[int, bytes] = {}
    for message in messages:
        if message.WhichOneof("response") == "chunk":
            tokens.setdefault(message.chunk.index, []).extend(message.chunk.token_ids)
        else:
            complete = pb.GenerateComplete()
            complete.CopyFrom(message.complete)
            complete.ClearField("cached_tokens")
            if message.complete.index in tokens:  # streaming: output_ids repeat the last chunk
                del complete.output_ids[:]
            assert complete.index not in completes, "two completes for one choice"
            completes[complete.index] = complete.SerializeToString(deterministic=True)
    return status, sorted(tokens.items()), sorted(completes.items())


async def run_memory(pair, requests) -> list[tuple]:
    results: list = [None] * len(requests)

    async def one(i: int, request) -> None:
        messages: list = []

        async def send(message) -> None:
            messages.append(message)

        try:
            await generate(pair.app, request, wake=TrioWake(), send=send, edge=VLLM_EDGE)
            results[i] = outcome("OK", messages)
        except ServicerError as error:
            results[i] = outcome(error.status.name, [])

    async with trio.open_nursery() as nursery:
        for i, request in enumerate(requests):
            nursery.start_soon(one, i, request)
    return results


async def run_grpc(pair, requests) -> list[tuple]:
    async def all_calls() -> list[tuple]:
        channel = Channel("127.0.0.1", pair.port)
        stub = VllmEngineStub(channel)

        async def one(request) -> tuple:
            try:
                async with stub.Generate.open() as stream:
                    await stream.send_message(request, end=True)
                    return outcome("OK", [message async for message in stream])
            except GRPCError as error:
                return outcome(error.status.name, [])

        try:
            return list(await asyncio.gather(*(one(request) for request in requests)))
        finally:
            channel.close()

    return await trio_asyncio.aio_as_trio(all_calls)()


@pytest.mark.parametrize("grpc_seed", GRPC_SEEDS, ids=[f"seed={s}" for s in GRPC_SEEDS])
async def test_a_seeds_traffic_gets_the_same_answers_in_memory_and_over_grpc_both_ways(grpc_seed, sim_model):
    model, tokenizer = sim_model
    sc = scenario(grpc_seed)
    sim = msgspec.structs.replace(sc.sim, step_us=0.0, prefill_us_per_token=0.0)
    kept = plans(grpc_seed)
    requests = [plan.request() for plan in kept]
    results = {}
    for way in ("memory", "fast", "grpclib"):
        async with grpc_pair(model, tokenizer, fast_path=way == "fast", sim=sim) as pair:
            with trio.fail_after(WAIT_S):
                results[way] = await (run_memory if way == "memory" else run_grpc)(pair, requests)
            assert not pair.hub.calls, f"{way}: calls left in the hub"
            if way == "fast":
                assert any(p.stream for p in kept) <= (pair.hub.direct_writes > 0)
            if way == "grpclib":
                assert pair.hub.direct_writes == 0
    for plan, memory, fast, slow in zip(kept, results["memory"], results["fast"], results["grpclib"]):
        assert memory[0] == ("INVALID_ARGUMENT" if plan.bad else "OK"), (plan, memory)
        assert fast == memory, f"seed {grpc_seed}, client {plan.index}: fast path differs from generate()"
        assert slow == memory, f"seed {grpc_seed}, client {plan.index}: grpclib's path differs from generate()"
