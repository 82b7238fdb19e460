"""The sim engine core: determinism, stops, aborts, utilities, prefix cache, batching."""

from __future__ import annotations

import pytest

from enginelink.machines.sim_core import SimConfig, SimEngineCore, expected_tokens
from enginelink.wire import vllm
from enginelink.wire.engine import FinishReason, GenerateSpec, OutputBatch, SamplingSpec

CODEC = vllm.VllmCodec()
EOS = 2


def core(**config) -> SimEngineCore:
    config.setdefault("vocab_size", 1000)
    config.setdefault("max_model_len", 256)
    config.setdefault("eos_token_id", EOS)
    return SimEngineCore(SimConfig(**config))


def add(engine: SimEngineCore, rid: str, prompt: list[int], now: float = 0.0, **sampling) -> list[OutputBatch]:
    sampling.setdefault("max_tokens", 16)
    sampling.setdefault("eos_token_ids", (EOS,))
    spec = GenerateSpec(request_id=rid, prompt_token_ids=prompt, sampling=SamplingSpec(**sampling))
    return [CODEC.decode_output(m) for m in engine.handle_input(*CODEC.encode_add(spec), now)]


def step(engine: SimEngineCore, now: float = 1.0) -> tuple[list[OutputBatch], float]:
    messages, cost = engine.step(now)
    return [CODEC.decode_output(m) for m in messages], cost


def run(engine: SimEngineCore, max_steps: int = 1000) -> dict[str, list]:
    """Step until idle: per request the outputs it got, in order."""
    seen: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_work:
            return seen
        batches, _ = step(engine)
        assert len(batches) == 1  # one frame per step
        for out in batches[0].outputs:
            seen.setdefault(out.request_id, []).append(out)
    raise AssertionError("engine did not go idle")


def tokens(outs: list) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def generate(prompt: list[int], **sampling) -> list:
    engine = core()
    add(engine, "r", prompt, **sampling)
    return run(engine)["r"]


def utility(engine: SimEngineCore, method: str, *args) -> tuple[str | None, object]:
    (message,) = engine.handle_input(*CODEC.encode_utility(7, method, args), 0.0)
    reply = CODEC.decode_output(message).utility
    assert reply.call_id == 7
    return reply.failure, reply.result


def _hits_eos_early(prompt: list[int]) -> bool:
    return EOS in tokens(generate(prompt, max_tokens=12, ignore_eos=True))[2:10]


# A prompt whose output hits EOS early, found once by hashing.
EOS_PROMPT = next([i, i + 1, i + 2] for i in range(10, 500) if _hits_eos_early([i, i + 1, i + 2]))


def test_output_is_deterministic_and_depends_on_prompt_and_seed():
    a = tokens(generate([5, 6, 7], ignore_eos=True))
    assert a == tokens(generate([5, 6, 7], ignore_eos=True))
    assert a != tokens(generate([5, 6, 8], ignore_eos=True))
    assert tokens(generate([5, 6, 7], ignore_eos=True, seed=1)) != tokens(generate([5, 6, 7], ignore_eos=True, seed=2))
    assert all(3 <= t < 1000 or t == EOS for t in a)


def test_expected_tokens_are_what_the_core_samples():
    """A client can check a stream without the engine: greedy and seeded, EOS where it falls."""
    def expect(prompt, seed=None):
        return expected_tokens(prompt, 40, vocab_size=1000, eos_token_id=EOS, seed=seed)

    assert tokens(generate([5, 6, 7], max_tokens=40, ignore_eos=True, temperature=0.0)) == expect([5, 6, 7])
    assert tokens(generate(EOS_PROMPT, max_tokens=40, ignore_eos=True, temperature=0.0)) == expect(EOS_PROMPT)
    seeded = generate([5, 6, 7], max_tokens=40, ignore_eos=True, seed=9, temperature=0.8)
    assert tokens(seeded) == expect([5, 6, 7], seed=9) != expect([5, 6, 7])


def test_one_token_per_step_and_max_tokens_is_length():
    outs = generate([1, 2, 3], max_tokens=5, ignore_eos=True)
    assert [len(o.new_token_ids) for o in outs] == [1] * 5
    assert [o.finish_reason for o in outs] == [None] * 4 + [FinishReason.LENGTH]


