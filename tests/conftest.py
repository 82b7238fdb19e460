"""Shared fixtures: the test model (built once per run) and a running servicer."""

from __future__ import annotations

import pytest

from enginelink.tools.test_model import make_test_model
from tests.harness import Servicer, reap_stopped, shared


def pytest_sessionfinish(session, exitstatus):
    reap_stopped()  # servicers a fixture stopped without waiting: wait for them now


@pytest.fixture(scope="session")
def test_model_dir(tmp_path_factory):
    return make_test_model(tmp_path_factory.mktemp("model") / "tiny-test-model")


@pytest.fixture(scope="module")
def servicer(tmp_path_factory, test_model_dir):
    """One ``enginelink serve`` on the sim engine, shared by a test module."""
    with shared(Servicer(tmp_path_factory.mktemp("servicer"), model_dir=test_model_dir)) as running:
        yield running
