"""The CUDA-graph capture cap: the derivation's table, and what it does to an engine's arguments.

On CPU there are no CUDA graphs, so what a user can see is the engine's
effective arguments: ``--max-cudagraph-capture-size N`` added to the
headless launch, or not. The table's rows were checked against the
reference's ``smg_grpc_servicer.vllm.capture_cap.derive_capture_cap``
(0.14.1) over 117,504 combinations; the rows below are the cases that name
each branch.
"""

from __future__ import annotations

import argparse
import logging

import pytest

from enginelink.runtime.contracts.vllm import capture_cap
from enginelink.runtime.contracts.vllm.capture_cap import (
    CAPTURE_CAP_ENV, apply_to_argv, apply_to_namespace, capture_sizes, derive_capture_cap, grid_floor,
)

# (max_num_seqs, max_num_batched_tokens, setting, other settings) -> (cap, source)
TABLE = [
    # No window flag: the engine's defaults reach 512 (1024 on one platform): only a ceiling of 1024+ raises both.
    ((None, None, None, {}), (None, "window")),
    ((None, 8192, "auto", {}), (None, "window")),
    ((None, 8192, "1024", {}), (1024, "derived")),
    ((None, 8192, "2048", {}), (2048, "derived")),
    ((None, 700, "1024", {}), (700, "derived")),  # both platforms' defaults end at the step: no lower
    ((None, 8192, "800", {}), (None, "window")),  # 800 would lower the 1024 platform's default
    # A small window: the engine's default is 2 x seqs; the step (or the ceiling) raises it.
    ((32, 8192, None, {}), (512, "derived")),
    ((32, None, None, {}), (512, "derived")),
    ((32, 100, None, {}), (100, "derived")),  # the step itself, off the grid: the engine takes it as is
    ((32, 48, None, {}), (None, "default")),  # the engine's default (the step, appended) covers it
    ((100, 150, None, {}), (None, "default")),
    ((100, 300, None, {}), (300, "derived")),
    ((256, 8192, None, {}), (None, "default")),  # 2 x 256 = 512: nothing to raise
    ((300, 8192, None, {}), (None, "default")),
    ((300, 8192, "600", {}), (592, "derived")),  # the knob's ceiling, rounded down to the grid
    ((300, 8192, "560", {}), (None, "default")),  # 560 could lower the 592 of the 1024-ceiling platform
    ((1, None, "7", {}), (4, "derived")),
    ((32, 8192, " AUTO ", {}), (512, "derived")),
    # Kept out: the opt-out, the operator's own cap or list, eager mode, speculative decoding.
    ((32, 8192, "engine", {}), (None, "engine")),
    ((32, 8192, None, {"explicit_cap": 64}), (None, "operator")),
    ((32, 8192, None, {"explicit_sizes": [1, 2, 4]}), (None, "operator")),
    ((32, 8192, None, {"enforce_eager": True}), (None, "eager")),
    ((32, 8192, None, {"cudagraph_mode": "NONE"}), (None, "eager")),
    ((32, 8192, None, {"cudagraph_mode": 0}), (None, "eager")),
    ((32, 8192, None, {"cudagraph_mode": "FULL_AND_PIECEWISE"}), (512, "derived")),
    ((32, 8192, None, {"speculative": True}), (None, "speculative")),
]


@pytest.mark.parametrize("given, expected", TABLE)
def test_derivation_table(given, expected):
    seqs, step, setting, other = given
    decision = derive_capture_cap(max_num_seqs=seqs, max_num_batched_tokens=step, setting=setting, **other)
    assert (decision.cap, decision.source) == expected, decision.detail


@pytest.mark.parametrize("value", ["0", "-5", "abc", "1.5", "512x"])
def test_a_knob_value_it_does_not_take_is_refused_by_name(value):
    with pytest.raises(ValueError, match=CAPTURE_CAP_ENV):
        derive_capture_cap(max_num_seqs=32, max_num_batched_tokens=None, setting=value)


def test_the_grid_is_the_engines():
    assert [grid_floor(n) for n in (0, 1, 3, 5, 8, 15, 255, 256, 271, 272, 600)] == \
        [0, 1, 2, 4, 8, 8, 248, 256, 256, 272, 592]
    assert len(capture_sizes(64)) == 11 and len(capture_sizes(512)) == 51
    assert capture_sizes(512)[-1] == 512 and capture_sizes(300)[-1] == 288


