"""The sim engine as a pooling model (``runner="pooling"``): vLLM's embed wire, deterministic vectors."""

from __future__ import annotations

import array

import pytest

from enginelink.machines.sim_core import SimConfig, SimEngineCore, sim_embedding
from enginelink.wire import vllm
from enginelink.wire.engine import FinishReason, GenerateSpec, PoolingSpec, SamplingSpec

CODEC = vllm.VllmCodec()


def spec(rid: str, prompt: list[int], pooling: bool = True) -> GenerateSpec:
    return GenerateSpec(request_id=rid, prompt_token_ids=prompt, sampling=SamplingSpec(max_tokens=4),
                        pooling=PoolingSpec() if pooling else None)


def serve(engine: SimEngineCore, *specs: GenerateSpec) -> dict:
    """Every output per request, with how many frames each output message had."""
    seen: dict = {}
    messages = [m for s in specs for m in engine.handle_input(*CODEC.encode_add(s), 0.0)]
    while engine.has_work:
        messages += engine.step(1.0)[0]
    for message in messages:
        for out in CODEC.decode_output(message).outputs:
            seen.setdefault(out.request_id, []).append((out, len(message)))
    return seen


@pytest.mark.parametrize("dim, frames", [(16, 1), (256, 3)])
def test_one_output_per_request_with_the_pooled_vector(dim, frames):
    engine = SimEngineCore(SimConfig(vocab_size=1000, max_model_len=64, runner="pooling", embed_dim=dim))
    seen = serve(engine, spec("a", [5, 6, 7]), spec("b", [9] * 64))  # a prompt may fill the context
    for rid, prompt in (("a", [5, 6, 7]), ("b", [9] * 64)):
        ((out, message_frames),) = seen[rid]
        assert out.new_token_ids == [] and out.finish_reason == FinishReason.STOP
        # Both pooled in one step, one message: 16 floats inline, 256 in an aux frame each (vLLM's 256-byte rule).
        assert message_frames == frames
        assert out.pooling_output.floats() == array.array("f", sim_embedding(prompt, dim)).tolist()
    assert seen["a"][0][0].pooling_output.floats() != seen["b"][0][0].pooling_output.floats()


def test_each_runner_fails_the_other_kind_of_request_at_once():
    pooling = SimEngineCore(SimConfig(vocab_size=1000, max_model_len=64, runner="pooling"))
    generation = SimEngineCore(SimConfig(vocab_size=1000, max_model_len=64))
    ((out, _),) = serve(pooling, spec("g", [5, 6], pooling=False))["g"]
    assert out.finish_reason == FinishReason.ERROR and out.pooling_output is None
    ((out, _),) = serve(generation, spec("e", [5, 6]))["e"]
    assert out.finish_reason == FinishReason.ERROR and out.pooling_output is None


def test_the_vector_is_unit_length_and_depends_only_on_the_prompt():
    vector = sim_embedding([1, 2, 3], 300)
    assert len(vector) == 300 and abs(sum(v * v for v in vector) - 1.0) < 1e-12
    assert vector == sim_embedding([1, 2, 3], 300) != sim_embedding([1, 2, 4], 300)
    assert max(abs(v) for v in sim_embedding([1, 2, 3], 300, normalize=False)) <= 1.0


def test_a_bad_runner_is_refused():
    with pytest.raises(ValueError, match="runner"):
        SimConfig(runner="classify")
