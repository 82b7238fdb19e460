"""gRPC: the services, the transport and its fast path, connection limits, the asyncio loop."""
