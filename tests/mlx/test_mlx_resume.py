"""Engine restarts on the real MLX engine (mlx-lm on CPU): the engine SIGKILLed under greedy streams (docs/resume.md).

The MLX engine speaks vLLM's headless wire through the same transport and
link as vLLM, so a restart is the same: the servicer starts the engine again
and re-submits each stream as its prompt plus the tokens it had. Each
completes with its full count and equals an uninterrupted run.
"""

from __future__ import annotations

import os
import signal

import pytest

from tests.harness import engine_pid, wait_until
from tests.mlx.conftest import START_TIMEOUT_S, mlx_request, mlx_servicer
from tests.test_lifecycle import StreamReader

pytestmark = pytest.mark.mlx

PROMPTS = [[318, 283, 1552, 10, 90, 305], [40, 1079, 257, 1332, 13, 198]]
TOKENS = 600


def _tokens(reader: StreamReader) -> list[int]:
    return [t for m in reader.messages if m.HasField("chunk") for t in m.chunk.token_ids]


def _streams(stub, prefix: str) -> list[StreamReader]:
    readers = [StreamReader(stub, mlx_request(f"{prefix}-{i}", prompt, stream=True, temperature=0.0,
                                              max_tokens=TOKENS, ignore_eos=True)) for i, prompt in enumerate(PROMPTS)]
    for reader in readers:
        reader.start()
    return readers


def test_engine_killed_under_greedy_streams_is_restarted_and_each_stream_equals_an_uninterrupted_run(
        tmp_path, test_model_dir, mlx_python):
    servicer = mlx_servicer(tmp_path, test_model_dir, env={"ENGINELINK_ENGINE_RESTARTS": "1"})
    servicer.start(timeout_s=START_TIMEOUT_S)
    try:
        reference = _streams(servicer.stub, "ref")
        for reader in reference:
            reader.join(300)
            assert reader.error is None and len(_tokens(reader)) == TOKENS, reader.error
        engine = engine_pid(servicer.journal)
        readers = _streams(servicer.stub, "s")
        wait_until(lambda: all(len(_tokens(reader)) >= 100 for reader in readers), 120, "two streams 100 tokens in",
                   interval_s=0.02)
        os.kill(engine, signal.SIGKILL)
        for reader in readers:
            reader.join(300)
        for reader, ref in zip(readers, reference):
            assert reader.error is None, f"{reader.request.request_id}: {reader.error}\n{servicer.log()[-3000:]}"
            assert _tokens(reader) == _tokens(ref)
        assert engine_pid(servicer.journal) != engine
    finally:
        servicer.stop()
