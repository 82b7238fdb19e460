"""The engine link on SGLang's scheduler wire: no handshake, a ready report on an inherited fd.

SGLang 0.5.23's scheduler (msgpack IPC) has no
start-up handshake (``reference/sglang-contract.md`` §5.1): the front end
binds a PUSH at ``scheduler_input_ipc_name`` and a PULL at
``tokenizer_ipc_name``; the scheduler connects to both and reports
``{"status": "ready", ...}`` on the pipe it was spawned with. Here that report
arrives as one JSON line on a pipe whose write end the engine process
inherits (the sim's ``--ready-fd``; the real launcher forwards its
``multiprocessing`` pipe the same way, ``runtime/contracts/sglang/sglang_headless.py``).

``SglangTransport`` is this wire's transport of an ``EngineLink``; everything
else is the link's and its supervision's (``supervision.py``): the process
in its own process group, its output relayed with secrets hidden, the start-up
bound (silence extended while the process lives, the ceiling), the process
watch, the dropped-connection watch, the silence limit and the bounded stop;
the receive loop is the ZeroMQ transport's (``zmq_transport.receive_frames``).
Readiness is the line with ``status == "ready"``; the pipe closing first, a
line that is not JSON, a line over ``READY_LINE_MAX_BYTES`` or another
status fail the start-up.

Data parallelism (``--dp-size N``): SGLang's own DP controller runs the N
scheduler ranks behind the one input address (it binds each rank's input
and places each request; ``runtime/contracts/sglang/sglang_headless.py`` launches it
as SGLang's own launcher does), and every rank pushes its outputs to the one
output address. enginelink still decides the rank: the hub puts its pick in
every request (``routed_dp_rank``, which the controller honours before any
balancing of its own; the codec's ``rank_in_request``), so a pin, the
least-loaded choice and a prefill leg's room residue all land where
enginelink says. A control call (flush, profile) reaches every rank through
the controller, each answering under the call's id (``control_fan_out``).
Driving each rank's scheduler directly (one PUSH per rank) would leave out
SGLang's own rank layout (its GPU ids, worker ports and attention-DP groups),
which only the controller's launch code knows.

Not on this wire: the idle liveness probe (SGLang has no side-effect-free
control call to ask: flush and profile change the engine; ``HealthCheck``
runs a real one-token request instead), the engine's facts file (its ready
report is its facts, with what the launch says, ``launcher.launch_facts``).
"""

from __future__ import annotations

import json
import logging
import os

import trio
import zmq

from enginelink.runtime.engine.engine_processes import stop_engine_processes
from enginelink.runtime.engine.link_errors import LinkFailed
from enginelink.runtime.engine.grammar_labels import sglang_grammar_backend
from enginelink.runtime.engine.zmq_transport import IpcSockets, link_paths
from enginelink.wire.sglang import SGLANG_VERSION

log = logging.getLogger("enginelink.link")

# The ready report is a small dict (a few numbers); anything longer is not one.
READY_LINE_MAX_BYTES = 64 * 1024
# The ready report may come before the scheduler's PULL has finished connecting to our PUSH (ZeroMQ
# connects in the background; a send meanwhile fails with EAGAIN): the start waits this long for it.
CONNECT_TIMEOUT_S = 10.0
CONNECT_POLL_S = 0.005
# SGLang 0.5.23's report (Scheduler.get_init_info) has no batch cap; without --max-running-requests
# the warm-up plan and GetLoads assume this many.
MAX_RUNNING_REQUESTS_ASSUMED = 256


def launch_facts(extra_args: list[str]) -> dict:
    """What the engine's arguments say that its ready report does not: its batch cap, a pooling model."""
    from enginelink.runtime.engine.launchers import flag_value

    facts: dict = {}
    cap = flag_value(extra_args, "--max-running-requests")
    if cap and cap.isdigit():
        facts["max_running_requests"] = int(cap)
    if "--is-embedding" in extra_args or flag_value(extra_args, "--runner") == "pooling":
        facts["is_generation"] = False
    return facts


def ready_facts(report: dict, max_model_len: int | None) -> dict:
    """SGLang's ready report with the facts the rest of the servicer reads under vLLM's names.

    ``max_req_input_len`` is the longest prompt the scheduler takes, so the
    context is one more; ``max_running_requests`` is its batch cap;
    ``chunked_prefill_size`` (when the report has it) its prefill step.
    """
    facts = dict(report)
    input_len = int(report.get("max_req_input_len") or 0)
    context = input_len + 1 if input_len else (max_model_len or 0)
    if max_model_len:
        context = min(context, max_model_len)
    facts.setdefault("max_model_len", context)
    facts.setdefault("max_num_seqs", int(report.get("max_running_requests") or MAX_RUNNING_REQUESTS_ASSUMED))
    if report.get("is_generation") is False:
        facts.setdefault("runner_type", "pooling")  # an embedding model: Embed, not Generate
    # The prefill step (the warm-up plan's): SGLang's chunked-prefill size when it says, else a whole prompt.
    facts.setdefault("max_num_batched_tokens", int(report.get("chunked_prefill_size") or 0) or context)
    facts.setdefault("engine_version", f"sglang-{SGLANG_VERSION}")
    facts.setdefault("data_parallel_size", 1)
    # The grammar backend the scheduler built, as its resolved arguments say (none without its tokenizer):
    # the constraint checks read it under vLLM's name (``app.limits``).
    facts.setdefault("structured_outputs_backend", sglang_grammar_backend(report.get("server_args") or {}))
    return facts


