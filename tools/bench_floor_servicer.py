"""``enginelink bench --against grpclib-floor``: what the gRPC stack alone costs per token.

Theory of operation. The design card binds enginelink to grpclib (pure-Python HTTP/2 through h2,
hpack and protobuf) under trio-asyncio. This servicer is that stack and nothing else: stock grpclib on
a stock ``trio_asyncio`` loop (nothing of enginelink's runtime is imported), serving the ``VllmEngine``
contract with no engine behind it. Each Generate streams its ``max_tokens`` tokens (0, 1, 2, ...) in
``--messages`` chunks of nearly equal size, then its complete. There is no validation, journal, ZeroMQ, state machine or accounting.

Its CPU per token is the floor for a servicer built on grpclib, at the same calls and chunking:
- what enginelink spends above it is enginelink's own work (its engine link, journal, machines,
  validation), less whatever its own fast paths (``runtime/rpc/fastpath.py``) save on grpclib's;
- a servicer that spends less than this floor has a faster HTTP/2 stack than grpclib.

``tools/bench_refs.py`` runs it as an arm after enginelink in each repetition, with the messages per
call enginelink sent in that repetition, so both send the same number of messages per call.

One setting is not stock. h2 advertises SETTINGS_MAX_CONCURRENT_STREAMS 100; this servicer advertises
``--max-streams`` (the bench passes enginelink's), so the bench's one-connection load client can open
``--concurrency`` streams. (That client does not queue streams at the server's limit, and h2 resets a
connection that goes over it.)
"""

from __future__ import annotations

import argparse

MESSAGES_DEFAULT = 4
MAX_STREAMS_DEFAULT = 1024


def _allow_streams(limit: int) -> None:
    """grpclib builds its ``H2Connection`` from ``grpclib.protocol``'s name: give it one that advertises ``limit``."""
    import grpclib.protocol
    from h2.connection import H2Connection
    from h2.settings import SettingCodes, Settings

    class FloorH2Connection(H2Connection):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            # h2's own initial settings, with the limit in place of its 100: the first SETTINGS frame says it.
            self.local_settings = Settings(client=self.config.client_side, initial_values={
                SettingCodes.MAX_CONCURRENT_STREAMS: limit,
                SettingCodes.MAX_HEADER_LIST_SIZE: self.DEFAULT_MAX_HEADER_LIST_SIZE,
            })

    grpclib.protocol.H2Connection = FloorH2Connection


def chunk_sizes(total: int, messages: int) -> list[int]:
    """``total`` tokens in ``messages`` chunks (fewer if there are fewer tokens), sizes differing by at most one."""
    count = max(1, min(messages, total))
    base, extra = divmod(total, count)
    return [base + 1] * extra + [base] * (count - extra) if total else []


def build_service(messages: int, model_name: str, max_num_seqs: int):
    from smg_grpc_proto.generated import vllm_engine_pb2 as pb

    from enginelink.proto.vllm_engine_grpc import VllmEngineBase

    class FloorEngine(VllmEngineBase):
        async def Generate(self, stream) -> None:
            request = await stream.recv_message()
            total = request.sampling_params.max_tokens
            prompt = len(request.tokenized.input_ids)
            sent = 0
            for size in chunk_sizes(total, messages):
                ids = list(range(sent, sent + size))
                sent += size
                await stream.send_message(pb.GenerateResponse(chunk=pb.GenerateStreamChunk(
                    token_ids=ids, prompt_tokens=prompt, completion_tokens=sent)))
            await stream.send_message(pb.GenerateResponse(complete=pb.GenerateComplete(
                output_ids=list(range(total)), finish_reason="length", prompt_tokens=prompt,
                completion_tokens=total)))

        async def GetModelInfo(self, stream) -> None:
            await stream.recv_message()
            await stream.send_message(pb.GetModelInfoResponse(
                served_model_name=model_name, is_generation=True, max_context_length=4096, vocab_size=32000))

        async def GetServerInfo(self, stream) -> None:
            await stream.recv_message()
            await stream.send_message(pb.GetServerInfoResponse(server_type="grpclib-floor", max_num_seqs=max_num_seqs))

    # The contract's other methods: the bench does not call them, so UNIMPLEMENTED is the answer.
    for name in ("Embed", "HealthCheck", "FlushCache", "StartProfile", "StopProfile", "Abort", "GetLoads",
                 "GetTokenizer", "SubscribeKvEvents"):
        setattr(FloorEngine, name, _unimplemented)
    FloorEngine.__abstractmethods__ = frozenset()
    return FloorEngine()


async def _unimplemented(self, stream) -> None:
    from grpclib.const import Status
    from grpclib.exceptions import GRPCError

    raise GRPCError(Status.UNIMPLEMENTED, "grpclib-floor answers Generate, GetModelInfo and GetServerInfo only")


async def serve(port: int, messages: int, max_num_seqs: int) -> None:
    from grpclib.health.service import Health
    from grpclib.server import Server

    service = build_service(messages, "grpclib-floor", max_num_seqs)
    server = Server([service, Health({service: []})])
    await server.start("127.0.0.1", port)
    print(f"grpclib-floor serving on 127.0.0.1:{port}, {messages} chunk messages per call", flush=True)
    await server.wait_closed()


def main(argv: list[str] | None = None) -> None:
    import signal

    import trio
    import trio_asyncio

    parser = argparse.ArgumentParser(prog="bench_floor_servicer", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--messages", type=int, default=MESSAGES_DEFAULT, help="chunk messages per call")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="what GetServerInfo says")
    parser.add_argument("--max-streams", type=int, default=MAX_STREAMS_DEFAULT,
                        help="SETTINGS_MAX_CONCURRENT_STREAMS advertised (the bench passes enginelink's)")
    args = parser.parse_args(argv)
    if args.messages < 1 or args.max_streams < 1:
        parser.error("--messages and --max-streams must be >= 1")
    _allow_streams(args.max_streams)

    async def run() -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio_asyncio.open_loop(), trio.open_nursery() as nursery:
                nursery.start_soon(trio_asyncio.aio_as_trio(serve), args.port, args.messages, args.max_num_seqs)
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    return

    trio.run(run)


if __name__ == "__main__":
    main()
