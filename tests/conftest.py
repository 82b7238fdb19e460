"""Shared fixtures (the test model, a running servicer) and how the suite spreads over workers.

``tools/run-tests`` runs the suite on pytest-xdist workers (``-n N --dist
loadscope``); a plain ``pytest tests/...`` runs in one process, as before.
The suite waits far more than it computes (processes starting and stopping,
engines stepping at a set pace, bounded waits for a condition), so a few
workers per core overlap those waits. What one worker runs in a row (a
"scope", ``ModuleScopes`` below):

- each test module, whole: a module-scoped servicer starts once, on one
  worker, exactly as in a serial run; except the simulation's seed sweeps,
  spread in chunks of ``SEED_CHUNK`` seeds (they share a session fixture only);
- the real-engine modules in a few scopes of their own (``ENGINE_SCOPES``):
  the modules on a session's shared engine (``vllm_stack``, ``mlx_stack``) in
  one scope per engine, so that engine starts once; the vLLM modules that
  start their own engines (death, drain, DP, PD, pooling, launchers) in
  another, so those engines run one at a time beside the shared one (at most
  two vLLM engine sets at once: ~2.5 GB each, on a 24 GB box). A test marked
  ``vllm`` outside the vLLM scopes, or one on a shared stack outside its
  scope, fails the collection, so the lists cannot drift.
- the scheduler hands the real-engine scopes out first, the heaviest first
  (each is minutes of engine starts, in a row): the rest of the suite fills
  the other workers around them, and ``tools/run-tests`` gives each of them
  a worker on top of the twice-the-CPUs it runs the rest on.

The scopes are set by node id, not by ``xdist_group`` marks: pytest 9.2's
structured node ids make xdist 3.8's ``loadgroup`` ignore the marks
(pytest-dev/pytest-xdist#1386).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest
from filelock import FileLock

from enginelink.tools.test_model import make_test_model
from tests import fast_loop
from tests.harness import Servicer, reap_stopped, shared

# The real-engine scopes, in the order the scheduler hands them out (the longest first).
# A module belongs to the scope with the longest prefix of its path. (scope, module prefixes, the
# session fixtures that must stay inside it: a test on one elsewhere would start a second engine.)
VLLM_SHARED_SCOPE = "real vLLM: the session's engine"
VLLM_OWN_SCOPE = "real vLLM: own engines"
# The vision, video and audio models' engines (minutes on CPU: their encoders) run beside the other two
# scopes, one at a time.
VLLM_VISION_SCOPE = "real vLLM: vision"
# (The video and audio module on a worker of its own ran its models' engines and offline references beside
# the image modules': the kernel's OOM killer took two vLLM workers on the 24 GB box. One at a time.)
# vLLM 0.28.0 (the oldest release supported): one module on one engine and its offline reference,
# each with a 64 MiB KV cache, started and stopped within the module (a few minutes, beside the rest);
# then, on the same worker, the engine-restart module (its engine killed and started again under four
# streams) and two modules of engines of their own (a pooling model, a Hub id): one engine set at a time.
# Those two were the own-engines scope's, which alone ran from the suite's first second to its last (1,285 s
# of 1,330 on 2026-12-07, its last four minutes with the box a third idle), while this one ended at 391 s
# (its restart test has taken 110-570 s); split so, the two chains are about 890 and 780-1,250 s. The
# lifecycle module (kills and drains under load) joined this chain once its tests stopped depending on
# the box's pace (tests/vllm/conftest.py's StoppedEngine): at 59462ed the own-engines chain ended the
# suite at 1,206 s with it, this one at 911 without it, the box idle 11-40% in those last minutes.
VLLM_0_28_SCOPE = "real vLLM 0.28.0, engine restarts, pooling, Hub, lifecycle"
# MLX's engine and, after it on the same worker, the real SGLang launcher run up to the engine launch
# (no scheduler; minutes of SGLang imports). Apart, the two scopes were one more heavy worker on 2
# cores: three CI runs in a row then lost servicers that could not even bind their port in 60 s.
MLX_SCOPE = "real MLX, then the real SGLang launcher"
ENGINE_SCOPES = (
    (VLLM_OWN_SCOPE, ("tests/vllm/test_vllm_dp.py", "tests/vllm/test_vllm_launcher_plugin.py",
                      "tests/vllm/test_vllm_operator.py", "tests/vllm/test_vllm_pd.py",
                      "tests/wire/test_vllm_logprobs.py"), ()),
    (VLLM_VISION_SCOPE, ("tests/vllm/test_vllm_vision.py", "tests/vllm/test_vllm_av.py", "tests/wire/test_vllm_mm.py",
                         "tests/vllm/test_vllm_media_sidecar.py"), ("vision_model", "vision_offline")),
    (VLLM_SHARED_SCOPE, ("tests/vllm/",), ("vllm_stack", "vllm_quiet")),
    (MLX_SCOPE, ("tests/mlx/", "tests/sglang/"), ("mlx_stack",)),
    (VLLM_0_28_SCOPE, ("tests/vllm_0_28/", "tests/vllm/test_vllm_resume.py", "tests/vllm/test_vllm_embed.py",
                       "tests/vllm/test_vllm_hub.py", "tests/vllm/test_vllm_lifecycle.py"), ("vllm_0_28",)),
)
VLLM_SCOPES = (VLLM_SHARED_SCOPE, VLLM_OWN_SCOPE, VLLM_VISION_SCOPE, VLLM_0_28_SCOPE)
# The simulation's seed sweeps (tests/sim: 400 seeds a module, each a second or so of CPU, on
# a session fixture only): one scope per SEED_CHUNK seeds, so one module's sweep is not one
# worker's minutes-long tail while the other workers are idle.
SEED_CHUNK = 100
SEED_PARAM = re.compile(r"\[seed=(\d+)\]$")


def scope_of(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    # The longest prefix that matches decides (a module named outright beats its folder's scope).
    matches = [(len(prefix), scope) for scope, prefixes, _ in ENGINE_SCOPES for prefix in prefixes
               if module.startswith(prefix)]
    if matches:
        return max(matches)[1]
    if module.startswith("tests/sim/") and (seed := SEED_PARAM.search(nodeid)):
        return f"{module} seeds {int(seed.group(1)) // SEED_CHUNK * SEED_CHUNK}+"
    return module


def pytest_addoption(parser):
    fast_loop.add_option(parser)


def pytest_configure(config):
    fast_loop.configure(config)


def pytest_collection_modifyitems(config, items):
    fast_loop.select(config, items)  # --fast: the tests that start no process (tests/fast_loop.py)
    stray = [item.nodeid for item in items if item.get_closest_marker("vllm") and scope_of(item.nodeid) not in VLLM_SCOPES]
    if stray:
        raise pytest.UsageError(f"tests marked vllm outside tests/conftest.py's vLLM scopes: {stray[:5]}")
    for scope, _, stacks in ENGINE_SCOPES:
        elsewhere = [item.nodeid for item in items
                     if set(stacks) & set(getattr(item, "fixturenames", ())) and scope_of(item.nodeid) != scope]
        if elsewhere:
            raise pytest.UsageError(f"tests on {stacks} outside their scope {scope!r} (tests/conftest.py's "
                                    f"ENGINE_SCOPES; elsewhere they would start a second engine): {elsewhere[:5]}")


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown where xdist is off
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadscope":
        return None  # xdist's own
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScopes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

        def _assign_work_unit(self, node) -> None:
            # The real-engine scopes first, in ENGINE_SCOPES' order; the rest as xdist orders them.
            for scope, _, _ in reversed(ENGINE_SCOPES):
                if scope in self.workqueue:
                    self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return ModuleScopes(config, log)


# --fast: a test that starts a process fails (tests/fast_loop.py), whichever phase started it.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from fast_loop.watch(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from fast_loop.watch(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    return (yield from fast_loop.watch(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    fast_loop.fail_report(item, report)
    return report


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
