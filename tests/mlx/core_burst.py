"""Run by the MLX venv's python: how the engine core admits a burst that arrives spread out.

``core_burst.py MODEL_DIR`` prints one JSON object (see
``test_mlx_generate.test_a_burst_spread_over_the_wire_joins_the_batch_together``):
four requests arriving 1 ms apart, with the default admission rule and with
``coalesce_max_s`` 0 (each joins as it arrives, mlx-lm's own way); per request
the engine step of its first token, and what the engine's stats said after a
held request was aborted; and the dtypes of mlx-lm's KV caches along the way.
"""

import json
import sys
from pathlib import Path

import msgspec

from enginelink.tools import mlx_core
from enginelink.wire import vllm

ENCODER = msgspec.msgpack.Encoder()
PROMPT = [318, 283, 1552, 10, 90, 305]
GREEDY = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}


def cache_dtypes(core) -> set[str]:
    """The dtypes of the KV caches mlx-lm holds now (prompts being prefilled, sequences generating)."""
    batches = (core.generator._prompt_batch, core.generator._generation_batch)  # mlx-lm 0.31.3's own
    return {str(c.keys.dtype) for b in batches for c in (b.prompt_cache or []) if getattr(c, "keys", None) is not None}


def run(model, config, mlx_config) -> dict:
    core = mlx_core.MlxEngineCore(model, config, mlx_config)
    first_step: dict[str, int] = {}
    tokens: dict[str, list[int]] = {}
    dtypes: set[str] = set()
    step = 0

    def take(messages):
        for message in messages:
            frame = vllm.decode_outputs(message)
            for out in frame.outputs:
                first_step.setdefault(out.request_id, step)
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)

    now = 0.0
    for i in range(4):  # arrivals 1 ms apart, the engine stepping between them (a 1 ms step)
        req = vllm.EngineCoreRequest(f"r{i}", PROMPT[: 3 + i], None, vllm.SamplingParams(**GREEDY), None, 0.0,
                                     None, None, None)  # fmt: skip
        core.handle_input(b"\x00", ENCODER.encode(req), now)
        step += 1
        take(core.step(now))
        dtypes |= cache_dtypes(core)
        now += 0.001
    # An abort of a held request: nothing to remove in mlx-lm, and the stats say so at once.
    req = vllm.EngineCoreRequest("gone", PROMPT, None, vllm.SamplingParams(**GREEDY), None, 0.0, None, None, None)
    core.handle_input(b"\x00", ENCODER.encode(req), now)
    (aborted,) = core.handle_input(b"\x01", ENCODER.encode(["gone"]), now)
    stats = vllm.decode_outputs(aborted).scheduler_stats
    held_stats = [stats.num_running_reqs, stats.num_waiting_reqs]
    wait_before = core.admission_wait_s(now)
    while core.has_work:
        now += 0.001
        step += 1
        take(core.step(now))
        dtypes |= cache_dtypes(core)
    return {"first_step": first_step, "tokens": tokens, "held_stats": held_stats, "wait_before_s": wait_before,
            "cache_dtypes": sorted(dtypes), "model_dtype": str(next(iter(model.parameters()["model"]["embed_tokens"].values())).dtype)}


def main() -> int:
    model, config = mlx_core.load(Path(sys.argv[1]))
    report = {
        "burst": run(model, config, mlx_core.MlxConfig()),
        "each_at_once": run(model, config, mlx_core.MlxConfig(coalesce_max_s=0.0)),
    }
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
