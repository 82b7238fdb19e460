"""Lifetime, the composition root (nothing imports it): compose, serve, the contract table, warm-up, drain."""
