"""The warm-up knob and plan (smg contract §13): exact step lists for given engine facts."""

from __future__ import annotations

import pytest

from enginelink.machines.warmup import (
    StepKind,
    WarmupFacts,
    WarmupKnobError,
    WarmupLevel,
    WarmupSetting,
    bucket_grid,
    facts_from_ready,
    parse_warmup_knob,
    plan_warmup,
    token_range,
    warmup_prompt,
    warmup_setting,
)

FULL, FAST, OFF = WarmupLevel.FULL, WarmupLevel.FAST, WarmupLevel.OFF

# -- the knob ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, (FULL, 300.0)),
        ("", (FULL, 300.0)),
        ("  ", (FULL, 300.0)),
        ("off", (OFF, 300.0)),
        ("0", (OFF, 300.0)),
        ("0.0", (OFF, 300.0)),
        ("false", (OFF, 300.0)),
        ("no", (OFF, 300.0)),
        ("none", (OFF, 300.0)),
        ("OFF", (OFF, 300.0)),
        ("fast", (FAST, 300.0)),
        ("full", (FULL, 300.0)),
        (" Full ", (FULL, 300.0)),
        ("120", (FULL, 120.0)),
        ("2.5", (FULL, 2.5)),
        ("fast:60", (FAST, 60.0)),
        ("full:600", (FULL, 600.0)),
        ("FAST:0.5", (FAST, 0.5)),
    ],
)
def test_knob_accepts(value, expected):
    assert parse_warmup_knob(value) == WarmupSetting(*expected)


@pytest.mark.parametrize(
    "value",
    ["bogus", "fast:", "fast:x", ":30", "off:30", "medium:30", "full:0", "full:-1", "-5", "inf", "nan",
     "full:inf", "fast:30:1", "30s", "full fast"],
)
def test_knob_refuses_with_the_accepted_forms(value):
    with pytest.raises(WarmupKnobError) as caught:
        parse_warmup_knob(value)
    assert str(caught.value) == (
        f"SMG_VLLM_SERVICER_WARMUP={value!r}: expected one of off, fast, full, a budget in seconds, "
        "or <level>:<seconds> (the default is full:300)"
    )


def test_knob_message_exactly_as_the_reference():
    with pytest.raises(WarmupKnobError, match=r"^SMG_VLLM_SERVICER_WARMUP='bogus': expected one of off, fast, full, "
                       r"a budget in seconds, or <level>:<seconds> \(the default is full:300\)$"):
        parse_warmup_knob("bogus")


def test_knob_names_the_callers_knob_and_default():
    with pytest.raises(WarmupKnobError) as caught:
        parse_warmup_knob("soon", 120.0, knob="ENGINELINK_WARMUP")
    assert str(caught.value).startswith("ENGINELINK_WARMUP='soon': expected one of")
    assert str(caught.value).endswith("(the default is full:120)")
    assert parse_warmup_knob(None, 120.0) == WarmupSetting(FULL, 120.0)


def test_environment_own_knob_wins_and_empty_means_unset():
    assert warmup_setting({}) == WarmupSetting(FULL, 300.0)
    assert warmup_setting({"SMG_VLLM_SERVICER_WARMUP": "fast"}) == WarmupSetting(FAST, 300.0)
    both = {"SMG_VLLM_SERVICER_WARMUP": "fast", "ENGINELINK_WARMUP": "off"}
    assert warmup_setting(both) == WarmupSetting(OFF, 300.0)
    assert warmup_setting({"ENGINELINK_WARMUP": "", "SMG_VLLM_SERVICER_WARMUP": "full:9"}) == WarmupSetting(FULL, 9.0)
    with pytest.raises(WarmupKnobError, match=r"^ENGINELINK_WARMUP='x'"):
        warmup_setting({"ENGINELINK_WARMUP": "x", "SMG_VLLM_SERVICER_WARMUP": "fast"})


# -- the plan ---------------------------------------------------------------------------


def shape(plan):
    """(kind, prompt tokens, max_tokens of each request) per step."""
    return [(s.kind.value, s.tokens, [r.max_tokens for r in s.requests]) for s in plan]


