"""Lifetime: composition, serve, warm-up, drain, readiness, metrics, snapshots."""
