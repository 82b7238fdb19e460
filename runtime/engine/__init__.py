"""The engine: its process, the launch recipes' common part, the link, its transports and supervision."""
