"""The deterministic simulation suite: the servicer core against the sim engine, seed by seed.

Each seed draws a run (``scenario.py``): engine cost model and wire latency,
warm-up, client traffic (streaming and not, n > 1, stop strings and ids,
aborts by id, clients that go away, slow clients, retries and duplicate
ids, invalid requests) and engine faults (process exit, ENGINE_CORE_DEAD,
the engine core exiting under a live launcher, silence, garbage and stray
frames, a handshake that never completes), then SIGTERM. ``runner.py``
plays it on trio's MockClock and ``checks.py`` says what must hold.

- ``test_seed``: a sweep of seeds (``DEFAULT_SEEDS`` in the normal run;
  ``ENGINELINK_SIM_SEEDS=5000`` for more), or the one seed a failure names;
- ``test_hypothesis_seeds``: Hypothesis draws seeds beyond the sweep and
  shrinks a failing one to the smallest it finds;
- ``test_same_seed_same_journal*``: a seed's journal is the same bytes on
  every run, in this process and in another one with another hash seed.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tests.sim.conftest import single_seed
from tests.sim.runner import repro, run_seed

HYPOTHESIS_EXAMPLES = 40
# Busy seeds of the current scenario generator: traffic and warm-up; aborts, latency, a stray frame and
# ENGINE_CORE_DEAD; a dropped engine core; silence that fails the link.
DETERMINISM_SEEDS = (106, 119, 314, 404)
ROOT = Path(__file__).resolve().parents[2]


def _run_and_check(seed: int, sim_model) -> None:
    model, tokenizer = sim_model
    run = run_seed(seed, model, tokenizer)
    if run.violations:
        pytest.fail(run.report(), pytrace=False)


def test_seed(sim_seed, sim_model):
    _run_and_check(sim_seed, sim_model)


def test_hypothesis_seeds(sim_model, request):
    if single_seed(request.config) is not None:
        pytest.skip("one seed was asked for")
    model, tokenizer = sim_model

    @settings(
        max_examples=HYPOTHESIS_EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(seed=st.integers(min_value=0, max_value=2**32 - 1))
    def explore(seed: int) -> None:
        run = run_seed(seed, model, tokenizer)
        assert not run.violations, run.report()

    explore()


def journal_digest(rows: list[tuple]) -> str:
    return hashlib.sha256(msgspec.msgpack.encode(rows)).hexdigest()


def _determinism_seeds(config) -> list[int]:
    one = single_seed(config)
    return [one] if one is not None else list(DETERMINISM_SEEDS)


def test_same_seed_same_journal(sim_model, request):
    model, tokenizer = sim_model
    for seed in _determinism_seeds(request.config):
        first = run_seed(seed, model, tokenizer)
        second = run_seed(seed, model, tokenizer)
        if seed in DETERMINISM_SEEDS:
            assert len(first.journal_rows) > 500, f"seed {seed} journals too little to be a determinism check"
        assert first.journal_rows == second.journal_rows, f"seed {seed}: two runs, two journals; {repro(seed)}"


@pytest.mark.process
def test_same_seed_same_journal_in_another_process(sim_model, test_model_dir, request):
    """Nothing depends on the process: not hash order (another PYTHONHASHSEED), not object ids."""
    model, tokenizer = sim_model
    seeds = _determinism_seeds(request.config)
    here = {seed: journal_digest(run_seed(seed, model, tokenizer).journal_rows) for seed in seeds}
    code = (
        "import sys, json\n"
        "from enginelink.runtime.engine.model_dir import read_model_facts, load_tokenizer\n"
        "from tests.sim.runner import run_seed\n"
        "from tests.sim.test_sim import journal_digest\n"
        "model = read_model_facts(sys.argv[1]); tokenizer = load_tokenizer(model.tokenizer_path)\n"
        "print(json.dumps({s: journal_digest(run_seed(int(s), model, tokenizer).journal_rows) for s in sys.argv[2:]}))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "4242", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code, str(test_model_dir), *map(str, seeds)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    there = msgspec.json.decode(result.stdout.strip().splitlines()[-1])
    assert {int(s): d for s, d in there.items()} == here
