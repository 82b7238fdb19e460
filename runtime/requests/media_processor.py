"""The media processor helper's shell: one child per servicer, bounded, restarted after a death.

Fetched image, video and audio bytes become vLLM's ``mm_features`` in the
model's own processors, which need torch and live in the vLLM venv;
enginelink's venv has no torch. So ``media_processor_child.py`` runs there
(by path, with the vLLM venv's python, given the engine's own arguments so
its model config is the engine's) and this module is its trio-side client
(docs/limits.md, "Media processor"). ``MediaProcessor.process`` is the one
entry point, for the worker's ``inprocess`` mode and for anything else that
processes media for a vLLM engine (the Redis sidecar):

- **one child, started lazily** at the first media ref (a servicer that
  never sees one never pays vLLM's import), within
  ``ENGINELINK_MM_PROCESSOR_START_TIMEOUT_S`` (default 180);
- **one request at a time** in the child (the processor is CPU-bound); the
  callers queue on a lock, their number already bounded by
  ``SMG_VLLM_MM_MAX_INFLIGHT`` and their bytes by the fetch caps;
- **bounded in time**: a request's whole turn (queue and processing) is
  bounded by ``ENGINELINK_MM_PROCESS_TIMEOUT_S`` (default 60); past it the
  caller gets ``UNAVAILABLE`` (the router retries elsewhere), and a child
  caught mid-request is killed, since its state is then unknown;
- **bounded in bytes**: a reply frame larger than
  ``ENGINELINK_MM_MAX_TENSOR_BYTES`` plus slack is the child's fault: it is
  killed and the request gets ``UNAVAILABLE``;
- **its death** (EOF, a broken pipe, a bad frame) fails only the request in
  hand, with ``UNAVAILABLE`` naming the helper; the next request starts a
  fresh child (``smg_servicer_media_processor_starts_total`` counts them).

Whose fault: a body the processor cannot decode, or media the model cannot
take, is the client's (``INVALID_ARGUMENT`` naming the item); the helper's
death, slowness or a failed start is ours and retryable (``UNAVAILABLE``);
an exception inside the processor on good input is ``INTERNAL``.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import msgspec
import trio

from enginelink.runtime.errors import ClientError, ServicerError, Unavailable

CHILD_SCRIPT = Path(__file__).with_name("media_processor_child.py")
HEADER = struct.Struct(">I")
ENGINE_ARGS_ENV = "ENGINELINK_MM_ENGINE_ARGS"  # media_processor_child.py reads the engine's arguments there
# What a reply frame may hold beyond its tensors: the prompt's ids, hashes, field specs.
REPLY_SLACK_BYTES = 16 << 20


class Processed(NamedTuple):
    """One request's media, processed: what the engine takes, and what the servicer checks and reports."""

    prompt: list[int]  # the prompt with its placeholders expanded
    features: list  # the engine's mm_features, in prompt order (msgpack-ready, tensors inline)
    embeds: list[tuple[str, int, int]]  # per item: (modality, its index in that modality, feature tokens)
    identity: list[dict] | None  # per modality: hashes, placeholders, grid tensors (a PD decode side's)


class ProcessorFailed(ServicerError):
    """The processor raised on input it accepted: not the client's fault, not retryable (INTERNAL)."""


class _Ext:
    """Keep vLLM's msgpack extensions (raw tensor views) as they are, to re-encode into the engine's request."""

    @staticmethod
    def hook(code: int, data: memoryview) -> msgspec.msgpack.Ext:
        return msgspec.msgpack.Ext(code, bytes(data))