def ladder(plan, kind):
    return [s.tokens for s in plan if s.kind is kind]


REFERENCE = WarmupFacts(window=4, step=512, context=2048, vocab=32000)
GRID_512 = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


def test_reference_example_full_is_27_steps_then_the_flush():
    plan = plan_warmup(REFERENCE, "full")
    assert shape(plan) == (
        [("decode", 8, [2, 3, 4, 5])]
        + [("prefill", n, [1]) for n in [1, 2, 4, 8, 16, 17, 32, 33, 64, 65, 128, 129, 256, 257, 384, 512]]
        + [("again", n, [1]) for n in GRID_512]
        + [("flush", 0, [])]
    )
    assert len([s for s in plan if s.kind is not StepKind.FLUSH]) == 27
    assert plan[5].label == "prefill 16 tokens"
    assert plan[0].label == "decode staircase 4 x 8-token prompts, 2..5 tokens out"
    assert plan[-2].label == "prefill 512 tokens again"


def test_reference_example_fast_drops_only_the_128_token_classes():
    plan = plan_warmup(REFERENCE, "fast")
    assert ladder(plan, StepKind.PREFILL) == [1, 2, 4, 8, 16, 17, 32, 33, 64, 65, 128, 129, 256, 257, 512]
    assert ladder(plan, StepKind.AGAIN) == GRID_512
    assert shape(plan)[0] == ("decode", 8, [2, 3, 4, 5])
    assert shape(plan)[-1] == ("flush", 0, [])
    assert len(plan) == 26 + 1


def test_sim_defaults_full():
    # The sim engine and test model: window 128, step 2048, context 2048, vocab 4096.
    plan = plan_warmup(WarmupFacts(window=128, step=2048, context=2048, vocab=4096), FULL)
    assert shape(plan)[0] == ("decode", 8, list(range(2, 130)))
    assert ladder(plan, StepKind.PREFILL) == [
        1, 2, 4, 8, 16, 17, 32, 33, 64, 65, 128, 129, 256, 257, 384, 512, 513, 640, 768, 769, 896,
        1024, 1025, 1152, 1280, 1281, 1408, 1536, 1537, 1664, 1792, 1793, 1920, 2047,
    ]  # fmt: skip
    assert ladder(plan, StepKind.AGAIN) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2047]
    assert len(plan) == 1 + 34 + 16 + 1
    fast = plan_warmup(WarmupFacts(window=128, step=2048, context=2048, vocab=4096), FAST)
    assert ladder(fast, StepKind.PREFILL) == [
        1, 2, 4, 8, 16, 17, 32, 33, 64, 65, 128, 129, 256, 257, 512, 513, 768, 769,
        1024, 1025, 1280, 1281, 1536, 1537, 1792, 1793, 2047,
    ]  # fmt: skip


def test_large_step_uses_the_coarser_grid_and_capture_sizes():
    facts = WarmupFacts(window=256, step=16384, context=32768, vocab=151936, capture_sizes=(1, 2, 4, 8, 24, 40, 512))
    assert bucket_grid(facts.limit) == [
        1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048,
        2560, 3072, 3584, 4096, 8192, 16384,
    ]  # fmt: skip
    plan = plan_warmup(facts, FAST)
    assert ladder(plan, StepKind.PREFILL) == [
        1, 2, 4, 8, 16, 17, 24, 32, 33, 40, 64, 65, 128, 129, 256, 257, 512, 513, 768, 769,
        1024, 1025, 1280, 1281, 1536, 1537, 1792, 1793, 2048, 2049, 2560, 2561, 3072, 3073,
        3584, 3585, 4096, 4097, 8192, 8193, 16384,
    ]  # fmt: skip
    # 128 classes up to 16384, 15 of them already on the grid.
    assert len(plan_warmup(facts, FULL)) == len(plan) + 16384 // 128 - 15
    assert shape(plan)[0] == ("decode", 8, list(range(2, 258)))


