"""Helpers of the attack suite: a servicer with small limits, its RSS, its /metrics."""

from __future__ import annotations

from tests.harness import Servicer, free_port, scrape


def limited_servicer(tmp, model_dir, env: dict[str, str]) -> Servicer:
    """``enginelink serve`` on the sim engine, no warm-up, a metrics endpoint, ``env`` on top."""
    port = free_port()
    servicer = Servicer(tmp, model_dir=model_dir, extra=["--metrics-port", str(port)],
                        env={"SMG_VLLM_SERVICER_WARMUP": "off", "ENGINELINK_DRAIN_SECS": "0.2", **env})  # fmt: skip
    servicer.metrics_port = port
    return servicer


def metric(servicer: Servicer, name: str) -> float:
    """The value of the one sample of ``name`` (labels ignored)."""
    values = [value for key, value in scrape(servicer.metrics_port).items() if key.split("{")[0] == name]
    assert len(values) == 1, f"{name}: {values}"
    return values[0]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")
