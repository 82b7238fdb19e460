"""The gRPC front: the transport and its fast path, connection limits, the asyncio loop, reflection."""