def test_context_limits_the_ladder_and_the_staircase():
    facts = WarmupFacts(window=128, step=2048, context=40, vocab=4096, reserve=3)
    # limit = min(2048, 40 - 1 - 3) = 36; staircase = min(128, 256, 36 - 8) = 28.
    plan = plan_warmup(facts, FULL)
    assert shape(plan)[0] == ("decode", 8, list(range(2, 30)))
    assert ladder(plan, StepKind.PREFILL) == [1, 2, 4, 8, 16, 17, 32, 33, 36]
    assert ladder(plan, StepKind.AGAIN) == [1, 2, 4, 8, 16, 32, 36]
    for step in plan:
        for request in step.requests:
            assert request.prompt_len + request.max_tokens <= facts.context - facts.reserve


def test_step_smaller_than_a_staircase_prompt_and_tiny_context():
    plan = plan_warmup(WarmupFacts(window=0, step=7, context=2048, vocab=4096), FULL)
    assert shape(plan) == (
        [("prefill", n, [1]) for n in [1, 2, 4, 7]] + [("again", n, [1]) for n in [1, 2, 4, 7]] + [("flush", 0, [])]
    )
    assert plan_warmup(WarmupFacts(window=4, step=512, context=1, vocab=4096), FULL) == []


def test_window_zero_means_128():
    plan = plan_warmup(WarmupFacts(window=0, step=4096, context=4096, vocab=4096), FAST)
    assert len(plan[0].requests) == 128


def test_off_is_no_plan():
    assert plan_warmup(REFERENCE, "off") == []
    assert plan_warmup(REFERENCE, OFF) == []


def test_data_parallel_ranks_each_get_every_shape_pinned():
    plan = plan_warmup(WarmupFacts(window=4, step=512, context=2048, vocab=32000, dp_size=2), FULL)
    assert len(plan) == 28
    assert [(r.data_parallel_rank, r.max_tokens) for r in plan[0].requests] == [
        (0, 2), (0, 3), (0, 4), (0, 5), (1, 2), (1, 3), (1, 4), (1, 5)
    ]  # fmt: skip
    assert plan[0].label == "decode staircase 4 x 8-token prompts, 2..5 tokens out"
    assert [r.data_parallel_rank for r in plan[1].requests] == [0, 1]
    assert {r.data_parallel_rank for r in plan_warmup(REFERENCE, FULL)[1].requests} == {None}


def test_requests_ids_and_prompts():
    plan = plan_warmup(REFERENCE, FULL)
    requests = [r for step in plan for r in step.requests]
    assert [r.request_id for r in requests] == [f"smg-warmup-{n}" for n in range(len(requests))]
    assert len(requests) == 4 + 16 + 10
    low, span = token_range(32000)
    assert (low, span) == (1000, 30000)
    prefixes = set()
    for r in requests:
        ids = r.prompt_token_ids
        assert len(ids) == r.prompt_len
        assert all(low <= t < low + span for t in ids)
        assert r.temperature == 0.0 and r.ignore_eos
        if r.prompt_len >= 2:
            prefixes.add(tuple(ids[:2]))
    assert len(prefixes) == len([r for r in requests if r.prompt_len >= 2])
    # Pure: the same facts give the same plan, prompts included.
    again = [r for step in plan_warmup(REFERENCE, FULL) for r in step.requests]
    assert again == requests
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in requests]


def test_prompts_are_fixed_across_versions():
    # Pinned values: a change here changes every deployment's warm-up traffic.
    assert warmup_prompt(0, 6, 4096) == [1000, 1000, 1735, 3192, 1554, 3392]
    assert warmup_prompt(7, 3, 4096)[:2] == [1007, 1000]
    assert warmup_prompt(3096 + 5, 2, 4096) == [1005, 1001]
    assert len(warmup_prompt(3, 2047, 4096)) == 2047


def test_small_vocabulary_uses_its_upper_half():
    assert token_range(4096) == (1000, 3096)
    assert token_range(1001) == (500, 501)
    assert token_range(100) == (50, 50)
    assert all(50 <= t < 100 for t in warmup_prompt(9, 300, 100))


