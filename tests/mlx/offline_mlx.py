"""mlx-lm on its own, the reference the MLX tests compare enginelink with.

Run by the MLX venv's python: ``offline_mlx.py MODEL_DIR``. Prints
``{"ready": true}`` once loaded, then answers one JSON line per case line on
stdin: ``{"id", "prompt_token_ids", "max_tokens", "logprobs"}`` ->
``{"id", "token_ids", "finish_reason", "logprobs": [[sampled, {id: lp for the top k}], ...]}``.

Greedy, with mlx-lm's own ``generate_step`` (what ``mlx_lm.generate`` and
``stream_generate`` run), stopping as ``stream_generate`` does: at an EOS id
of the model (kept) or after ``max_tokens``. Standard library + mlx only.
"""

import json
import sys

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler


def main() -> int:
    model, tokenizer = load(sys.argv[1])
    eos = set(tokenizer.eos_token_ids)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        case = json.loads(line)
        k = case.get("logprobs")
        tokens, rows, finish = [], [], "length"
        steps = generate_step(mx.array(case["prompt_token_ids"]), model, max_tokens=case["max_tokens"],
                              sampler=make_sampler(0.0))
        for token, logprobs in steps:
            token = int(token)
            tokens.append(token)
            if k is not None:
                values = logprobs.astype(mx.float32).tolist()
                top = sorted(range(len(values)), key=lambda i: -values[i])[:k]
                rows.append([values[token], {str(i): values[i] for i in top}])
            if token in eos:
                finish = "stop"
                break
        print(json.dumps({"id": case["id"], "token_ids": tokens, "finish_reason": finish, "logprobs": rows}),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
