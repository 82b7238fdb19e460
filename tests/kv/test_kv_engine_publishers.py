"""The relay against SGLang's and TokenSpeed's own publishers: their ``ZmqEventPublisher``, their replay ROUTER.

Each engine's publisher runs in its struct-only venv (``tests/wire/kv_peer.py``:
the engine's class, its PUB, its replay socket, its publisher thread, batches
of the engine's own structs) on ipc endpoints the relay's plan names, read
in the engine's dialect (``wire/kv_engines.py``). The relay joins late:
three batches are out before it subscribes, so the first it sees live is
number 3, and 0..2 must come from the engine's replay ROUTER (SGLang's
replies carry the topic frame, TokenSpeed's do not). A subscriber from 0
then gets all five, in order, as the engine numbered them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import trio

from enginelink.machines.kv_relay_api import KIND_KV_BATCH, KvRelayConfig
from enginelink.runtime.kv.kv_config import KvPlan, RankEndpoints
from enginelink.runtime.kv.kv_loads import LoadSource
from enginelink.runtime.kv.kv_relay import KvRelayShell
from enginelink.runtime.context.loads import Loads
from enginelink.runtime.context.submit import TrioWake
from enginelink.wire import kv_engines as ke
from enginelink.wire.kv_batch import KvStored
from tests.kv.test_kv_shell import ListJournal
from tests.wire.engine_venvs import side_python_or_skip

pytestmark = pytest.mark.process  # the engine's publisher is a process of its venv

PEER = Path(__file__).parents[1] / "wire" / "kv_peer.py"
BASE = 1 << 40
CONFIG = {"sglang": {"publisher": "zmq", "topic": "kv"},
          "tokenspeed": {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv"}}


class Publisher:
    def __init__(self, engine: str, endpoint: str, replay: str) -> None:
        python = side_python_or_skip(engine)
        self.proc = subprocess.Popen([python, str(PEER), engine, "publish", endpoint, replay, "kv"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert self.line() == "ready"

    def line(self) -> str:
        line = self.proc.stdout.readline().strip()
        assert line, f"the publisher exited ({self.proc.poll()})"
        return line

    def publish(self, count: int) -> str:
        self.proc.stdin.write(f"{count}\n")
        self.proc.stdin.flush()
        return self.line()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.mark.parametrize("engine", ["sglang", "tokenspeed"])
def test_a_late_relay_repairs_the_engines_first_batches_from_its_replay(engine):
    folder = Path(tempfile.mkdtemp(prefix="el-kv-", dir="/tmp"))  # ipc paths must stay short
    pub, replay = f"ipc://{folder}/pub.sock", f"ipc://{folder}/replay.sock"
    config = ke.parse_config(json.dumps({**CONFIG[engine], "endpoint": pub, "replay_endpoint": replay}), engine)
    assert config.publishing and ke.pub_binds(config, pub)  # the engine binds an ipc PUB; the relay's SUB connects
    publisher = Publisher(engine, pub, replay)
    try:
        assert publisher.publish(3) == "published 2"  # before anyone listens: only the replay buffer has them
        plan = KvPlan(config, (RankEndpoints(0, pub, False, replay),), True, KvRelayConfig(replay=True))
        shell = KvRelayShell(plan, ListJournal(), LoadSource(Loads(), limits=lambda: (4, 64)), sequence_base=BASE)
        batches = trio.run(_relay_then_publish, shell, publisher)
    finally:
        publisher.close()
        shutil.rmtree(folder, ignore_errors=True)
    assert [b.sequence_number for b in batches] == [BASE + i for i in range(5)]
    for seq, batch in enumerate(batches):
        (event,) = batch.events
        assert isinstance(event.data, KvStored), event
        (block,) = event.data.blocks
        assert (block.block_hash, block.token_ids, block.block_size) == (seq + 1, (seq,) * 4, 4)
        assert event.data.parent_block_hash == (seq or None) and batch.dp_rank == 0
    sources = {p["seq"]: p["source"] for _, _, kind, p in shell.journal.records if kind == KIND_KV_BATCH}
    assert sorted(sources) == [0, 1, 2, 3, 4]
    assert [sources[i] for i in range(3)] == ["replay"] * 3  # the engine's own ROUTER answered


async def _relay_then_publish(shell: KvRelayShell, publisher: Publisher) -> list:
    out = []
    # Bounds that only keep a broken run from hanging (a loaded CI box once took over 20 s to join).
    with trio.fail_after(180):
        async with trio.open_nursery() as nursery:
            await nursery.start(shell.run)
            joined = await shell.after_handshake({}, grace_s=90)
            assert joined, "the relay's SUB did not join the engine's PUB within 90 s"
            assert await trio.to_thread.run_sync(publisher.publish, 2) == "published 4"
            wake = TrioWake()
            stream = shell.open_stream(0, False, wake)
            while len(out) < 5:
                pull = shell.pull(stream)
                assert pull.end is None, pull.end
                out += pull.batches
                if len(out) < 5:
                    await wake.wait()
                    wake.clear()
            shell.close_stream(stream)
            nursery.cancel_scope.cancel()
    return out