def launcher_ranks(launcher) -> tuple[int, ...]:
    """The DP ranks the launch runs (``--dp-size``; ``tools/serve.py`` sets them), 0..N-1."""
    return tuple(getattr(launcher, "ranks", None) or (0,))


class SglangTransport:
    """The engine connects to our PUSH/PULL and reports readiness on a pipe it inherits."""

    # SGLang has no control call without side effects to probe an idle scheduler with.
    idle_probes = False

    def __init__(self, launcher, max_model_len: int | None = None) -> None:
        self.launcher = launcher
        self.max_model_len = max_model_len  # the model directory's, a cap on what the report implies
        self.ipc = IpcSockets()
        self._push: zmq.Socket | None = None
        self._ranks = frozenset(launcher_ranks(launcher))

    @property
    def control_fan_out(self) -> int:
        """How many answers one control message gets: one per rank behind SGLang's DP controller."""
        return len(self._ranks)

    async def start(self, link, nursery) -> LinkFailed | None:
        """Bind, launch, wait for the ready report; the failure if the engine did not come up."""
        ipc = self.ipc
        push, outputs = ipc.socket(zmq.PUSH), ipc.socket(zmq.PULL)
        in_path, out_path = ipc.paths = link_paths(link.name, "in.sock", "out.sock")
        push.bind(f"ipc://{in_path}")
        outputs.bind(f"ipc://{out_path}")
        ipc.watch(outputs)
        read_fd, write_fd = os.pipe()
        async with trio.lowlevel.FdStream(read_fd) as pipe:  # the stream owns our end
            try:
                argv, env = self.launcher.scheduler_command(f"ipc://{in_path}", f"ipc://{out_path}", write_fd)
                await link.launch(nursery, argv, env, {"inputs": f"ipc://{in_path}", "outputs": f"ipc://{out_path}",
                                                       "readiness": "ready_fd"}, pass_fds=(write_fd,))
            finally:
                os.close(write_fd)  # the engine's now: EOF on our end means it is gone
            failure = await link.run_handshake(lambda: self._await_ready(link, pipe, push))
        if failure is None:
            link.read_facts(None)  # journals the facts (the report is all of them)
            self._push, ipc.outputs = push, outputs
        return failure

    def send(self, frames: list[bytes], rank: int = 0) -> None:
        """One message to the scheduler (its single rank); never blocks."""
        if self._push is None:
            raise LinkFailed("engine link is not connected")
        if rank not in self._ranks:
            raise LinkFailed(f"the engine has no DP rank {rank}")
        self._push.send_multipart(frames, zmq.NOBLOCK)

    async def receive(self, link) -> None:
        await self.ipc.receive(link)

    async def wait_disconnected(self) -> None:
        await self.ipc.wait_disconnected()

    async def stop_process(self, process, grace_s: float) -> None:
        await stop_engine_processes(process, grace_s)

    def close(self) -> None:
        self._push = None
        self.ipc.close()

    def remove_files(self) -> None:
        self.ipc.remove_files()

    async def _await_ready(self, link, pipe: trio.lowlevel.FdStream, push: zmq.Socket) -> None:
        """Read the ready report's line, then wait for the scheduler's input connection (a request sent
        before it would fail: seen when a restart re-sent its held requests at once); ``LinkFailed``
        when it is not a ready report or the connection does not come."""
        buffer = b""
        while b"\n" not in buffer:
            data = await pipe.receive_some(READY_LINE_MAX_BYTES)
            if not data:
                raise LinkFailed("the engine closed its ready pipe without reporting ready")
            buffer += data
            if len(buffer) > READY_LINE_MAX_BYTES:
                raise LinkFailed(f"the engine's ready report is over {READY_LINE_MAX_BYTES} bytes")
        line = buffer.split(b"\n", 1)[0]
        try:
            report = json.loads(line)
        except ValueError:
            raise LinkFailed(f"the engine's ready report is not JSON: {line[:200]!r}") from None
        if not isinstance(report, dict) or report.get("status") != "ready":
            raise LinkFailed(f"the engine reported {str(report)[:300]} instead of ready")
        link.journal_handshake("ready", report)
        ranks = launcher_ranks(self.launcher)
        link.ready = ready_facts({**launch_facts(getattr(self.launcher, "extra_args", [])),
                                  **getattr(self.launcher, "launch_facts", {}),
                                  "data_parallel_size": len(ranks), **report}, self.max_model_len)
        # The DP controller reports for all its ranks at once (SGLang's own ready dict has no rank).
        link.rank_ready = {rank: {**link.ready, "data_parallel_rank": rank} for rank in ranks}
        link.ranks.set_ranks(ranks)
        with trio.move_on_after(CONNECT_TIMEOUT_S):
            while not push.getsockopt(zmq.EVENTS) & zmq.POLLOUT:
                await trio.sleep(CONNECT_POLL_S)
            return
        raise LinkFailed(f"the engine reported ready but did not connect to its input socket within {CONNECT_TIMEOUT_S:g} s")
