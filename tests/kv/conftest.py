"""Fixtures of the KV suite: ``enginelink serve`` over the sim engine, KV events on by default."""

from __future__ import annotations

import pytest

from enginelink.journal.records import KIND_KV_INCARNATION
from enginelink.journal.store import open_reader
from tests.harness import Servicer, free_port, shared, wait_until

# The warm-up is fast on the sim and exercises "subscribed before the warm-up";
# tests that count batches from the first one turn it off.
NO_WARMUP = {"SMG_VLLM_SERVICER_WARMUP": "off"}


def kv_servicer(tmp, model_dir, *, engine_args=None, env=None, metrics=False) -> Servicer:
    extra = ["--metrics-port", str(free_port())] if metrics else []
    servicer = Servicer(tmp, model_dir=model_dir, extra=extra, engine_args=engine_args,
                        env={"ENGINELINK_DRAIN_SECS": "0.2", **(env or {})})  # fmt: skip
    servicer.metrics_port = int(extra[1]) if metrics else None
    return servicer


def sequence_base(servicer: Servicer, rank: int = 0) -> int:
    """The number the relay serves for the publisher's batch 0 (its start record in the journal)."""

    def found():
        records = open_reader(servicer.journal).records(kinds=[KIND_KV_INCARNATION], stream_prefix=f"kv/{rank}")
        return [r.payload["base"] for r in records if r.payload["inc"] == 0]

    return wait_until(found, 5, "the relay's start record")[0]


@pytest.fixture(scope="module")
def kv_default(tmp_path_factory, test_model_dir):
    """KV events on by default, the full warm-up, a metrics endpoint."""
    with shared(kv_servicer(tmp_path_factory.mktemp("kv-default"), test_model_dir, metrics=True)) as servicer:
        yield servicer
