"""A constraint the engine cannot continue under ends with a status naming it, never an OK "error" complete.

The sim engine enforces no constraint, but ends a request ERROR for the
cases vLLM's engine would without a grammar compiler (tools/sim_core.py
``_grammar_fails``): here, an EBNF grammar with no ``root`` rule. What the
client sees is FAILED_PRECONDITION, the message naming the constraint, and
the reference's trailing metadata ``smg-constraint-failed: engine``; a
request running beside it is untouched. The real engine's own compile
errors are tests/vllm/test_vllm_constraints.py.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tests.contract.helpers import CALL_TIMEOUT_S, Outcome, call, journal_rows, new_id, prompt, wait_idle, wait_journal
from tests.harness import generate_request

NO_ROOT = 'answer ::= "yes" | "no"'
TOKENS = 60


def _failed(stub, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(request, timeout=CALL_TIMEOUT_S))
    return caught.value


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streaming"])
@pytest.mark.parametrize("n", [1, 2])
def test_an_engine_side_constraint_failure_is_failed_precondition_with_the_trailer(slow_servicer, stream, n):
    stub = slow_servicer.stub
    rid = new_id("no-root")
    bystander = generate_request(new_id("beside"), prompt(7, 12), stream=True, temperature=0.0,
                                 max_tokens=TOKENS, ignore_eos=True)
    with ThreadPoolExecutor(1) as pool:
        beside = pool.submit(lambda: Outcome(list(stub.Generate(bystander, timeout=CALL_TIMEOUT_S))))
        error = _failed(stub, generate_request(rid, prompt(8), stream=stream, n=n, max_tokens=8, grammar=NO_ROOT))
        good = beside.result(CALL_TIMEOUT_S)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error.details()
    assert "could not continue the request under its constraint" in error.details()
    assert "sampling_params.grammar" in error.details() and "xgrammar" in error.details()
    assert ("smg-constraint-failed", "engine") in tuple(error.trailing_metadata() or ())
    # The engine kept serving the request beside it, to its end.
    assert good.complete(0).finish_reason == "length" and len(good.streamed(0)) == TOKENS
    # The call reached the engine (this is the engine's verdict, not a refusal) and ended failed.
    wait_journal(slow_servicer.journal,
                 lambda rows: any(r.kind == "transition" and r.stream == f"req/{rid}" and r.payload.get("dest") == "failed"
                                  for r in rows),
                 "the failed call's transition")
    assert any(r.stream == f"req/{rid}" for r in journal_rows(slow_servicer.journal, ("engine.request",)))
    wait_idle(stub)


def test_a_constraint_the_engine_takes_is_served(slow_servicer):
    # The sim does not enforce it, but takes it: the backend key is what vLLM's engine needs.
    outcome = call(slow_servicer.stub, generate_request(new_id("regex"), prompt(9), max_tokens=5, regex="[0-9]{3}",
                                                        ignore_eos=True))
    assert outcome.complete(0).finish_reason == "length"
    assert len(outcome.complete(0).output_ids) == 5