def test_max_model_len_is_length():
    engine = core(max_model_len=10)
    add(engine, "r", list(range(3, 10)), max_tokens=50, ignore_eos=True)
    outs = run(engine)["r"]
    assert len(outs) == 3 and outs[-1].finish_reason == FinishReason.LENGTH


def test_eos_stops_unless_ignore_eos():
    ignoring = tokens(generate(EOS_PROMPT, max_tokens=12, ignore_eos=True))
    at = ignoring.index(EOS)
    stopped = generate(EOS_PROMPT, max_tokens=12)
    assert tokens(stopped) == ignoring[: at + 1]
    assert (stopped[-1].finish_reason, stopped[-1].stop_reason) == (FinishReason.STOP, None)


def test_stop_token_id_stops_with_it_as_stop_reason():
    free = tokens(generate([9, 8, 7], max_tokens=16, ignore_eos=True))
    k = next(i for i in range(2, 16) if free[i] not in free[:i] and free[i] != EOS)
    outs = generate([9, 8, 7], max_tokens=16, ignore_eos=True, stop_token_ids=(free[k],))
    assert tokens(outs) == free[: k + 1]
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == (FinishReason.STOP, free[k])


def test_min_tokens_masks_eos_and_stop_ids():
    free = tokens(generate(EOS_PROMPT, max_tokens=12, ignore_eos=True))
    outs = generate(EOS_PROMPT, max_tokens=12, min_tokens=11)
    got = tokens(outs)
    assert EOS not in got[:11] and len(got) >= 11
    assert got[: free.index(EOS)] == free[: free.index(EOS)]  # unmasked positions unchanged
    stop = free[1]
    outs = generate(EOS_PROMPT, max_tokens=12, ignore_eos=True, min_tokens=12, stop_token_ids=(stop,))
    assert stop not in tokens(outs) and outs[-1].finish_reason == FinishReason.LENGTH


def test_abort_emits_nothing():
    engine = core()
    add(engine, "a", [1, 2, 3], max_tokens=50, ignore_eos=True)
    add(engine, "b", [4, 5, 6], max_tokens=3, ignore_eos=True)
    step(engine)
    assert engine.handle_input(*CODEC.encode_abort(["a", "unknown"]), 1.0) == []
    rest = []
    while engine.has_work:
        batches, _ = step(engine)
        rest += batches
    assert {o.request_id for b in rest for o in b.outputs} == {"b"}
    assert all("a" not in (b.finished_requests or []) for b in rest)
    assert rest[-1].finished_requests == ["b"] and not engine.has_work


def test_abort_of_a_waiting_request():
    engine = core(max_num_seqs=1)
    add(engine, "a", [1, 2], max_tokens=2, ignore_eos=True)
    add(engine, "b", [3, 4], max_tokens=2, ignore_eos=True)
    engine.handle_input(*CODEC.encode_abort(["b"]), 0.0)
    assert set(run(engine)) == {"a"}


def test_utility_calls():
    engine = core()
    assert utility(engine, "get_supported_tasks") == (None, ["generate"])
    assert utility(engine, "is_sleeping") == (None, False)
    assert utility(engine, "reset_prefix_cache", False, False) == (None, True)
    failure, _ = utility(engine, "profile", True, None, None, None)
    assert failure.startswith("Call to profile method failed: Profiling is not enabled. Please set --profiler-config")
    failure, _ = utility(engine, "list_loras")
    assert failure == "Call to list_loras method failed: LoRA is not enabled. Use --enable-lora to enable LoRA."
    failure, _ = utility(engine, "no_such_method")
    assert failure == "Call to no_such_method method failed: 'EngineCoreProc' object has no attribute 'no_such_method'"


def first_outputs(engine: SimEngineCore, rid: str, prompt: list[int]) -> tuple[vllm.EngineCoreOutput, OutputBatch]:
    add(engine, rid, prompt, max_tokens=1, ignore_eos=True)
    (batch,), _ = step(engine)
    (out,) = batch.outputs
    return out, batch


