"""PD with a real vLLM 0.32 KV connector on CPU: a prefill servicer and a decode servicer sharing a store.

vLLM 0.32's ``ExampleConnector`` (``SharedStorageConnector`` before it was
renamed) is the one connector that runs on CPU without RDMA or an external
service: the prefill engine (``kv_producer``) saves each prompt's KV, layer by
layer, as safetensors files under ``shared_storage_path``, keyed by the
prompt's tokens; the decode engine (``kv_consumer``) finds them for the same
prompt, loads them instead of computing them, and reports them as cached
prompt tokens. It loads whole blocks of the prompt but the last token
(⌊(len - 1) / block⌋ blocks; the CPU block size is 128), and it ignores
``kv_transfer_params`` (a store connector: the legs meet in the store).

Two engine starts for the module, side by side. Warm-up is off: with this
connector vLLM's engine dies on a one-token prompt once any prompt shorter
than a block was stored (``align_to_block_size(0)`` is -128, docs/pd.md), and
the planned warm-up sends both.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from tests.harness import generate_request, wait_until
from tests.vllm.conftest import ENGINE_ARGS, START_TIMEOUT_S, vllm_servicer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CPU_BLOCK_SIZE = 128
PROMPT_TOKENS = 300
LOADED_TOKENS = (PROMPT_TOKENS - 1) // CPU_BLOCK_SIZE * CPU_BLOCK_SIZE  # 256
DECODE_TOKENS = 8
CALL_TIMEOUT_S = 120.0


def _prompt(seed: int) -> list[int]:
    return [3 + (seed * 7919 + i * 104729) % 4000 for i in range(PROMPT_TOKENS)]


def _serving(servicer) -> bool:
    if servicer.process.poll() is not None:
        raise RuntimeError(f"servicer exited with {servicer.process.returncode}:\n{servicer.log()[-4000:]}")
    health = health_pb2_grpc.HealthStub(servicer.channel)
    try:
        reply = health.Check(health_pb2.HealthCheckRequest(service="vllm.grpc.engine.VllmEngine"), timeout=1)
    except Exception:  # not listening yet
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def pd_pair(tmp_path_factory, test_model_dir, vllm_python):
    tmp = tmp_path_factory.mktemp("vllm-pd")
    store = tmp / "kv-store"
    store.mkdir()
    env = {"ENGINELINK_WARMUP": "off", "ENGINELINK_DRAIN_SECS": "0.5"}

    def leg(role: str):
        config = {"kv_connector": "ExampleConnector", "kv_role": role,
                  "kv_connector_extra_config": {"shared_storage_path": str(store)}}
        return vllm_servicer(tmp, test_model_dir, [*ENGINE_ARGS, "--kv-transfer-config", json.dumps(config)], env=env)

    prefill, decode = leg("kv_producer"), leg("kv_consumer")
    try:
        # Both load at once: a start costs ~20 s of CPU, more on a shared machine.
        prefill.start(wait_serving=False)
        decode.start(wait_serving=False)
        wait_until(lambda: _serving(prefill) and _serving(decode), START_TIMEOUT_S, "both legs SERVING")
        yield prefill, decode, store
    finally:
        prefill.stop()
        decode.stop()


def _greedy(servicer, rid: str, ids: list[int], max_tokens: int, **fields) -> pb.GenerateComplete:
    request = generate_request(rid, ids, temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for name, value in fields.items():
        setattr(request, name, value)
    (message,) = list(servicer.stub.Generate(request, timeout=CALL_TIMEOUT_S))
    return message.complete


def _folders(store: Path) -> set[Path]:
    return {path for path in store.iterdir() if path.is_dir()}


def test_each_leg_advertises_its_connector_role_and_engine_id(pd_pair):
    prefill, decode, _ = pd_pair
    p = prefill.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    d = decode.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert (p.kv_connector, p.kv_role) == ("ExampleConnector", "kv_producer")
    assert (d.kv_connector, d.kv_role) == ("ExampleConnector", "kv_consumer")
    # No engine_id configured: each engine made up its own (a uuid), and GetServerInfo knows it.
    assert len(p.kv_engine_id) == 36 and len(d.kv_engine_id) == 36 and p.kv_engine_id != d.kv_engine_id
    assert (p.block_size, p.kv_cache_dtype, p.model_dtype) == (d.block_size, d.kv_cache_dtype, d.model_dtype)


def test_the_decode_leg_loads_the_prefill_legs_kv_and_continues_it(pd_pair):
    prefill, decode, store = pd_pair
    ids = _prompt(1)
    params = json.dumps({"do_remote_decode": True})
    before = _folders(store)
    first = _greedy(prefill, "pd-prefill-1", ids, 1, kv_transfer_params_json=params)
    assert first.finish_reason == "length" and first.cached_tokens == 0
    assert len(_folders(store) - before) == 1, "the prefill leg stored the prompt's KV"
    # A store connector hands nothing back: the complete says nothing of KV transfer.
    assert not first.HasField("kv_transfer_params_json")

    decoded = _greedy(decode, "pd-decode-1", ids, DECODE_TOKENS,
                      kv_transfer_params_json=json.dumps({"do_remote_prefill": True}))
    assert decoded.cached_tokens == LOADED_TOKENS, "the decode engine never saw this prompt: its KV came from the store"
    # The prefill engine's own greedy continuation of the same prompt.
    whole = _greedy(prefill, "pd-prefill-1-whole", ids, DECODE_TOKENS)
    assert list(decoded.output_ids) == list(whole.output_ids)
    assert decoded.output_ids[0] == first.output_ids[0]


def test_the_decode_leg_computes_with_the_stored_kv_not_its_own(pd_pair, vllm_python):
    """Scale the stored KV: the decode leg's output must change, so it attends to what it loaded."""
    prefill, decode, store = pd_pair
    ids = _prompt(2)
    before = _folders(store)
    # The prefill leg's own continuation, taken before the store is touched.
    whole = _greedy(prefill, "pd-prefill-2", ids, DECODE_TOKENS)
    (folder,) = _folders(store) - before
    files = sorted(str(path) for path in folder.glob("*.safetensors"))
    assert files, f"no KV files in {folder}"
    script = (
        "import sys, safetensors.torch as st\n"
        "for name in sys.argv[1:]:\n"
        "    kv = st.load_file(name)['kv_cache']\n"
        "    st.save_file({'kv_cache': (kv.float() * -4.0).to(kv.dtype)}, name)\n"
    )
    subprocess.run([vllm_python, "-c", script, *files], check=True, timeout=120)

    decoded = _greedy(decode, "pd-decode-2", ids, DECODE_TOKENS)
    assert decoded.cached_tokens == LOADED_TOKENS
    assert list(decoded.output_ids) != list(whole.output_ids), "the decode leg ignored the KV it loaded"
