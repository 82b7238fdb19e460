"""KV events and loads: the relay's shell, its config, the load window, its metrics."""
