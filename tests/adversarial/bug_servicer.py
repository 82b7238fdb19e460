"""``enginelink serve`` with bugs injected, for test_adv_internal.py (not a test module).

Run as ``python bug_servicer.py PORT METRICS_PORT JOURNAL MODEL_DIR``: it
monkeypatches three places of this process's servicer (no production hook
exists for this, nor should one), then serves exactly as ``enginelink
serve`` does until SIGTERM. It runs in its own process because the
servicer's gRPC health service and the test client's (grpcio's) register the
same protobuf names, which one process cannot hold twice.

- vLLM's ``facts.model_info`` always raises (GetModelInfo);
- ``RequestHub.take`` raises for request ids starting ``bug-after`` (a bug
  after admission: the call must still end);
- ``validate_generate`` raises for request ids starting ``bug-before``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import trio

from enginelink.machines.warmup import warmup_setting
from enginelink.runtime.contracts.vllm import facts
from enginelink.runtime.contracts.vllm.edge import VllmEdge
from enginelink.runtime.requests.hub import RequestHub
from enginelink.runtime.engine.launchers import SimLauncher
from enginelink.runtime.engine.model_dir import read_model_facts
from enginelink.runtime.lifetime.server import ServeConfig, serve


def install_bugs() -> None:
    def model_info(app):
        raise ZeroDivisionError("injected bug in model_info")

    take = RequestHub.take

    def broken_take(self, call, now):
        if call.spec.request_id.startswith("bug-after"):
            raise ZeroDivisionError("injected bug in take")
        return take(self, call, now)

    validate = VllmEdge.validate  # the vLLM contract's validator, which the Generate loop calls

    def broken_validate(request, limits, now):
        if request.request_id.startswith("bug-before"):
            raise ZeroDivisionError("injected bug in validate_generate")
        return validate(request, limits, now)

    facts.model_info = model_info
    RequestHub.take = broken_take
    VllmEdge.validate = staticmethod(broken_validate)


def main() -> int:
    port, metrics_port, journal, model_dir = sys.argv[1:5]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_bugs()
    config = ServeConfig(
        launcher=SimLauncher(model_dir=Path(model_dir)),
        model=read_model_facts(Path(model_dir)),
        served_model_name="tiny",
        port=int(port),
        journal_path=Path(journal),
        warmup=warmup_setting({"ENGINELINK_WARMUP": "off"}),
        metrics_port=int(metrics_port),
        argv=list(sys.argv),
    )
    return trio.run(serve, config)


if __name__ == "__main__":
    sys.exit(main())
