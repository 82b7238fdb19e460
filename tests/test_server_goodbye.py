"""A stopping server says GOAWAY on every connection once its handlers ended, then closes it.

Between the gRPC front's close and the process's exit (the journal's last
flush, the interpreter's shutdown) nothing answers on a connection left open:
CI at load 15 once saw a late call on the test's open channel wait out its
5 s deadline there (DEADLINE_EXCEEDED) instead of hearing UNAVAILABLE, which
the router retries on another worker. Here the real ``GrpcServer`` on
loopback (``tests/grpc_pair.py``), a real grpcio client, and the event loop
held still after the close the way an exiting process holds it.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import trio
import trio_asyncio
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from enginelink.runtime.engine.model_dir import load_tokenizer, read_model_facts
from tests.adversarial.h2_client import HEALTH_CHECK, H2Client
from tests.grpc_pair import grpc_pair
from tests.harness import generate_request

PROMPT = [318, 283, 1552, 10, 90, 305]
HELD_S = 3.0  # how long the "exit" keeps the loop from running
LATE_DEADLINE_S = 2.0  # shorter than HELD_S: an unanswered call runs out of it


@pytest.fixture(scope="module")
def model(test_model_dir):
    facts = read_model_facts(test_model_dir)
    return facts, load_tokenizer(facts.tokenizer_path)


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast-path", "grpclib"])
async def test_a_call_after_the_close_is_unavailable_at_once_while_the_process_exits(model, fast_path):
    facts, tokenizer = model
    async with grpc_pair(facts, tokenizer, fast_path=fast_path) as pair:
        channel = grpc.insecure_channel(f"127.0.0.1:{pair.port}")
        try:
            stub = pb_grpc.VllmEngineStub(channel)
            served = await trio.to_thread.run_sync(
                lambda: list(stub.Generate(generate_request("before", PROMPT, max_tokens=2), timeout=10)))
            assert served[-1].HasField("complete")  # the channel's connection is up and used

            pair.server.close()
            await trio_asyncio.aio_as_trio(pair.server.wait_closed)()
            await trio.sleep(0.2)  # let the loop write and close what the close asked for

            outcome: dict = {}

            def late_call() -> None:
                started = time.monotonic()
                try:
                    list(stub.Generate(generate_request("late", PROMPT, max_tokens=2), timeout=LATE_DEADLINE_S))
                    outcome["code"] = grpc.StatusCode.OK
                except grpc.RpcError as error:
                    outcome["code"] = error.code()
                outcome["took"] = time.monotonic() - started

            caller = threading.Thread(target=late_call)
            caller.start()
            time.sleep(HELD_S)  # the rest of an exit: this process's loop answers nothing now
            caller.join(10)
        finally:
            channel.close()
    assert outcome["code"] == grpc.StatusCode.UNAVAILABLE, outcome
    assert outcome["took"] < LATE_DEADLINE_S, outcome


async def test_every_open_connection_hears_goaway_no_error_before_it_closes(model):
    facts, tokenizer = model
    async with grpc_pair(facts, tokenizer, fast_path=True) as pair:
        clients = [H2Client(pair.port) for _ in range(2)]
        try:
            for client in clients:  # each connection has served a call: its last stream is 1
                call = client.start(HEALTH_CHECK, b"\x00\x00\x00\x00\x00")
                await trio.to_thread.run_sync(client.finish, call)
                assert call.status == 0
            pair.server.close()
            await trio_asyncio.aio_as_trio(pair.server.wait_closed)()
            for client in clients:
                await trio.to_thread.run_sync(lambda c=client: c.wait(lambda: c.closed, 5, "the close"))
                assert client.goaway is not None, "closed without GOAWAY"
                assert (client.goaway.error_code, client.goaway.last_stream_id, client.goaway.additional_data) == \
                    (0, 1, b"stopping")
        finally:
            for client in clients:
                client.close()
