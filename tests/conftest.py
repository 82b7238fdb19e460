"""Shared fixtures (the test model, a running servicer) and how the suite spreads over workers.

``tools/run-tests`` runs the suite on pytest-xdist workers (``-n N --dist
loadscope``); a plain ``pytest tests/...`` runs in one process, as before.
The suite waits far more than it computes (processes starting and stopping,
engines stepping at a set pace, bounded waits for a condition), so a few
workers per core overlap those waits. What one worker runs in a row (a
"scope", ``ModuleScopes`` below):

- each test module, whole: a module-scoped servicer starts once, on one
  worker, exactly as in a serial run;
- every module of ``VLLM_MODULES`` together, on one worker: the real vLLM
  engines run one after another as in a serial run (the session's
  ``vllm_stack`` starts once, and no two vLLM engines compete for memory).
  A test marked ``vllm`` outside these modules fails the collection.

The scopes are set by node id, not by ``xdist_group`` marks: pytest 9.2's
structured node ids make xdist 3.8's ``loadgroup`` ignore the marks
(pytest-dev/pytest-xdist#1386).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from filelock import FileLock

from enginelink.tools.test_model import make_test_model
from tests.harness import Servicer, reap_stopped, shared

# The modules with real-vLLM tests: one scope, one worker, one engine at a time.
VLLM_MODULES = ("tests/vllm/", "tests/kv/test_kv_vllm.py", "tests/wire/test_vllm_logprobs.py", "tests/wire/test_vllm_mm.py")
VLLM_SCOPE = "real vLLM"
# The real MLX engine's modules likewise run one after another on one worker.
MLX_MODULES = ("tests/mlx/",)
MLX_SCOPE = "real MLX"


def scope_of(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    if module.startswith(VLLM_MODULES):
        return VLLM_SCOPE
    return MLX_SCOPE if module.startswith(MLX_MODULES) else module


def pytest_collection_modifyitems(config, items):
    stray = [item.nodeid for item in items if item.get_closest_marker("vllm") and scope_of(item.nodeid) != VLLM_SCOPE]
    if stray:
        raise pytest.UsageError(f"tests marked vllm outside tests/conftest.py's VLLM_MODULES: {stray[:5]}")


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown where xdist is off
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadscope":
        return None  # xdist's own
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScopes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    return ModuleScopes(config, log)


def pytest_sessionfinish(session, exitstatus):
    reap_stopped()  # servicers a fixture stopped without waiting: wait for them now


@pytest.fixture(scope="session")
def test_model_dir(tmp_path_factory):
    """The tiny test model, built once per run: xdist workers share the first one's build."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each worker's own
    with FileLock(str(root / "tiny-test-model.lock")):
        return make_test_model(root / "tiny-test-model")


@pytest.fixture(scope="module")
def servicer(tmp_path_factory, test_model_dir):
    """One ``enginelink serve`` on the sim engine, shared by a test module."""
    with shared(Servicer(tmp_path_factory.mktemp("servicer"), model_dir=test_model_dir)) as running:
        yield running


@pytest.fixture
def socket_dir():
    """A private folder for ipc sockets, short wherever pytest's ``tmp_path`` is.

    An ipc path must fit sockaddr_un's 107 bytes, and a test's ``tmp_path`` can
    be long (xdist adds a ``popen-gwN`` level, the test's name adds 30 bytes).
    """
    path = Path(tempfile.mkdtemp(prefix="el-sock-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
