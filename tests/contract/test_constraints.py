"""An engine ERROR on a constrained call is the engine's own report, never inferred to be the constraint's.

The sim engine enforces no constraint, but ends a request ERROR for the
cases vLLM's engine would without a grammar compiler (machines/sim_core.py
``_grammar_fails``): here, an EBNF grammar with no ``root`` rule. vLLM's wire
says only ERROR, the same finish a failed KV load or an encoder-cache miss
gives, so the reference's servicers answer it as any ERROR
(``complete{finish_reason: "error"}``); FAILED_PRECONDITION + the
``smg-constraint-failed`` trailer (which a router answers 422 and never
retries) takes the engine's own attribution, which only SGLang's ranks give
(``tests/machines/test_sglang_aborts.py``). A request running beside it is
untouched. The real engine's own compile errors are
tests/vllm/test_vllm_constraints.py.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.contract.helpers import CALL_TIMEOUT_S, Outcome, call, journal_rows, new_id, prompt, wait_idle
from tests.harness import generate_request

NO_ROOT = 'answer ::= "yes" | "no"'
TOKENS = 60


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streaming"])
@pytest.mark.parametrize("n", [1, 2])
def test_an_engine_error_on_a_constrained_call_is_not_inferred_to_be_the_constraints(slow_servicer, stream, n):
    stub = slow_servicer.stub
    rid = new_id("no-root")
    bystander = generate_request(new_id("beside"), prompt(7, 12), stream=True, temperature=0.0,
                                 max_tokens=TOKENS, ignore_eos=True)
    with ThreadPoolExecutor(1) as pool:
        beside = pool.submit(lambda: Outcome(list(stub.Generate(bystander, timeout=CALL_TIMEOUT_S))))
        outcome = call(stub, generate_request(rid, prompt(8), stream=stream, n=n, max_tokens=8, grammar=NO_ROOT))
        good = beside.result(CALL_TIMEOUT_S)
    # Each choice ends with the engine's own report (OK status: no FAILED_PRECONDITION, no trailer).
    assert [outcome.complete(i).finish_reason for i in range(n)] == ["error"] * n
    # The engine kept serving the request beside it, to its end.
    assert good.complete(0).finish_reason == "length" and len(good.streamed(0)) == TOKENS
    # The call reached the engine (this is the engine's verdict, not a refusal).
    assert any(r.stream == f"req/{rid}" for r in journal_rows(slow_servicer.journal, ("engine.request",)))
    wait_idle(stub)


def test_a_constraint_the_engine_takes_is_served(slow_servicer):
    # The sim does not enforce it, but takes it: the backend key is what vLLM's engine needs.
    outcome = call(slow_servicer.stub, generate_request(new_id("regex"), prompt(9), max_tokens=5, regex="[0-9]{3}",
                                                        ignore_eos=True))
    assert outcome.complete(0).finish_reason == "length"
    assert len(outcome.complete(0).output_ids) == 5
