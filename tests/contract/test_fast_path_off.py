"""The contract suite's Generate and Abort tests again, served with ``ENGINELINK_FAST_PATH=0``.

The whole suite runs either way: ``tests/harness.Servicer`` passes the
environment on, so ``ENGINELINK_FAST_PATH=0 pytest tests/contract`` serves
every test through grpclib's own send path. The default run (fast path on)
runs this module too: the two files that carry the streaming contract
(``test_generate.py``: deltas, completes, n > 1, stops, a client that reads
late; ``test_abort.py``: abort, cancel, deadlines mid-stream) are collected
here a second time, their ``servicer`` and ``slow_servicer`` replaced by
servicers with the fast path off. The other files send unary replies, which
the fast path never writes.
"""

from __future__ import annotations

import pytest

from tests.contract.helpers import SLOW_ENGINE_ARGS
from tests.contract.test_abort import *  # noqa: F403 - collected again, against the servicers below
from tests.contract.test_generate import *  # noqa: F403
from tests.harness import Servicer, free_port, generate_request, scrape

pytestmark = pytest.mark.process  # starts processes: not in the fast loop (tests/fast_loop.py)

OFF = {"ENGINELINK_FAST_PATH": "0"}


@pytest.fixture(scope="module")
def servicer(tmp_path_factory, test_model_dir):
    metrics_port = free_port()
    with Servicer(tmp_path_factory.mktemp("servicer-fast-path-off"), model_dir=test_model_dir,
                  extra=["--metrics-port", str(metrics_port)], env=OFF) as running:  # fmt: skip
        running.metrics_port = metrics_port
        yield running


@pytest.fixture(scope="module")
def slow_servicer(tmp_path_factory, test_model_dir):
    with Servicer(tmp_path_factory.mktemp("slow-servicer-fast-path-off"), model_dir=test_model_dir,
                  engine_args=SLOW_ENGINE_ARGS, env=OFF) as running:  # fmt: skip
        yield running


def test_the_servicer_says_its_fast_path_is_off_and_wrote_nothing_directly(servicer):
    replies = list(servicer.stub.Generate(generate_request("off-1", [5, 6, 7], stream=True, max_tokens=8), timeout=30))
    assert replies[-1].WhichOneof("response") == "complete"
    samples = {name.split("{")[0]: value for name, value in scrape(servicer.metrics_port).items()}
    assert samples["smg_servicer_grpc_fast_path"] == 0
    assert samples["smg_servicer_link_direct_writes"] == 0
    assert samples["smg_servicer_grpc_direct_headers"] == 0 and samples["smg_servicer_grpc_grpclib_headers"] == 0
