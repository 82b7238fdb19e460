"""TokenSpeed's contract (``tokenspeed.grpc.scheduler.TokenSpeedScheduler``): its edge, service and launch."""