class MediaProcessor:
    """The helper child and its queue; ``process`` is the one entry point."""

    def __init__(self, model_dir: str, python: Callable[[], str], *, start_timeout_s: float,
                 process_timeout_s: float, reply_bytes_max: int, on_start: Callable[[], None] = lambda: None,
                 script: Path = CHILD_SCRIPT, engine_args: list[str] | None = None,
                 video_frames_max: int = 0) -> None:  # fmt: skip
        self.model_dir = model_dir
        self.video_frames_max = video_frames_max  # SMG_VLLM_MM_MAX_VIDEO_FRAMES (0: vLLM's sampling)
        self._python = python  # resolved at the first start: a servicer with media off never needs vLLM's venv
        self.start_timeout_s = start_timeout_s
        self.process_timeout_s = process_timeout_s
        self.reply_bytes_max = reply_bytes_max + REPLY_SLACK_BYTES
        self._on_start = on_start
        self._script = script  # tests stand a scripted child in
        self._lock = trio.Lock()
        self._process: trio.Process | None = None
        self._buffer = bytearray()
        self._next_id = 0
        self._decoder = msgspec.msgpack.Decoder(ext_hook=_Ext.hook)
        self._encoder = msgspec.msgpack.Encoder()
        self.version = ""
        # The engine's own arguments (its --limit-mm-per-prompt, --media-io-kwargs, --mm-processor-kwargs, ...):
        # the child builds the model's config and vLLM's loaders from them, as the engine's front end does
        # (None: the model's defaults). Through the environment, so a secret among them is not in argv.
        self.engine_args = engine_args
        # What a Redis media sidecar must agree on with its worker (wire/mm_sidecar.py), from the ready frame.
        self.fingerprint: dict | None = None

    @property
    def running(self) -> bool:
        # A killed helper with live threads (torch's) is not reapable until they have all gone: until then it
        # reads as running, and the request sent to it meets its death (UNAVAILABLE, that request only).
        return self._process is not None and self._process.poll() is None

    async def process(self, prompt: list[int], items: list[tuple[str, bytes]]) -> Processed:
        """These (modality, bytes) items, in their order, through the model's processors."""
        with trio.move_on_after(self.process_timeout_s) as waiting:
            await self._lock.acquire()
        if waiting.cancelled_caught:
            raise Unavailable(f"media_refs: the media processor is busy past ENGINELINK_MM_PROCESS_TIMEOUT_S="
                              f"{self.process_timeout_s:g}; retry on another worker", reason="media_processor_busy")
        try:
            left = max(waiting.deadline - trio.current_time(), 0.0)
            if not self.running:
                await self._start()
            return await self._ask(prompt, items, left)
        finally:
            self._lock.release()

    async def ensure_started(self) -> dict | None:
        """Start the child if it is not running (within the start bound); its fingerprint."""
        async with self._lock:
            if not self.running:
                await self._start()
        return self.fingerprint

    async def aclose(self) -> None:
        """End the child (the servicer's shutdown): closing its stdin ends it; a kill if it lingers."""
        async with self._lock:
            await self._stop()

    # -- the child ---------------------------------------------------------------------

    async def _start(self) -> None:
        await self._stop()
        try:
            python = self._python()
        except Exception as error:  # no vLLM interpreter: a deployment fault the router can route around
            raise Unavailable(f"media_refs: no interpreter for the media processor: {error}",
                              reason="media_processor_down") from None  # fmt: skip
        argv = [python, str(self._script), "--model", self.model_dir, "--max-video-frames", str(self.video_frames_max)]
        self._on_start()
        # stderr is the servicer's (its log shows vLLM's lines); a pipe nobody drains would block the child.
        env = None if self.engine_args is None else {**os.environ, ENGINE_ARGS_ENV: json.dumps(self.engine_args)}
        self._process = await trio.lowlevel.open_process(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                         env=env)  # fmt: skip
        self._buffer.clear()
        with trio.move_on_after(self.start_timeout_s):
            try:
                ready = await self._read_reply()
            except _ChildGone as gone:
                await self._stop()
                raise Unavailable(f"media_refs: the media processor did not start ({gone}; its lines are in "
                                  "this servicer's log)", reason="media_processor_down") from None  # fmt: skip
            if not (isinstance(ready, dict) and ready.get("ready")):
                await self._stop()
                raise Unavailable("media_refs: the media processor's first frame was not its ready frame",
                                  reason="media_processor_down")  # fmt: skip
            self.version = str(ready.get("version", ""))
            found = ready.get("fingerprint")
            self.fingerprint = dict(found) if isinstance(found, dict) else None
            return
        await self._stop()
        raise Unavailable(f"media_refs: the media processor did not start within "
                          f"ENGINELINK_MM_PROCESSOR_START_TIMEOUT_S={self.start_timeout_s:g}",
                          reason="media_processor_down")  # fmt: skip

    async def _stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.kill()
            await process.wait()
            for stream in (process.stdin, process.stdout):
                if stream is not None:
                    await stream.aclose()

    async def _ask(self, prompt: list[int], items: list[tuple[str, bytes]], timeout_s: float):
        self._next_id += 1
        request_id = self._next_id
        body = self._encoder.encode({"id": request_id, "prompt": prompt,
                                     "items": [{"modality": m, "data": d} for m, d in items]})  # fmt: skip
        with trio.move_on_after(timeout_s) as scope:
            try:
                await self._process.stdin.send_all(HEADER.pack(len(body)) + body)
                reply = await self._read_reply()
            except trio.Cancelled:
                await self._stop()  # the caller left mid-request: the child's next frame would answer nobody
                raise
            except (_ChildGone, trio.BrokenResourceError, trio.ClosedResourceError) as error:
                await self._stop()
                raise Unavailable(f"media_refs: the media processor died during this request ({error}); it is "
                                  "restarted for the next one",
                                  reason="media_processor_down") from None  # fmt: skip
        if scope.cancelled_caught:
            await self._stop()  # caught mid-request: its state is unknown, so a fresh child serves the next
            raise Unavailable(f"media_refs: the media processor took longer than ENGINELINK_MM_PROCESS_TIMEOUT_S="
                              f"{self.process_timeout_s:g}; retry on another worker", reason="media_processor_timeout")
        if not isinstance(reply, dict) or reply.get("id") != request_id:
            await self._stop()
            raise Unavailable("media_refs: the media processor answered out of turn; it is restarted",
                              reason="media_processor_down")  # fmt: skip
        if "error" in reply:
            item = reply.get("item")
            where = f"media_refs.items[{item}]" if isinstance(item, int) else "media_refs"
            if reply.get("fault") == "client":
                raise ClientError(where, str(reply["error"]))
            raise ProcessorFailed(f"{where}: the media processor failed: {reply['error']}")
        embeds = [(str(m), int(i), int(n)) for m, i, n in reply.get("embeds") or ()]
        identity = reply.get("identity")
        return Processed(list(reply["prompt"]), list(reply["features"]), embeds,
                         list(identity) if isinstance(identity, list) else None)

    async def _read_reply(self):
        head = await self._read_exactly(HEADER.size)
        (size,) = HEADER.unpack(head)
        if size > self.reply_bytes_max:
            raise _ChildGone(f"a {size}-byte reply frame, over the {self.reply_bytes_max}-byte bound")
        try:
            return self._decoder.decode(await self._read_exactly(size))
        except msgspec.DecodeError as error:
            raise _ChildGone(f"an undecodable reply frame: {error}") from None

    async def _read_exactly(self, size: int) -> bytes:
        while len(self._buffer) < size:
            chunk = await self._process.stdout.receive_some(max(size - len(self._buffer), 1 << 16))
            if not chunk:
                raise _ChildGone(f"exited ({await self._exit_status()})")
            self._buffer += chunk
        out = bytes(self._buffer[:size])
        del self._buffer[:size]
        return out

    async def _exit_status(self) -> str:
        with trio.move_on_after(1):
            code = await self._process.wait()
            return f"exit status {code}"
        return "its output closed"


class _ChildGone(Exception):
    """The child's stdout ended or carried a frame it should not have."""
