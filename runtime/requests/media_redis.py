"""``--mm-processor redis``, the worker's side: media refs handed to a GPU-free sidecar over a private Redis.

The sidecar (``enginelink media-sidecar``, or the reference servicer's
``python -m smg_grpc_servicer.vllm.mm_sidecar``) fetches and preprocesses;
this worker queues a job and waits for its result (``wire/mm_sidecar.py``
holds the keys and messages). Its rules:

- **advertised only while a sidecar is there.** The worker learns its own
  fingerprint once, from the model's processor helper (the same derivation
  the sidecar makes from the same engine arguments), then reads the hello
  key every ``PROBE_INTERVAL_S``; ``GetServerInfo`` says ``mm_processor=redis``
  only while a hello with this worker's fingerprint is alive;
- **bounded in time, everywhere.** Each bookkeeping call gets
  ``CONTROL_TIMEOUT_S``; the result wait gets ``--mm-sidecar-timeout-ms``
  (the same deadline travels with the job, so the sidecar drops a job
  nobody waits for) plus that margin, since Redis ends its own wait only
  while it is still answering. A Redis that is gone, refuses or stops
  answering is UNAVAILABLE at once or at the bound, never a hang; the
  client reconnects on the next call, so the worker recovers when Redis
  returns;
- **fail fast when the queue is deep**: at ``--mm-sidecar-max-queue`` jobs
  waiting, UNAVAILABLE before queueing (the router retries elsewhere);
- **bounded in bytes**: a result larger than ``ENGINELINK_MM_MAX_TENSOR_BYTES``
  (the bound of router tensors) is refused;
- **whose fault**: the result's code says (``CLIENT_CODES`` and
  ``media_too_large``: INVALID_ARGUMENT; the rest, a timeout, a mismatched
  fingerprint, an undecodable result: UNAVAILABLE).

redis-py's asyncio client, driven from trio through trio-asyncio (the
servicer runs under its loop already; the sidecar opens one): every call
bounded by a trio cancel scope, which cancels the asyncio task, which drops
its connection. No retries inside the client: a retry here is the router's.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable

import trio

from enginelink.runtime.errors import ClientError, Unavailable
from enginelink.runtime.requests.media_bounds import feature_tokens
from enginelink.runtime.requests.media_processor import Processed
from enginelink.wire import mm_sidecar as wire

log = logging.getLogger("enginelink.media")

# One bookkeeping round trip (queue depth, push, hello read): past it Redis is unreachable, not slow.
CONTROL_TIMEOUT_S = 1.0
PROBE_INTERVAL_S = 2.0
# How long a sidecar's connect may take before the call is refused.
CONNECT_TIMEOUT_S = 1.0
BASE_SCHEMES = ("http", "https", "data")


class RedisDown(Exception):
    """Redis refused, broke the connection or did not answer within the call's bound."""


class RedisLink:
    """One Redis client for trio code: each call bounded, each failure a ``RedisDown``."""

    def __init__(self, url: str, *, connections_max: int) -> None:
        import redis.asyncio
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        # No read deadline of the client's own: the caller bounds every call by what that call waits for
        # (a result wait is seconds long); connecting is bounded, there is nothing to wait for yet.
        self.client = redis.asyncio.from_url(url, decode_responses=False, socket_connect_timeout=CONNECT_TIMEOUT_S,
                                             socket_timeout=None, retry=Retry(NoBackoff(), 0),
                                             max_connections=connections_max)  # fmt: skip

    async def call(self, timeout_s: float, method: str, *args, **kwargs):
        import redis.exceptions
        import trio_asyncio

        try:
            with trio.fail_after(timeout_s):
                return await trio_asyncio.aio_as_trio(getattr(self.client, method))(*args, **kwargs)
        except trio.TooSlowError:
            raise RedisDown(f"no answer to {method.upper()} within {timeout_s:g} s") from None
        except (redis.exceptions.RedisError, OSError) as error:
            raise RedisDown(f"{method.upper()}: {type(error).__name__}: {error}") from None

    async def transaction(self, timeout_s: float, build: Callable[[object], None]) -> None:
        """One MULTI/EXEC of the commands ``build`` queues on a pipeline."""
        import redis.exceptions
        import trio_asyncio

        async def run():
            pipe = self.client.pipeline(transaction=True)
            build(pipe)
            return await pipe.execute()

        try:
            with trio.fail_after(timeout_s):
                await trio_asyncio.aio_as_trio(run)()
        except trio.TooSlowError:
            raise RedisDown(f"no answer to MULTI/EXEC within {timeout_s:g} s") from None
        except (redis.exceptions.RedisError, OSError) as error:
            raise RedisDown(f"MULTI/EXEC: {type(error).__name__}: {error}") from None

    async def aclose(self) -> None:
        import trio_asyncio

        with trio.move_on_after(CONTROL_TIMEOUT_S), trio.CancelScope(shield=True):
            try:
                await trio_asyncio.aio_as_trio(self.client.aclose)()
            except Exception:  # closing a client whose server is gone: nothing left to release
                pass


