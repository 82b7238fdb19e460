"""The GPU-free media sidecar (``enginelink media-sidecar``): Redis jobs in, processed media out.

A worker under ``--mm-processor redis`` (enginelink's, ``media_redis.py``, or
the reference servicer's) queues each request's media refs as one job; any
number of sidecars beside the same private Redis take them
(``wire/mm_sidecar.py`` holds the keys and messages). Each job is fetched by
enginelink's own fetcher (``media_fetch.py``: the SSRF policy, the allowed
domains, the size and time caps) and processed by the model's own vLLM
processor in the helper process (``media_processor.py``), built from the
same engine arguments as the worker's engine, so the tensors are the ones
the worker would have made itself.

Rules (docs/limits.md, "Media sidecar"):

- **the fingerprint is the helper's**, computed from the engine arguments as
  the worker computes its own; the hello (``HELLO_REFRESH_S``, expiring after
  ``HELLO_TTL_S``) advertises it, so a worker that disagrees never uses this
  sidecar, and one whose sidecars are all gone stops advertising;
- **the deadline travels with the job**: a job past it is answered
  ``expired`` without work, and the work on one is cut at it;
- **every answer is delivered or replaced**: a result at or over the
  transport's cap (``SMG_VLLM_MM_MAX_RESULT_BYTES``, lowered to Redis's own
  ``proto-max-bulk-len``) is answered ``result_too_large`` (the worker's
  ``media_too_large``); a push Redis refuses is answered at once with a small
  ``result_push_failed``, so the worker is told instead of timing out; each
  answer expires after ``RESULT_TTL_S``;
- **bounded waits**: a job wait is ``JOB_WAIT_S`` plus a margin, each push the
  time the job has left (at least ``PUSH_FLOOR_S``); a Redis that is gone is
  retried every ``RECONNECT_PAUSE_S``, the sidecar lives on;
- **one nursery**: the hello and ``concurrency`` job loops; SIGTERM stops
  taking jobs and gives those in hand ``DRAIN_S``.

Whose fault, as a result code: a URL the policy refuses (``scheme_not_accepted``,
``domain_not_allowed``) or the fetch blames on the request (``fetch_failed``), and
media the processor refuses (``decode_failed``) are the client's; an origin
that failed (``fetch_unavailable``), the helper's death or slowness
(``processor_error``) and ``expired`` are retryable.
"""

from __future__ import annotations

import logging
import time

import trio

from enginelink.machines.media_policy import MediaRefused, check_url
from enginelink.runtime.errors import ClientError, ServicerError, Unavailable
from enginelink.runtime.requests.media_fetch import Fetcher
from enginelink.runtime.requests.media_redis import RedisDown, RedisLink
from enginelink.wire import mm_sidecar as wire

log = logging.getLogger("enginelink.media_sidecar")

JOB_WAIT_S = 5
JOB_WAIT_MARGIN_S = 2  # past the wait Redis was asked for, its silence is a dead connection
RECONNECT_PAUSE_S = 1.0
PUSH_FLOOR_S = 5.0
FAILURE_PUSH_S = 5.0
CONFIG_TIMEOUT_S = 5.0
DRAIN_S = 5.0
REDIS_BULK_LIMIT = "proto-max-bulk-len"


