"""Requests: validation, the hub that executes the request core, per-contract edges, request fields."""
