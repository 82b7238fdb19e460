"""The simulation's clients speaking TokenSpeed's contract (``runtime/contracts/tokenspeed/edge.py``).

``ts_request`` is what a TokenSpeed client sends for a plan (every sampling
scalar optional, ``max_new_tokens``, ``sampling_seed``); a plan meant to be
refused sends something TokenSpeed's contract refuses. ``ts_view`` reads a
TokenSpeed response as the checks read every client's (vLLM's GenerateResponse).
The simulation's engine speaks vLLM's wire, so this runs the TokenSpeed edge's
validation and encoding under every seed; its wire is ``tests/contract/
test_tokenspeed_contract.py``'s and the router e2e's.
"""

from __future__ import annotations

from smg_grpc_proto.generated import tokenspeed_scheduler_pb2 as ts
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from tests.sim.scenario import FIRST_TOKEN, VOCAB_SIZE, ClientPlan


def ts_request(plan: ClientPlan) -> ts.GenerateRequest:
    sp = ts.SamplingParams(n=plan.n, min_new_tokens=plan.min_tokens, ignore_eos=plan.ignore_eos)
    if plan.max_tokens is not None:
        sp.max_new_tokens = plan.max_tokens
    if plan.temperature is not None:
        sp.temperature = plan.temperature
    if plan.seed is not None:
        sp.sampling_seed = plan.seed
    sp.stop.extend(plan.stop)
    sp.stop_token_ids.extend(plan.stop_token_ids)
    request = ts.GenerateRequest(request_id=plan.request_id, tokenized=ts.TokenizedInput(input_ids=plan.prompt),
                                 sampling_params=sp, stream=plan.stream)
    if plan.bad is not None:
        _spoil(request, plan.bad)
    return request


def _spoil(request: ts.GenerateRequest, bad: str) -> None:
    sp = request.sampling_params
    match bad:
        case "empty_id":
            request.request_id = ""
        case "no_input" | "text_input":  # TokenSpeed's contract has no text input: the tokenized one is missing
            request.ClearField("tokenized")
        case "token_outside_vocab":
            request.tokenized.input_ids.append(VOCAB_SIZE + 7)
        case "empty_prompt":
            del request.tokenized.input_ids[:]
        case "prompt_fills_context":
            request.tokenized.input_ids.extend([FIRST_TOKEN] * 4096)
        case "max_tokens_zero":
            sp.max_new_tokens = 0
        case "max_tokens_too_big":
            sp.max_new_tokens = 1 << 20
        case "temperature_nan":
            sp.temperature = float("nan")
        case "temperature_negative":
            sp.temperature = -0.5
        case "top_p_above_1":
            sp.top_p = 1.5
        case "min_p_above_1":
            sp.min_p = 1.5
        case "n_above_64":
            sp.n = 65
        case "empty_stop_string":
            sp.stop.append("")
        case "logprobs":  # what TokenSpeed's wire only pre-aborts
            request.return_logprob, request.top_logprobs_num = True, 3
        case "min_tokens_above_max":
            sp.max_new_tokens, sp.min_new_tokens = 2, 3
        case "bad_logit_bias" | "logit_bias_negative_id":
            sp.logit_bias["-1"] = 1.0
        case "logit_bias_above_100":
            sp.logit_bias["5"] = 101.0
        case "bad_json_schema" | "json_schema_not_object":
            sp.json_schema = "[1, 2]"
        case "empty_regex" | "regex_with_nul" | "empty_choice" | "json_object_false" | "blank_grammar":
            sp.ebnf_grammar = "  "
        case "bad_dp_rank":
            request.data_parallel_rank = 5
        case _:
            # Further vLLM-only faults (truncation, PD params): TokenSpeed's own refusal of a PD request.
            request.kv_bootstrap_info.bootstrap_host = "10.0.0.1"


def ts_view(message: ts.GenerateResponse) -> pb.GenerateResponse:
    """A TokenSpeed response as vLLM's, field for field (counts as ``encode`` wrote them)."""
    kind = message.WhichOneof("response")
    if kind == "chunk":
        c = message.chunk
        chunk = pb.GenerateStreamChunk(token_ids=c.token_ids, prompt_tokens=c.prompt_tokens,
                                       completion_tokens=c.completion_tokens, cached_tokens=c.cached_tokens,
                                       index=c.index)
        chunk.output_logprobs.token_logprobs.extend(c.output_logprobs.token_logprobs)
        chunk.output_logprobs.token_ids.extend(c.output_logprobs.token_ids)
        return pb.GenerateResponse(chunk=chunk)
    assert kind == "complete", f"a TokenSpeed response with neither chunk nor complete: {message}"
    c = message.complete
    complete = pb.GenerateComplete(output_ids=c.output_ids, finish_reason=c.finish_reason,
                                   prompt_tokens=c.prompt_tokens, completion_tokens=c.completion_tokens,
                                   cached_tokens=c.cached_tokens, index=c.index)
    which = c.WhichOneof("matched_stop")
    if which == "matched_stop_str":
        complete.matched_stop_str = c.matched_stop_str
    elif which == "matched_token_id":
        complete.matched_token_id = c.matched_token_id
    return pb.GenerateResponse(complete=complete)
