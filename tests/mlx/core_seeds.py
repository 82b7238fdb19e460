"""Run by the MLX venv's python: the engine core's seeded draws, with the batch under control.

``core_seeds.py MODEL_DIR`` prints one JSON object of token lists (see
``test_mlx_generate.test_seeded_draws_in_the_core_...``). Requests are put in
the core's ``BatchGenerator`` at chosen steps, so the batch is exactly known.
"""

import json
import sys
from pathlib import Path

import msgspec

from enginelink.tools import mlx_core
from enginelink.wire import vllm

ENCODER = msgspec.msgpack.Encoder()
PROMPT = [318, 283, 1552, 10, 90, 305]
SAMPLED = {"temperature": 1.0, "max_tokens": 24, "ignore_eos": True}
LONG_PROMPT = [5 + i for i in range(40)]


def run(model, config, requests, late=()):
    """{request id: tokens}; ``late``: (step, request) added before that step."""
    # No admission wait (the clock here stands still): each request joins at the step it is added at.
    core = mlx_core.MlxEngineCore(model, config, mlx_core.MlxConfig(coalesce_max_s=0.0))

    def add(rid, ids, params):
        req = vllm.EngineCoreRequest(rid, ids, None, vllm.SamplingParams(**params), None, 0.0, None, None, None)
        core.handle_input(b"\x00", ENCODER.encode(req), 0.0)

    for request in requests:
        add(*request)
    outs, step = {}, 0
    while core.has_work or any(s > step for s, _ in late):
        step += 1
        for when, request in late:
            if when == step:
                add(*request)
        for message in core.step(0.0) if core.has_work else []:
            for out in vllm.decode_outputs(message).outputs:
                outs.setdefault(out.request_id, []).extend(out.new_token_ids)
    return outs


def main() -> int:
    model, config = mlx_core.load(Path(sys.argv[1]))
    greedy = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
    seeded = {**SAMPLED, "seed": 7}
    report = {
        "alone": run(model, config, [("a", PROMPT, seeded)])["a"],
        # One batch: three copies with seed 7 beside another seed, unseeded and greedy rows.
        "together": run(model, config, [("a", PROMPT, seeded), ("b", PROMPT, seeded), ("x", PROMPT, {**SAMPLED, "seed": 3}),
                                        ("u", PROMPT, SAMPLED), ("g", PROMPT, greedy), ("c", PROMPT, seeded)]),
        # Joining while other prompts are part-way through their prefill, before and after it: mlx-lm
        # 0.31.3 turned such a batch's KV cache float32, and the draws left the lone run's after 3 tokens.
        "joined_during_prefill": run(model, config, [("o1", LONG_PROMPT, SAMPLED)], late=[
            (3, ("o2", LONG_PROMPT[:20], SAMPLED)), (4, ("a", PROMPT, seeded)), (5, ("o3", LONG_PROMPT[:30], SAMPLED))])["a"],
        # After greedy rows left the generator (mlx-lm 0.31.3's stale-sampler case).
        "after_greedy": run(model, config, [("g1", PROMPT, greedy), ("g2", PROMPT, {**greedy, "max_tokens": 3})],
                            late=[(12, ("a", PROMPT, seeded))])["a"],
    }
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
