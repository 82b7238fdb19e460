"""The engine link on SGLang's scheduler wire: no handshake, a ready report on an inherited fd.

SGLang 0.5.23's scheduler (``--skip-tokenizer-init``, msgpack IPC) has no
start-up handshake (``reference/sglang-contract.md`` §5.1): the front end
binds a PUSH at ``scheduler_input_ipc_name`` and a PULL at
``tokenizer_ipc_name``; the scheduler connects to both and reports
``{"status": "ready", ...}`` on the pipe it was spawned with. Here that report
arrives as one JSON line on a pipe whose write end the engine process
inherits (the sim's ``--ready-fd``; the real launcher forwards its
``multiprocessing`` pipe the same way, ``runtime/contracts/sglang/sglang_headless.py``).

``SglangTransport`` is this wire's transport of an ``EngineLink``; everything
else is the link's and its supervision's (``supervision.py``): the process
in its own session, its output relayed with secrets hidden, the start-up
bound (silence extended while the process lives, the ceiling), the process
watch, the dropped-connection watch, the silence limit and the bounded stop;
the receive loop is the ZeroMQ transport's (``zmq_transport.receive_frames``).
Readiness is the line with ``status == "ready"``; the pipe closing first, a
line that is not JSON, a line over ``READY_LINE_MAX_BYTES`` or another
status fail the start-up.

Not on this wire: the idle liveness probe (SGLang has no side-effect-free
control call to ask: flush and profile change the engine; ``HealthCheck``
runs a real one-token request instead), DP ranks (one scheduler rank; the
DP controller is not driven), the engine's facts file (its ready report is
its facts).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import trio
import zmq

from enginelink.runtime.engine.session import stop_session
from enginelink.runtime.engine.link_errors import LinkFailed
from enginelink.runtime.engine.zmq_transport import MONITOR_EVENTS, link_paths, receive_frames, wait_disconnected
from enginelink.runtime.engine.zmq_trio import make_socket
from enginelink.wire.sglang import SGLANG_VERSION

log = logging.getLogger("enginelink.link")

# The ready report is a small dict (a few numbers); anything longer is not one.
READY_LINE_MAX_BYTES = 64 * 1024
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
    return facts


class SglangTransport:
    """The engine connects to our PUSH/PULL and reports readiness on a pipe it inherits."""

    # SGLang has no control call without side effects to probe an idle scheduler with.
    idle_probes = False

    def __init__(self, launcher, max_model_len: int | None = None) -> None:
        self.launcher = launcher
        self.max_model_len = max_model_len  # the model directory's, a cap on what the report implies
        self._context = zmq.Context.instance()
        self._sockets: list[zmq.Socket] = []
        self._push: zmq.Socket | None = None
        self._outputs: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._paths: list[Path] = []

    async def start(self, link, nursery) -> LinkFailed | None:
        """Bind, launch, wait for the ready report; the failure if the engine did not come up."""
        push = make_socket(self._context, zmq.PUSH)
        outputs = make_socket(self._context, zmq.PULL)
        self._sockets = [push, outputs]
        in_path, out_path = self._paths = link_paths(link.name, "in.sock", "out.sock")
        push.bind(f"ipc://{in_path}")
        outputs.bind(f"ipc://{out_path}")
        self._monitor = outputs.get_monitor_socket(MONITOR_EVENTS)
        self._sockets.append(self._monitor)
        read_fd, write_fd = os.pipe()
        async with trio.lowlevel.FdStream(read_fd) as pipe:  # the stream owns our end
            try:
                argv, env = self.launcher.scheduler_command(f"ipc://{in_path}", f"ipc://{out_path}", write_fd)
                await link.launch(nursery, argv, env, {"inputs": f"ipc://{in_path}", "outputs": f"ipc://{out_path}",
                                                       "readiness": "ready_fd"}, pass_fds=(write_fd,))
            finally:
                os.close(write_fd)  # the engine's now: EOF on our end means it is gone
            failure = await link.run_handshake(lambda: self._await_ready(link, pipe))
        if failure is None:
            link.read_facts(None)  # journals the facts (the report is all of them)
            self._push, self._outputs = push, outputs
        return failure

    def send(self, frames: list[bytes], rank: int = 0) -> None:
        """One message to the scheduler (its single rank); never blocks."""
        if self._push is None:
            raise LinkFailed("engine link is not connected")
        if rank != 0:
            raise LinkFailed(f"the engine has no DP rank {rank}")
        self._push.send_multipart(frames, zmq.NOBLOCK)

    async def receive(self, link) -> None:
        await receive_frames(self._outputs, link)

    async def wait_disconnected(self) -> None:
        await wait_disconnected(self._monitor)

    async def stop_process(self, process, grace_s: float) -> None:
        await stop_session(process, grace_s)

    def close(self) -> None:
        self._push = self._outputs = None
        for sock in self._sockets:
            sock.close(linger=0)
        self._sockets = []

    def remove_files(self) -> None:
        for path in self._paths:
            path.unlink(missing_ok=True)

    async def _await_ready(self, link, pipe: trio.lowlevel.FdStream) -> None:
        """Read the ready report's line; ``LinkFailed`` when it is not a ready report."""
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
        link.ready = ready_facts({**launch_facts(getattr(self.launcher, "extra_args", [])), **report},
                                 self.max_model_len)
        link.rank_ready = {0: link.ready}
        link.ranks.set_ranks((0,))