def argv_after(engine_args: list[str], **env: str) -> tuple[list[str], str]:
    out, decision = apply_to_argv(engine_args, env)
    return out, decision.source


def test_serve_engine_args_get_the_derived_cap():
    out, source = argv_after(["--max-num-seqs", "32", "--max-model-len", "1024"])
    assert out[-2:] == ["--max-cudagraph-capture-size", "512"] and source == "derived"
    out, _ = argv_after(["--max_num_seqs=32", "--max-num-batched-tokens=256"])
    assert out[-2:] == ["--max-cudagraph-capture-size", "256"]


@pytest.mark.parametrize("engine_args, source", [
    (["--max-num-seqs", "32", "--enforce-eager"], "eager"),
    (["--max-num-seqs", "32", "--max-cudagraph-capture-size", "64"], "operator"),
    (["--max-num-seqs", "32", "--cudagraph-capture-sizes", "1", "2", "4"], "operator"),
    (["--max-num-seqs", "32", "--compilation-config", '{"max_cudagraph_capture_size": 128}'], "operator"),
    (["--max-num-seqs", "32", "-cc", '{"cudagraph_mode": "NONE"}'], "eager"),
    (["--max-num-seqs", "32", "--compilation-config.cudagraph_mode=NONE"], "eager"),
    (["--max-num-seqs", "32", "--compilation-config.cudagraph_capture_sizes", "[1,2]"], "operator"),
    (["--max-num-seqs", "32", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'],
     "speculative"),
    (["--max-num-seqs", "32", "-sc", '{"method": "ngram"}'], "speculative"),
    (["--max-model-len", "1024"], "window"),
])
def test_engine_args_it_leaves_alone(engine_args, source):
    out, got = argv_after(engine_args)
    assert out == engine_args and got == source


def test_the_knob_reaches_the_engine_args():
    out, source = argv_after(["--max-num-seqs", "32"], **{CAPTURE_CAP_ENV: "engine"})
    assert out == ["--max-num-seqs", "32"] and source == "engine"
    out, _ = argv_after(["--max-num-seqs", "32"], **{CAPTURE_CAP_ENV: "256"})
    assert out[-1] == "256"
    with pytest.raises(ValueError, match=CAPTURE_CAP_ENV):
        argv_after(["--max-num-seqs", "32"], **{CAPTURE_CAP_ENV: "lots"})


def test_the_enforce_eager_of_a_later_flag_wins():
    out, source = argv_after(["--max-num-seqs", "32", "--enforce-eager", "--no-enforce-eager"])
    assert source == "derived" and out[-1] == "512"


def namespace(**fields) -> argparse.Namespace:
    base = {"max_num_seqs": None, "max_num_batched_tokens": None, "max_cudagraph_capture_size": None,
            "cudagraph_capture_sizes": None, "compilation_config": None, "enforce_eager": False,
            "speculative_config": None}
    return argparse.Namespace(**{**base, **fields})


def test_a_parsed_namespace_gets_the_cap_where_vllms_flag_puts_it():
    parsed = namespace(max_num_seqs=32, max_num_batched_tokens=2048)
    assert apply_to_namespace(parsed, {}).cap == 512 and parsed.max_cudagraph_capture_size == 512
    parsed = namespace(max_num_seqs=32, compilation_config={"max_cudagraph_capture_size": 96})
    assert apply_to_namespace(parsed, {}).source == "operator" and parsed.max_cudagraph_capture_size is None
    parsed = namespace(max_num_seqs=32, enforce_eager=True)
    assert apply_to_namespace(parsed, {}).source == "eager" and parsed.max_cudagraph_capture_size is None


def test_each_decision_is_logged_once(caplog):
    capture_cap._logged.clear()
    decision = derive_capture_cap(max_num_seqs=8, max_num_batched_tokens=64, setting=None)
    with caplog.at_level(logging.INFO, logger="enginelink.capture_cap"):
        assert capture_cap.log_capture_cap(decision) is True
        assert capture_cap.log_capture_cap(decision) is False
    lines = [r.getMessage() for r in caplog.records if r.name == "enginelink.capture_cap"]
    assert lines == [f"CUDA-graph capture cap: {decision.detail}"]
