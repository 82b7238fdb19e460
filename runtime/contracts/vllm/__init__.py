"""vLLM's contract (``vllm.grpc.engine.VllmEngine``): edge, service, facts, PD, profiling, launch, release check."""
