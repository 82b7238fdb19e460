"""One DP rank's death fails the whole servicer cleanly (real processes; slow).

The sim engine launched with ``--data-parallel-size 2`` runs each rank in its
own process under one launcher, as ``vllm serve --headless`` does. Killing
one rank's process (SIGKILL: no last words) must end every stream in flight,
on both ranks, with UNAVAILABLE, stop the other rank and the launcher, and
make the servicer exit 1, so its supervisor restarts the pair.
"""

from __future__ import annotations

import re
import signal
import os

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from tests.contract.helpers import CALL_TIMEOUT_S, SLOW_ENGINE_ARGS, new_id, prompt
from tests.harness import Servicer, alive, engine_pid, generate_request, wait_until

pytestmark = [pytest.mark.process, pytest.mark.slow]


def _rank_pids(servicer: Servicer) -> dict[int, int]:
    """Each rank's pid, as the sim engine's launcher logs it (relayed into the servicer's log)."""
    return {int(rank): int(pid) for rank, pid in re.findall(r"DP rank (\d+) started: pid (\d+)", servicer.log())}


def _stream(stub, rank: int):
    request = generate_request(new_id(f"death{rank}"), prompt(rank), stream=True, temperature=0.0,
                               max_tokens=2000, ignore_eos=True)
    request.data_parallel_rank = rank
    stream = stub.Generate(request, timeout=60)
    assert next(stream).WhichOneof("response") == "chunk"
    return stream


@pytest.mark.parametrize("victim", [0, 1])
def test_one_rank_killed_fails_every_stream_and_the_servicer_exits_1(tmp_path, test_model_dir, victim):
    servicer = Servicer(tmp_path, model_dir=test_model_dir,
                        engine_args=[*SLOW_ENGINE_ARGS, "--data-parallel-size", "2"]).start()
    try:
        stub = servicer.stub
        pids = wait_until(lambda: len(_rank_pids(servicer)) == 2 and _rank_pids(servicer), CALL_TIMEOUT_S,
                          "both ranks' pids in the log")
        launcher = engine_pid(servicer.journal)
        streams = {rank: _stream(stub, rank) for rank in (0, 1)}
        os.kill(pids[victim], signal.SIGKILL)
        for rank, stream in streams.items():
            with pytest.raises(grpc.RpcError) as ended:
                for _ in stream:
                    pass
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE, (rank, ended.value.details())
        assert servicer.wait(timeout_s=30) == 1
        log = servicer.log()
        assert "exiting with status 1" in log
        # Nothing of the engine outlives the servicer: the other rank and the launcher are gone too.
        for pid in (launcher, *pids.values()):
            assert not alive(pid), f"engine process {pid} outlived the servicer"
    finally:
        servicer.stop()
