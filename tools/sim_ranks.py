"""The sim engine's launcher for ``--data-parallel-size N``: N rank processes, watched.

What vLLM's ``CoreEngineProcManager`` does for ``vllm serve --headless``: one
process per DP rank (here ``sim_engine --rank i --data-parallel-child``, each
dialling the front end's handshake socket with its own identity), and a
launcher that only watches them. Its rules:

- one rank exiting (killed, crashed) ends the launch: the other ranks get
  SIGTERM and the launcher exits 1 (vLLM's launcher raises "engine core
  died"), so the front end sees the whole engine go, as it would with vLLM;
- SIGTERM/SIGINT to the launcher stop every rank, then it exits 0; a rank
  that outlives ``RANK_STOP_GRACE_S`` gets SIGKILL;
- the ranks exit by themselves when the launcher goes (their parent changes),
  and all stay in the launcher's session, which the servicer stops whole;
- each rank's pid is logged (stderr, relayed by the servicer) so a test, or
  an operator, can kill one rank.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

POLL_S = 0.05
RANK_STOP_GRACE_S = 5.0


def _log(message: str) -> None:
    print(f"sim-engine[{os.getpid()}]: {message}", file=sys.stderr, flush=True)


def run_ranks(argv: list[str], size: int) -> int:
    stop: list[str] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stop.append(signal.Signals(signum).name))
    ranks: list[subprocess.Popen] = []
    try:
        for rank in range(size):
            # argparse takes the last --rank: the operator's own, if any, is overridden.
            command = [sys.executable, "-m", "enginelink.tools.sim_engine", *argv,
                       "--rank", str(rank), "--data-parallel-child"]
            ranks.append(subprocess.Popen(command))
            _log(f"DP rank {rank} started: pid {ranks[-1].pid}")
        parent = os.getppid()
        while not stop:
            for rank, process in enumerate(ranks):
                status = process.poll()
                if status is not None:
                    _log(f"DP rank {rank} (pid {process.pid}) exited with status {status}: stopping the engine")
                    return 1
            if os.getppid() != parent:
                _log("parent process exited: stopping the engine")
                return 0
            time.sleep(POLL_S)
        _log(f"stopping: {stop[0]}")
        return 0
    finally:
        _stop(ranks)


def _stop(ranks: list[subprocess.Popen]) -> None:
    for process in ranks:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + RANK_STOP_GRACE_S
    for process in ranks:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