def test_shared_prefix_reports_cached_tokens():
    engine = core(block_size=16)
    shared = list(range(100, 132))  # two full blocks
    out, batch = first_outputs(engine, "a", shared + [7, 8, 9, 10, 11, 12, 13, 14])
    assert vllm.cached_tokens(out) == 0 and out.events[0].type == vllm.EVENT_QUEUED
    out, batch = first_outputs(engine, "b", shared + [50, 51, 52])
    assert vllm.cached_tokens(out) == 32
    assert out.prefill_stats == vllm.PrefillStats(35, 3, 32, 32, 0)
    assert (batch.stats.prefix_cache_queries, batch.stats.prefix_cache_hits) == (35, 32)
    # A fully cached prompt still recomputes its last token: one block short.
    out, _ = first_outputs(engine, "c", shared)
    assert vllm.cached_tokens(out) == 16
    # The cache salt separates tenants.
    salted = GenerateSpec(
        request_id="d", prompt_token_ids=shared + [1], sampling=SamplingSpec(max_tokens=1), cache_salt="tenant-1"
    )
    engine.handle_input(*CODEC.encode_add(salted), 0.0)
    assert vllm.cached_tokens(step(engine)[0][0].outputs[0]) == 0


def test_generated_tokens_fill_cacheable_blocks():
    engine = core(block_size=4)
    add(engine, "a", [1, 2, 3, 4, 5, 6], max_tokens=7, ignore_eos=True)
    got = tokens(run(engine)["a"])
    out, _ = first_outputs(engine, "b", [1, 2, 3, 4, 5, 6] + got[:6] + [99])
    assert vllm.cached_tokens(out) == 12


def test_reset_prefix_cache_empties_the_cache():
    engine = core(block_size=4)
    first_outputs(engine, "a", list(range(10, 20)))
    assert engine.num_cached_blocks == 2
    add(engine, "busy", [1, 2, 3], max_tokens=5, ignore_eos=True)
    step(engine)
    assert utility(engine, "reset_prefix_cache", False, False) == (None, False)  # requests running
    run(engine)
    assert utility(engine, "reset_prefix_cache", False, False) == (None, True)
    assert engine.num_cached_blocks == 0
    out, _ = first_outputs(engine, "b", list(range(10, 20)))
    assert vllm.cached_tokens(out) == 0


def test_max_num_seqs_limits_the_batch():
    engine = core(max_num_seqs=2)
    for rid in "abc":
        add(engine, rid, [1, 2, ord(rid)], max_tokens=2, ignore_eos=True)
    (batch,), _ = step(engine)
    assert [o.request_id for o in batch.outputs] == ["a", "b"]
    assert (batch.stats.num_running_reqs, batch.stats.num_waiting_reqs) == (2, 1)
    (batch,), _ = step(engine)
    assert batch.finished_requests == ["a", "b"] and batch.stats.num_running_reqs == 0
    (batch,), _ = step(engine)
    assert [o.request_id for o in batch.outputs] == ["c"] and batch.stats.step_counter == 3


def test_token_budget_chunks_prefill_and_costs_time():
    engine = core(max_num_batched_tokens=20, step_us=100, prefill_us_per_token=10)
    add(engine, "a", list(range(3, 19)), max_tokens=4, ignore_eos=True)  # 16 tokens
    add(engine, "b", list(range(30, 46)), max_tokens=4, ignore_eos=True)
    (batch,), cost = step(engine)
    assert [o.request_id for o in batch.outputs] == ["a"]  # b got a 4-token chunk
    assert cost == pytest.approx((100 + 20 * 10) * 1e-6)
    (batch,), cost = step(engine)
    assert [o.request_id for o in batch.outputs] == ["a", "b"]
    assert cost == pytest.approx((100 + 12 * 10) * 1e-6)
    (batch,), cost = step(engine)
    assert cost == pytest.approx(100e-6) and batch.stats.kv_cache_usage > 0


def test_idle_engine_does_not_step():
    assert core().step(5.0) == ([], 0.0)


@pytest.mark.parametrize("prompt", [[], list(range(3, 300))])
def test_unservable_prompt_is_an_immediate_error(prompt):
    engine = core()
    (batch,) = add(engine, "bad", prompt)
    assert batch.outputs[0].finish_reason == FinishReason.ERROR and batch.finished_requests == ["bad"]
    assert not engine.has_work
