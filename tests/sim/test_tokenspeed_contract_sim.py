"""The simulation's seeds, served for TokenSpeed's contract: its edge under every seed's plans.

The same sweep as ``test_sim.py`` / ``test_second_contract.py`` (``sim_seed``),
with the clients speaking ``tokenspeed.grpc.scheduler.TokenSpeedScheduler``
(``contract_tokenspeed_client.py``): every check of the simulation holds (journal
fold, tokens against the engine's, one complete per choice, refusals before the
engine, no call left open), with ``n > 1`` as child ids ``<id>-n<i>``.
"""

from __future__ import annotations

import pytest

from enginelink.runtime.contracts.tokenspeed.edge import TOKENSPEED_EDGE
from tests.sim.contract_tokenspeed_client import ts_request, ts_view
from tests.sim.runner import run_seed
from tests.sim.servicer import ClientContract

TOKENSPEED_CLIENTS = ClientContract(TOKENSPEED_EDGE, ts_request, ts_view)


def test_seed_tokenspeed_contract(sim_seed, sim_model):
    model, tokenizer = sim_model
    run = run_seed(sim_seed, model, tokenizer, contract=TOKENSPEED_CLIENTS)
    if run.violations:
        pytest.fail(run.report(), pytrace=False)