def test_facts_from_a_ready_response():
    ready = {"max_num_seqs": 4, "max_num_batched_tokens": 512, "max_model_len": 2048, "data_parallel_size": 1}
    assert facts_from_ready(ready, 32000) == REFERENCE


@pytest.mark.parametrize(
    "bad", [dict(step=0), dict(context=0), dict(vocab=1), dict(dp_size=0), dict(window=-1), dict(reserve=-1)]
)
def test_nonsense_facts_are_refused(bad):
    facts = dict(window=4, step=512, context=2048, vocab=4096) | bad
    with pytest.raises(ValueError, match="warm-up facts"):
        WarmupFacts(**facts)


# -- TokenSpeed: the chunk remainders (issue 33 item 6) ----------------------------------------------

from enginelink.machines.warmup import TOKENSPEED_BUDGET_S, facts_from_ready as _facts_from_ready  # noqa: E402
from enginelink.machines.warmup import spread_order  # noqa: E402


def _tokenspeed_ready(world_size: int | None) -> dict:
    ready = {"vllm_version": "tokenspeed-0.1.1", "max_num_seqs": 4, "max_num_batched_tokens": 300,
             "max_model_len": 4096}
    if world_size is not None:
        ready["world_size"] = world_size
    return ready


def test_a_multi_process_tokenspeed_plans_every_prompt_length_up_to_the_step_last_and_spread():
    facts = _facts_from_ready(_tokenspeed_ready(2), 4096)
    assert facts.every_prefill_length and facts.reserve == 2
    plan = plan_warmup(facts, "full")
    kinds = [step.kind for step in plan]
    remainders = [step.tokens for step in plan if step.kind is StepKind.REMAINDER]
    ladder = {step.tokens for step in plan if step.kind is StepKind.PREFILL}
    # Every length 1..step is planned once, the ladder's or a remainder, and the remainders come last
    # before the flush, in the spread order (a budget cut leaves an even coverage).
    assert sorted(ladder | set(remainders)) == list(range(1, 301)) and not ladder & set(remainders)
    assert kinds[-1] is StepKind.FLUSH and set(kinds[-1 - len(remainders):-1]) == {StepKind.REMAINDER}
    assert remainders == [n for n in spread_order(300) if n not in ladder]
    assert max(remainders[:8]) - min(remainders[:8]) > 150  # the first few already span the range
    assert all(len(step.requests) == 1 and step.requests[0].max_tokens == 1 for step in plan
               if step.kind is StepKind.REMAINDER)
    # fast leaves them out (the hazard open); a one-process engine and vLLM plan none.
    assert StepKind.REMAINDER not in {step.kind for step in plan_warmup(facts, "fast")}
    assert not _facts_from_ready(_tokenspeed_ready(1), 4096).every_prefill_length
    assert _facts_from_ready(_tokenspeed_ready(None), 4096).every_prefill_length  # unknown layout: kept
    assert not _facts_from_ready({**_tokenspeed_ready(2), "vllm_version": "0.32.0"}, 4096).every_prefill_length


def test_spread_order_is_a_permutation_whose_prefixes_spread():
    assert spread_order(0) == [] and spread_order(1) == [1] and spread_order(5) == [4, 2, 1, 5, 3]
    assert sorted(spread_order(1000)) == list(range(1, 1001))


def test_tokenspeeds_default_budget_is_900_s(monkeypatch):
    from enginelink.tools import serve

    for name in ("ENGINELINK_WARMUP", "SMG_TOKENSPEED_SERVICER_WARMUP", "SMG_VLLM_SERVICER_WARMUP",
                 "SMG_SGLANG_SERVICER_WARMUP"):
        monkeypatch.delenv(name, raising=False)
    assert serve._warmup("tokenspeed").budget_s == TOKENSPEED_BUDGET_S == 900.0
    assert serve._warmup("sglang").budget_s == serve._warmup("vllm").budget_s == 300.0
    monkeypatch.setenv("SMG_TOKENSPEED_SERVICER_WARMUP", "full")
    assert serve._warmup("tokenspeed").budget_s == 900.0
