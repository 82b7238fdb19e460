"""SGLang's contract (``sglang.grpc.scheduler.SglangScheduler``): its edge, service and launch."""
