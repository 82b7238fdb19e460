"""Fixtures of the contract suite: a servicer whose engine is slow enough to catch mid-flight."""

from __future__ import annotations

import pytest

from tests.contract.helpers import SLOW_ENGINE_ARGS
from tests.harness import Servicer, shared


@pytest.fixture(scope="session")
def slow_servicer(tmp_path_factory, test_model_dir):
    """``enginelink serve`` on a sim engine that takes 20 ms per step, shared by the session.

    Tests using it leave it idle (``wait_idle``) so the next one starts from zero."""
    with shared(Servicer(tmp_path_factory.mktemp("slow-servicer"), model_dir=test_model_dir,
                         engine_args=SLOW_ENGINE_ARGS)) as running:
        yield running
