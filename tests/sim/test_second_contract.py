"""A second contract through the same core: the simulation's seeds, served for the toy contract.

The request core and the hub are contract-neutral (``runtime/requests/contract.py``):
a contract adds an edge and nothing else. ``contract_toy.py`` is a minimal
one with its own request and response shapes; every seed of the sweep (the
same ``sim_seed`` parametrization as ``test_sim.py``) runs through it with
every check of the simulation (journal fold, tokens against the engine's,
one complete per choice, no call left open).
"""

from __future__ import annotations

import pytest

from tests.sim.contract_toy import TOY_EDGE, as_checked, toy_request
from tests.sim.runner import run_seed
from tests.sim.servicer import ClientContract

TOY_CLIENTS = ClientContract(TOY_EDGE, toy_request, as_checked)


def test_seed_second_contract(sim_seed, sim_model):
    model, tokenizer = sim_model
    run = run_seed(sim_seed, model, tokenizer, contract=TOY_CLIENTS)
    if run.violations:
        pytest.fail(run.report(), pytrace=False)
