"""A Hugging Face model id behind a real vLLM 0.32 engine, offline, from a Hub-layout cache the test builds.

``enginelink serve --engine vllm --model ORG/NAME`` with ``HF_HUB_OFFLINE=1``:
the servicer resolves the id to its cached snapshot and launches the engine
with that snapshot, as vLLM's own offline mode rewrites an id. vLLM on its own
(the offline ``LLM``) is given the same id from the same cache; greedy output
must be token-for-token equal. Nothing reaches the Hub.
"""

from __future__ import annotations

import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from enginelink.journal.records import KIND_ENGINE_HANDSHAKE
from enginelink.journal.store import open_reader
from enginelink.tools.test_model import hub_commit, place_in_hub_cache
from tests.harness import Servicer
from tests.vllm.conftest import ENGINE_ARGS, START_TIMEOUT_S, OfflineVllm
from tests.vllm.test_vllm_generate import generate

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = "enginelink-test/tiny"
PROMPTS = {"def": [318, 283, 1552, 10, 90, 305], "other": [5, 6, 7, 8, 9, 10, 11]}


def test_a_hub_id_serves_as_vllm_serves_it(tmp_path, test_model_dir, vllm_python, monkeypatch):
    cache = tmp_path / "hf-cache"
    snapshot = place_in_hub_cache(test_model_dir, cache, REPO)
    hub = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    for name, value in hub.items():
        monkeypatch.setenv(name, value)  # the offline LLM's environment too
    offline = OfflineVllm(vllm_python, REPO, tmp_path / "offline-llm.log")
    servicer = Servicer(tmp_path, extra=["--engine", "vllm", "--model", REPO], engine_args=ENGINE_ARGS,
                        env={"ENGINELINK_WARMUP": "off", **hub})
    try:
        servicer.start(timeout_s=START_TIMEOUT_S)
        info = servicer.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        assert (info.model_path, info.served_model_name, info.vocab_size) == (REPO, REPO, 4096)
        cases = [{"id": name, "prompt_token_ids": ids, "sampling": {"temperature": 0.0, "max_tokens": 16}}
                 for name, ids in PROMPTS.items()]
        theirs = offline.run(cases)
        for name, ids in PROMPTS.items():
            [mine] = generate(servicer, f"hub-{name}", ids, stream=False, temperature=0.0, max_tokens=16).values()
            assert mine["token_ids"] == theirs[name][0]["token_ids"], name
    finally:
        servicer.stop()
        offline.close()
    with open_reader(servicer.journal) as reader:
        [launch] = [r for r in reader.records() if r.kind == KIND_ENGINE_HANDSHAKE and r.payload["step"] == "launch"]
    argv = launch.payload["message"]["argv"]
    assert argv[argv.index("--model") + 1] == str(snapshot) and snapshot.name == hub_commit(REPO)
