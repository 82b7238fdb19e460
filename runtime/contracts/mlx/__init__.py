"""MLX's contract (``mlx.grpc.engine.MlxEngine``): its edge, service and launch."""