class Sidecar:
    """One sidecar process's work: the hello, the job loops, one job's fetch, process and answer."""

    def __init__(self, link: RedisLink, fetcher: Fetcher, processor, *, settings, namespace: str | None,
                 concurrency: int, result_bytes_max: int) -> None:  # fmt: skip
        self.link = link
        self.fetcher = fetcher
        self.processor = processor
        self.settings = settings
        self.namespace = namespace
        self.concurrency = max(1, concurrency)
        self.result_bytes_max = result_bytes_max
        self.fingerprint: wire.Fingerprint | None = None
        self.keys: wire.Keys | None = None
        self.started_at = int(time.time())
        self.done = 0  # jobs answered (any outcome), for tests and the log
        self._taking = True
        self._answering: set[trio.CancelScope] = set()  # each job in hand, shielded and bounded

    async def start(self) -> None:
        """The helper started (its fingerprint learned) and the result cap learned from Redis."""
        found = await self.processor.ensure_started()
        if not found:
            raise Unavailable("the media processor helper reported no fingerprint", reason="media_processor_down")
        self.fingerprint = wire.Fingerprint(**{name: str(found.get(name, ""))
                                               for name in wire.Fingerprint.__struct_fields__})  # fmt: skip
        self.keys = wire.Keys.of(self.fingerprint, self.namespace)
        await self._learn_result_limit()
        if not self.settings.allowed_domains:
            log.warning("no --allowed-media-domains: this sidecar fetches media from any public host")
        log.info("media sidecar serving under %s (concurrency=%d, result limit %d bytes) fingerprint=%s",
                 self.keys.prefix, self.concurrency, self.result_bytes_max, self.fingerprint.fields())

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        await self.start()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._hello)
            for index in range(self.concurrency):
                nursery.start_soon(self._jobs, index)
            task_status.started()

    def stop_taking(self) -> None:
        """No more jobs off the queue (SIGTERM); those in hand get at most ``DRAIN_S`` more."""
        self._taking = False
        drain_at = trio.current_time() + DRAIN_S
        for scope in self._answering:
            scope.deadline = min(scope.deadline, drain_at)

    # -- the hello and the cap ---------------------------------------------------------

    async def _learn_result_limit(self) -> None:
        try:
            reply = await self.link.call(CONFIG_TIMEOUT_S, "config_get", REDIS_BULK_LIMIT)
            redis_limit = int(next(iter(reply.values())))
        except (RedisDown, StopIteration, ValueError, TypeError, AttributeError) as error:
            # Managed Redis often refuses CONFIG: the configured cap stands.
            log.info("result limit %d bytes (%s not readable: %s)", self.result_bytes_max, REDIS_BULK_LIMIT, error)
            return
        self.result_bytes_max = min(self.result_bytes_max, redis_limit)

    def hello(self) -> dict[str, str]:
        return {**self.fingerprint.fields(), "schema": str(wire.SCHEMA_VERSION),
                "schemes": ",".join(self.settings.policy.schemes), "started_at": str(self.started_at),
                "max_result_bytes": str(self.result_bytes_max), "implementation": "enginelink"}  # fmt: skip

    async def _hello(self) -> None:
        mapping, failing = self.hello(), False
        while self._taking:
            try:
                # One transaction: a hello never outlives its expiry.
                await self.link.transaction(wire.HELLO_TTL_S, lambda pipe: (
                    pipe.hset(self.keys.hello, mapping=mapping), pipe.expire(self.keys.hello, wire.HELLO_TTL_S)))
                if failing:
                    log.info("hello refreshed again at %s", self.keys.hello)
                failing = False
            except RedisDown as error:
                if not failing:
                    log.warning("hello refresh failed (retried every %d s): %s", wire.HELLO_REFRESH_S, error)
                failing = True
            await trio.sleep(wire.HELLO_REFRESH_S)

    # -- the job loops ---------------------------------------------------------------------

    async def _jobs(self, index: int) -> None:
        failing = False
        while self._taking:
            try:
                popped = await self.link.call(JOB_WAIT_S + JOB_WAIT_MARGIN_S, "brpop", [self.keys.jobs],
                                              timeout=JOB_WAIT_S)  # fmt: skip
            except RedisDown as error:
                if not failing:
                    log.warning("job loop %d: waiting for a job failed (retried every %g s): %s", index,
                                RECONNECT_PAUSE_S, error)  # fmt: skip
                failing = True
                await trio.sleep(RECONNECT_PAUSE_S)
                continue
            failing = False
            if popped is None:
                continue
            try:
                job = wire.decode_job(popped[1])
            except Exception as error:  # msgspec's decode and validation errors: no result key to answer on
                log.error("job loop %d: an undecodable job dropped: %s", index, error)
                continue
            await self._answer(job)

    async def _answer(self, job: wire.Job) -> None:
        # A job in hand is answered whatever else is cancelled (SIGTERM), within its deadline and DRAIN_S more.
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + max(job.deadline_ms / 1000 - time.time(), 0) + DRAIN_S
            self._answering.add(scope)
            try:
                await self._answer_in(job)
            finally:
                self._answering.discard(scope)
        self.done += 1

    async def _answer_in(self, job: wire.Job) -> None:
        raw = wire.encode(await self.handle(job))
        if len(raw) >= self.result_bytes_max:
            log.warning("job %s: its result is %d bytes, at or over the %d-byte transport limit; answering %s",
                        job.job_id, len(raw), self.result_bytes_max, wire.RESULT_TOO_LARGE)  # fmt: skip
            raw = wire.encode(wire.failure(job.job_id, wire.RESULT_TOO_LARGE,
                                           f"the encoded media result is {len(raw)} bytes, over the transport "
                                           f"limit of {self.result_bytes_max} bytes (SMG_VLLM_MM_MAX_RESULT_BYTES "
                                           f"or Redis's {REDIS_BULK_LIMIT}); send smaller media"))  # fmt: skip
        await self._deliver(job, raw)

    async def _deliver(self, job: wire.Job, raw: bytes) -> None:
        key = self.keys.result(job.job_id)
        budget = max(PUSH_FLOOR_S, job.deadline_ms / 1000 - time.time())
        try:
            await self._push(key, raw, budget)
        except RedisDown as first:
            log.warning("job %s: its result push failed: %s", job.job_id, first)
            notice = wire.failure(job.job_id, wire.RESULT_PUSH_FAILED, f"the sidecar's result push failed: {first}")
            try:
                await self._push(key, wire.encode(notice), min(budget, FAILURE_PUSH_S))
            except RedisDown as second:  # the worker's own wait ends it (UNAVAILABLE at its deadline)
                log.error("job %s: its result push failed twice: %s; then %s", job.job_id, first, second)

    async def _push(self, key: str, raw: bytes, budget_s: float) -> None:
        await self.link.transaction(budget_s, lambda pipe: (pipe.lpush(key, raw), pipe.expire(key, wire.RESULT_TTL_S)))

    # -- one job -------------------------------------------------------------------------

    async def handle(self, job: wire.Job) -> wire.JobResult:
        started = time.time()
        if started * 1000 > job.deadline_ms:
            return wire.failure(job.job_id, "expired", "the job's deadline passed before it was taken")
        differ = self.fingerprint.differences(job.fingerprint)
        if differ:
            return wire.failure(job.job_id, "fingerprint_mismatch", ",".join(differ))
        refs = [(item.modality, item.url) for item in job.items]
        for index, (_, url) in enumerate(refs):
            try:
                check_url(url, self.settings.policy)
            except MediaRefused as error:
                code = {"scheme": "scheme_not_accepted", "domain": "domain_not_allowed"}.get(error.reason,
                                                                                            "fetch_failed")
                return wire.failure(job.job_id, code, f"media_refs.items[{index}]: {error}")
        with trio.move_on_at(trio.current_time() + max(job.deadline_ms / 1000 - time.time(), 0)) as scope:
            try:
                items = await self.fetcher.fetch_all(refs)
            except ClientError as error:
                return wire.failure(job.job_id, "fetch_failed", str(error))
            except Unavailable as error:
                return wire.failure(job.job_id, "fetch_unavailable", str(error))
            fetched = time.time()
            try:
                processed = await self.processor.process(list(job.prompt_token_ids),
                                                         [(item.modality, item.data) for item in items])
            except ClientError as error:
                return wire.failure(job.job_id, "decode_failed", str(error))
            except ServicerError as error:
                return wire.failure(job.job_id, "processor_error", str(error))
        if scope.cancelled_caught:
            return wire.failure(job.job_id, "expired", "the job's deadline passed while it was processed")
        kwargs, places, hashes = wire.result_parts(processed.features)
        now = time.time()
        return wire.JobResult(
            v=wire.SCHEMA_VERSION, job_id=job.job_id, ok=True, fingerprint=self.fingerprint,
            prompt_token_ids=list(processed.prompt), mm_hashes=hashes, mm_placeholders=places, mm_kwargs=kwargs,
            timing=wire.Timing(queue_ms=max(0, int(started * 1000) - job.enqueued_ms),
                               fetch_ms=int((fetched - started) * 1000), process_ms=int((now - fetched) * 1000)),
        )  # fmt: skip
