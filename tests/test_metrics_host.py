"""Where /metrics binds: ``--metrics-host``, else ``SMG_VLLM_SERVICER_METRICS_HOST``, else the gRPC ``--host``.

The reference servicer binds its metrics listener beside the gRPC one when no
metrics host is given, so a scraper in another pod reaches both (``vllm serve
--grpc`` binds 0.0.0.0). These tests bind loopback addresses other than
127.0.0.1 (all of 127/8 is loopback on Linux) to tell the hosts apart.
"""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from tests.harness import Servicer, free_port, wait_until

OTHER_LOOPBACK = "127.0.0.2"


def answers(host: str, port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=2) as reply:
            return reply.status == 200
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


def serving_metrics(tmp_path, test_model_dir, extra: list[str], env: dict[str, str] | None = None):
    metrics_port = free_port()
    servicer = Servicer(tmp_path, model_dir=test_model_dir, env={"ENGINELINK_WARMUP": "off", **(env or {})},
                        extra=["--host", OTHER_LOOPBACK, "--metrics-port", str(metrics_port), *extra])
    # The harness's health wait dials 127.0.0.1; this servicer listens on OTHER_LOOPBACK only.
    servicer.start(wait_serving=False)
    return servicer, metrics_port


@pytest.mark.process
def test_the_metrics_host_defaults_to_the_grpc_host(tmp_path, test_model_dir):
    servicer, port = serving_metrics(tmp_path, test_model_dir, [])
    try:
        wait_until(lambda: answers(OTHER_LOOPBACK, port) or servicer.process.poll() is not None, 30,
                   "/metrics on the gRPC host")
        assert servicer.process.poll() is None, servicer.log()[-3000:]
        assert answers(OTHER_LOOPBACK, port)
        assert not answers("127.0.0.1", port)  # not the old fixed default
    finally:
        servicer.stop()


@pytest.mark.process
@pytest.mark.parametrize("how", ["flag", "variable"])
def test_an_explicit_metrics_host_wins_over_the_grpc_host(tmp_path, test_model_dir, how):
    extra, env = (["--metrics-host", "127.0.0.1"], {}) if how == "flag" else \
        ([], {"SMG_VLLM_SERVICER_METRICS_HOST": "127.0.0.1"})
    servicer, port = serving_metrics(tmp_path, test_model_dir, extra, env)
    try:
        wait_until(lambda: answers("127.0.0.1", port) or servicer.process.poll() is not None, 30,
                   "/metrics on the explicit host")
        assert servicer.process.poll() is None, servicer.log()[-3000:]
        assert answers("127.0.0.1", port)
        assert not answers(OTHER_LOOPBACK, port)
    finally:
        servicer.stop()
