"""vLLM on its own: the offline ``LLM`` API, as the reference the servicer is compared with.

Run by path with the vLLM venv's python (enginelink is not installed there):

    VENV/bin/python offline_llm.py MODEL_DIR [LLM kwargs as JSON]

It builds one ``LLM`` and then answers cases, one JSON line in, one JSON line
out, until stdin closes:

    in:  {"id": ..., "prompt_token_ids": [...], "sampling": {SamplingParams kwargs},
          "tokenization_kwargs": {...} (optional)}
    out: {"id": ..., "prompt_tokens": N, "outputs": [{"index", "token_ids", "finish_reason", "stop_reason"}]}
         or {"id": ..., "error": "..."} when vLLM refuses the case

``sampling["structured_outputs"]`` is a map of ``StructuredOutputsParams``
fields (JSON cannot carry the dataclass).

with "logprobs" (per position: vLLM's dict as [[token id, logprob, rank], ...] in
its own order, the sampled token first) when the case asked for logprobs, and
"prompt_logprobs" (the same, None for position 0) when it asked for those.

or, for a pooling model (LLM kwargs ``{"runner": "pooling", "convert": "embed"}``):

    in:  {"id": ..., "prompt_token_ids": [...], "embed": true}
    out: {"id": ..., "outputs": [{"embedding": [floats], "prompt_tokens": n}]}

Each case is generated on its own (a batch of one), as the servicer's tests
send them one at a time, so both runs see the same batch shapes. Everything
vLLM prints goes to stderr; stdout carries only "ready" and the answers.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> int:
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM (and its child processes) log to stdout: send that to stderr
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    kwargs = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    llm = LLM(model=sys.argv[1], **kwargs)
    answers.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        case = json.loads(line)
        if case.get("embed"):
            (result,) = llm.embed([TokensPrompt(prompt_token_ids=case["prompt_token_ids"])], use_tqdm=False)
            outputs = [{"embedding": list(result.outputs.embedding), "prompt_tokens": len(result.prompt_token_ids)}]
            answers.write(json.dumps({"id": case["id"], "outputs": outputs}) + "\n")
            continue
        sampling = case["sampling"]
        if sampling.get("logit_bias"):  # JSON made the token ids strings
            sampling["logit_bias"] = {int(k): v for k, v in sampling["logit_bias"].items()}
        if sampling.get("structured_outputs"):
            sampling["structured_outputs"] = StructuredOutputsParams(**sampling["structured_outputs"])
        try:
            params = SamplingParams(**sampling)
            (result,) = llm.generate([TokensPrompt(prompt_token_ids=case["prompt_token_ids"])], params,
                                     use_tqdm=False, tokenization_kwargs=case.get("tokenization_kwargs"))
        except ValueError as error:  # vLLM's validation errors are ValueErrors
            answers.write(json.dumps({"id": case["id"], "error": f"{type(error).__name__}: {error}"}) + "\n")
            continue
        outputs = [
            {
                "index": out.index,
                "token_ids": list(out.token_ids),
                "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason,
                **({"logprobs": _positions(out.logprobs)} if out.logprobs is not None else {}),
                **({"prompt_logprobs": _positions(result.prompt_logprobs)}
                   if result.prompt_logprobs is not None else {}),
            }
            for out in sorted(result.outputs, key=lambda o: o.index)
        ]
        answers.write(json.dumps({"id": case["id"], "prompt_tokens": len(result.prompt_token_ids),
                                  "outputs": outputs}) + "\n")
    return 0


def _positions(logprobs) -> list:
    return [None if entry is None else [[t, lp.logprob, lp.rank] for t, lp in entry.items()] for entry in logprobs]


if __name__ == "__main__":
    sys.exit(main())
