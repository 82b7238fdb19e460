"""The contracts, one wing each (vllm, sglang, tokenspeed, mlx: edge, service, launch, facts), and what they share."""