class SidecarClient:
    """The worker's half: the fingerprint, the hello it watches, one job per media request."""

    def __init__(self, *, redis_url: str, timeout_s: float, queue_max: int, namespace: str | None,
                 result_bytes_max: int, connections_max: int,
                 fingerprint: Callable[[], Awaitable[dict | None]] | wire.Fingerprint,
                 on_state: Callable[[bool], None] = lambda up: None) -> None:  # fmt: skip
        self.link = RedisLink(redis_url, connections_max=connections_max)
        self.timeout_s = timeout_s
        self.queue_max = queue_max
        self.namespace = namespace
        self.result_bytes_max = result_bytes_max
        self._learn = fingerprint
        self.fingerprint: wire.Fingerprint | None = fingerprint if isinstance(fingerprint, wire.Fingerprint) else None
        self.keys = wire.Keys.of(self.fingerprint, namespace) if self.fingerprint is not None else None
        self.advertised = False
        self.schemes = ",".join(BASE_SCHEMES)
        self.why_not = "the worker's fingerprint is not known yet"
        self._on_state = on_state

    # -- the hello ------------------------------------------------------------------------

    async def run(self) -> None:
        """Learn the fingerprint (once), then watch the hello for as long as the servicer runs."""
        while self.fingerprint is None:
            try:
                found = await self._learn()
            except Unavailable as error:
                found = None
                self.why_not = f"the worker's fingerprint could not be computed: {error}"
                log.error("media sidecar: %s", self.why_not)
            if found is not None:
                self.fingerprint = wire.Fingerprint(**{name: str(found.get(name, ""))
                                                       for name in wire.Fingerprint.__struct_fields__})  # fmt: skip
                self.keys = wire.Keys.of(self.fingerprint, self.namespace)
                log.info("media sidecar: jobs under %s, fingerprint %s", self.keys.prefix, self.fingerprint.fields())
            else:
                await trio.sleep(PROBE_INTERVAL_S * 5)
        while True:
            await self.probe()
            await trio.sleep(PROBE_INTERVAL_S)

    async def probe(self) -> bool:
        """Whether a sidecar with this worker's fingerprint keeps its hello alive (and its schemes)."""
        up, why = await self._probe()
        if up != self.advertised or (not up and why != self.why_not):
            (log.info if up else log.warning)("media sidecar %s: %s", "advertised" if up else "not advertised",
                                              why or f"hello at {self.keys.hello}")  # fmt: skip
        self.advertised, self.why_not = up, why
        self._on_state(up)
        return up

    async def _probe(self) -> tuple[bool, str]:
        if self.keys is None:
            return False, self.why_not
        try:
            hello = await self.link.call(CONTROL_TIMEOUT_S, "hgetall", self.keys.hello)
        except RedisDown as error:
            return False, f"Redis unreachable: {error}"
        if not hello:
            return False, f"no sidecar hello at {self.keys.hello} (is a sidecar running for this model and settings?)"
        schema = wire.hello_text(hello, "schema")
        if schema != str(wire.SCHEMA_VERSION):
            return False, f"the sidecar speaks protocol v{schema or '?'}, this worker v{wire.SCHEMA_VERSION}"
        remote = wire.Fingerprint.from_mapping(hello)
        if remote is None:
            return False, f"the hello at {self.keys.hello} carries no fingerprint"
        differ = self.fingerprint.differences(remote)
        if differ:
            return False, f"the sidecar's fingerprint differs on {', '.join(differ)}"
        self.schemes = wire.hello_text(hello, "schemes") or ",".join(BASE_SCHEMES)
        return True, ""

    # -- one request's media -------------------------------------------------------------

    def check_schemes(self, refs: list[tuple[str, str]], item_bytes_max: int) -> None:
        """Refuse, before queueing, what the sidecar would: a scheme it does not fetch, an oversized data URL."""
        accepted = {scheme.strip().lower() for scheme in self.schemes.split(",") if scheme.strip()}
        for index, (_, url) in enumerate(refs):
            scheme = url.partition(":")[0].lower() if ":" in url else ""
            if scheme not in accepted:
                raise ClientError(f"media_refs.items[{index}]", f"scheme {scheme or 'none'!r} is not fetched by "
                                  f"this worker's media sidecar (accepted: {','.join(sorted(accepted))})")  # fmt: skip
            if scheme == "data":
                head, _, payload = url.partition(",")
                size = len(payload) * 3 // 4 if ";base64" in head.lower() else len(payload)
                if size > item_bytes_max:
                    raise ClientError(f"media_refs.items[{index}]", f"decodes to about {size} bytes; at most "
                                      f"{item_bytes_max} (SMG_VLLM_MM_MAX_ITEM_BYTES)")  # fmt: skip

    async def process(self, prompt: list[int], refs: list[tuple[str, str]], request_id: str = "") -> Processed:
        """The expanded prompt, the engine's ``mm_features`` and each item's feature tokens from the sidecar, or
        whose fault it is not."""
        if self.fingerprint is None or self.keys is None:
            raise Unavailable(f"media_refs: the media sidecar cannot be used yet ({self.why_not})",
                              reason="sidecar_unavailable")  # fmt: skip
        now_ms = int(time.time() * 1000)
        job = wire.Job(v=wire.SCHEMA_VERSION, job_id=uuid.uuid4().hex, request_id=request_id,
                       fingerprint=self.fingerprint, prompt_token_ids=list(prompt), prompt=None,
                       items=[wire.JobItem(modality, url) for modality, url in refs], enqueued_ms=now_ms,
                       deadline_ms=now_ms + int(self.timeout_s * 1000))  # fmt: skip
        raw = await self._submit_and_wait(job)
        return self._read(job, raw)

    async def _submit_and_wait(self, job: wire.Job) -> bytes:
        # Redis's BRPOP takes seconds with a fraction; 0 would mean "forever".
        wait_s = max(self.timeout_s, 0.001)
        try:
            depth = await self.link.call(CONTROL_TIMEOUT_S, "llen", self.keys.jobs)
            if depth >= self.queue_max:
                raise Unavailable(f"media_refs: sidecar_overloaded: {depth} jobs queued, at "
                                  f"SMG_VLLM_MM_SIDECAR_MAX_QUEUE={self.queue_max}; retry on another worker",
                                  reason="sidecar_overloaded")  # fmt: skip
            await self.link.call(CONTROL_TIMEOUT_S, "lpush", self.keys.jobs, wire.encode(job))
            popped = await self.link.call(wait_s + CONTROL_TIMEOUT_S, "brpop", [self.keys.result(job.job_id)],
                                          timeout=round(wait_s, 3))  # fmt: skip
        except RedisDown as error:
            raise Unavailable(f"media_refs: sidecar_unavailable: the media sidecar's Redis: {error}",
                              reason="sidecar_unavailable") from None  # fmt: skip
        if popped is None:
            raise Unavailable(f"media_refs: sidecar_timeout: no result for job {job.job_id} within "
                              f"SMG_VLLM_MM_SIDECAR_TIMEOUT_MS={int(self.timeout_s * 1000)}",
                              reason="sidecar_timeout")  # fmt: skip
        return popped[1]

    def _read(self, job: wire.Job, raw: bytes) -> Processed:
        if len(raw) > self.result_bytes_max:
            raise Unavailable(f"media_refs: the sidecar's result is {len(raw)} bytes, over "
                              f"ENGINELINK_MM_MAX_TENSOR_BYTES={self.result_bytes_max}", reason="sidecar_protocol")
        try:
            result = wire.decode_result(raw)
        except Exception as error:  # msgspec's decode and validation errors: the sidecar's fault
            raise Unavailable(f"media_refs: sidecar_protocol: an undecodable result ({error})",
                              reason="sidecar_protocol") from None  # fmt: skip
        if result.v != wire.SCHEMA_VERSION or result.job_id != job.job_id:
            raise Unavailable(f"media_refs: sidecar_protocol: a result of schema v{result.v} for job "
                              f"{result.job_id!r} on the key of {job.job_id!r}", reason="sidecar_protocol")
        if not result.ok:
            if result.code == wire.RESULT_TOO_LARGE:
                raise ClientError("media_refs", f"media_too_large: {result.message}")
            if result.code in wire.CLIENT_CODES:
                raise ClientError("media_refs", f"media processing failed ({result.code}): {result.message}")
            raise Unavailable(f"media_refs: {result.code or 'processor_error'}: {result.message}",
                              reason="sidecar_" + ("push_failed" if result.code == wire.RESULT_PUSH_FAILED
                                                   else "failed"))  # fmt: skip
        if result.fingerprint is not None and (differ := self.fingerprint.differences(result.fingerprint)):
            raise Unavailable(f"media_refs: fingerprint_mismatch: the sidecar's result differs on "
                              f"{', '.join(differ)}", reason="sidecar_protocol")  # fmt: skip
        try:
            features = wire.features_of(result)
        except wire.ResultLayoutError as error:
            raise Unavailable(f"media_refs: sidecar_protocol: {error}", reason="sidecar_protocol") from None
        # Each item's feature tokens from its placeholder range, in its modality's order, for the encoder budget;
        # no media identity (the grids are inside the items' buffers): a PD decode side processes the media.
        embeds, seen = [], {}
        for feature in features:
            nth = seen[feature["modality"]] = seen.get(feature["modality"], -1) + 1
            embeds.append((feature["modality"], nth, feature_tokens(feature)))
        return Processed(list(result.prompt_token_ids), features, embeds, None)

    async def aclose(self) -> None:
        await self.link.aclose()
