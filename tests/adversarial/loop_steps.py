"""``enginelink serve``, recording how long each trio task step held the event loop (measure_inputs.py).

Not a test: ``python -m tests.adversarial.loop_steps serve ...`` runs the CLI
with a trio instrument that writes every task step of 5 ms or more of the
servicer thread's CPU time to ``$ENGINELINK_MEASURE_STEPS`` (monotonic time,
milliseconds, the task's name). CPU time, not wall time: on a shared machine
the servicer is also kept waiting by other processes, which says nothing
about what it does itself. Every gRPC call is served from trio tasks (grpclib
under trio-asyncio is one of them), so the longest step is the longest any
other client could have waited for the servicer.
"""

from __future__ import annotations

import os
import sys
import time

import trio

from enginelink.tools.cli import main


class Steps(trio.abc.Instrument):
    def __init__(self, path: str) -> None:
        self.out = open(path, "a", buffering=1)
        self.started = 0.0

    def before_task_step(self, task) -> None:
        self.started = time.thread_time()

    def after_task_step(self, task) -> None:
        used = time.thread_time() - self.started
        if used >= 0.005:
            self.out.write(f"{time.monotonic():.3f} {used * 1000:.1f} {task.name}\n")


def _run(real_run):
    def run(*args, **kwargs):
        kwargs["instruments"] = [*kwargs.get("instruments", ()), Steps(os.environ["ENGINELINK_MEASURE_STEPS"])]
        return real_run(*args, **kwargs)

    return run


if __name__ == "__main__":
    trio.run = _run(trio.run)
    sys.exit(main())
