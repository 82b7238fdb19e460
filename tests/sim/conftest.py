"""Fixtures and options of the simulation suite.

Seeds: ``--sim-seed N`` or ``ENGINELINK_SIM_SEED=N`` runs that one seed (the
reproduction line a failure prints); ``--sim-seeds N`` or
``ENGINELINK_SIM_SEEDS=N`` sweeps seeds 0..N-1 (``A:B`` sweeps A..B-1)
instead of the default ``DEFAULT_SEEDS``. The options exist when pytest is
pointed at ``tests/sim`` (``pytest tests/sim ...``); the environment
variables work from anywhere.
"""

from __future__ import annotations

import os

import pytest

from enginelink.runtime.engine.model_dir import load_tokenizer, read_model_facts

DEFAULT_SEEDS = 400
# The engine-restart sweep's (tests/sim/test_resume.py): fewer, each a plain seed's run with deaths added.
RESUME_SEEDS = 200


def pytest_addoption(parser):
    group = parser.getgroup("enginelink simulation")
    group.addoption("--sim-seed", type=int, default=None, help="run this one simulation seed")
    group.addoption("--sim-seeds", default=None, help="sweep seeds 0..N-1, or A..B-1 given as A:B")


def _option(config, name: str, env: str):
    try:
        value = config.getoption(name)
    except ValueError:  # the option is not registered: pytest was not pointed at tests/sim
        value = None
    return value if value is not None else os.environ.get(env) or None


def single_seed(config) -> int | None:
    value = _option(config, "sim_seed", "ENGINELINK_SIM_SEED")
    return None if value is None else int(value)


def sweep(config, default: int = DEFAULT_SEEDS) -> range:
    value = _option(config, "sim_seeds", "ENGINELINK_SIM_SEEDS")
    if value is None:
        return range(default)
    first, _, last = str(value).partition(":")
    return range(int(first), int(last)) if last else range(int(first))


def pytest_generate_tests(metafunc):
    if "sim_seed" in metafunc.fixturenames:
        one = single_seed(metafunc.config)
        seeds = [one] if one is not None else list(sweep(metafunc.config))
        metafunc.parametrize("sim_seed", seeds, ids=[f"seed={s}" for s in seeds])
    if "resume_seed" in metafunc.fixturenames:
        one = single_seed(metafunc.config)
        seeds = [one] if one is not None else list(sweep(metafunc.config, RESUME_SEEDS))
        metafunc.parametrize("resume_seed", seeds, ids=[f"seed={s}" for s in seeds])


@pytest.fixture(scope="session")
def sim_model(test_model_dir):
    """(model facts, tokenizer) of the test model: the simulated servicer's model."""
    model = read_model_facts(test_model_dir)
    return model, load_tokenizer(model.tokenizer_path)
