"""The engine: its process, launch, release checks, the ZMQ link and its handshake gate."""
