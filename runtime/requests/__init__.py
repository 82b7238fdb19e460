"""Requests, contract-neutral: the Generate loop, the hub that executes the request core, limits, inputs, Embed."""
