"""Worker-side media refs (vLLM's ``GenerateRequest.media_refs``): the settings, the caps, the metrics.

The router either preprocesses media itself and sends tensors (``mm_inputs``,
``runtime/contracts/shared/mm_tensors.py``) or, where a worker says it has a media
processor (``GetServerInfo.mm_processor``), forwards the URLs for the worker
to fetch. This module holds the second path's shell:

- ``MediaSettings``: the operator's knobs (``SMG_VLLM_MM_*``,
  ``SMG_MM_ALLOW_PRIVATE_MEDIA_HOSTS``, ``ENGINELINK_*``), read once per process;
- ``MediaService.prepare``: check the field's shape (on this worker at all,
  modalities, item count), take a job slot (at ``inflight_max`` the call is
  refused UNAVAILABLE at once, so the router retries elsewhere instead of
  queueing behind slow origins), fetch every item concurrently under one
  deadline (``media_fetch.py``: the SSRF policy, size caps, redirects), check
  each is the media its modality says, then hand them to the model's own
  processor (``media_processor.py``: a helper process in the vLLM venv),
  which returns the prompt with its placeholders expanded and the engine's
  ``mm_features``;
- metrics: fetches by scheme and outcome, refusals by reason, fetch latency,
  jobs in flight and their cap.

Whose fault: a URL or body the client chose (bad URL, refused host, 4xx,
wrong media, too large) → ``ClientError`` naming the item
(INVALID_ARGUMENT); the origin's (timeout, 5xx, broken transfer) →
``Unavailable`` naming the item (the router answers 502).

A worker with media on but no processor (the sim engine, an SGLang or
TokenSpeed wire) refuses a fetched ref FAILED_PRECONDITION: the engine never
sees a request without its media.
"""

from __future__ import annotations

import functools
import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass

import sniffio
import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from smg_grpc_proto.generated import common_pb2

from enginelink.machines.media_policy import MediaPolicy, normalize_domain
from enginelink.runtime.errors import ClientError, Precondition, ServicerError, Unavailable
from enginelink.runtime.requests.media_fetch import Fetcher
from enginelink.runtime.requests.media_processor import MediaProcessor

MIB = 1 << 20
FETCH_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# The modalities a media ref may name, by the proto's enum value.
MODALITIES = {common_pb2.IMAGE: "image", common_pb2.VIDEO: "video", common_pb2.AUDIO: "audio"}
PROCESSORS = ("", "inprocess")
# The allowed media domains, as ``serve`` sets it from ``--allowed-media-domains`` (its own flag, or vLLM's
# among the engine arguments).
ALLOWED_DOMAINS_ENV = "ENGINELINK_ALLOWED_MEDIA_DOMAINS"


class MediaKnobError(ValueError):
    """A media setting that does not parse (serve exits 2)."""


@dataclass(frozen=True)
class MediaSettings:
    """The media knobs (README, "Settings"; docs/limits.md, "Media refs")."""

    processor: str = ""  # SMG_VLLM_MM_PROCESSOR / --mm-processor: "" (off) or "inprocess"
    item_bytes_max: int = 32 * MIB  # SMG_VLLM_MM_MAX_ITEM_BYTES: one fetched or decoded item
    inflight_max: int = 64  # SMG_VLLM_MM_MAX_INFLIGHT: requests fetching media at once
    items_max: int = 16  # SMG_VLLM_MM_MAX_ITEMS: media refs in one request
    fetch_timeout_s: float = 10.0  # SMG_VLLM_MM_FETCH_TIMEOUT_MS: one item, connect to last byte
    video_fetch_timeout_s: float = 30.0  # SMG_VLLM_MM_VIDEO_FETCH_TIMEOUT_MS
    redirects_max: int = 5  # ENGINELINK_MM_MAX_REDIRECTS
    allow_private: bool = False  # SMG_MM_ALLOW_PRIVATE_MEDIA_HOSTS=1
    allowed_local_path: str | None = None  # ENGINELINK_ALLOWED_LOCAL_MEDIA_PATH: file: URLs under it only
    # ENGINELINK_ALLOWED_MEDIA_DOMAINS / --allowed-media-domains: http(s) hosts fetched from; empty: any.
    allowed_domains: tuple[str, ...] = ()
    bytes_in_flight_max: int = 1 << 30  # ENGINELINK_MM_MAX_BYTES_IN_FLIGHT: fetched bytes held by all jobs
    # Router tensors (mm_inputs, runtime/contracts/shared/mm_tensors.py): all of one request's, inline and shm.
    tensor_bytes_max: int = 1 << 30  # ENGINELINK_MM_MAX_TENSOR_BYTES
    # The processor helper (runtime/requests/media_processor.py): its start, and one request's whole turn.
    processor_start_timeout_s: float = 180.0  # ENGINELINK_MM_PROCESSOR_START_TIMEOUT_S
    process_timeout_s: float = 60.0  # ENGINELINK_MM_PROCESS_TIMEOUT_S

    @property
    def enabled(self) -> bool:
        return bool(self.processor)

    @property
    def policy(self) -> MediaPolicy:
        return MediaPolicy(allow_private=self.allow_private, allowed_local_path=self.allowed_local_path,
                           redirects_max=self.redirects_max, allowed_domains=self.allowed_domains)  # fmt: skip


def _whole(environ, name: str, default: int, minimum: int = 1) -> int:
    text = environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise MediaKnobError(f"{name}={text!r}: expected a whole number") from None
    if value < minimum:
        raise MediaKnobError(f"{name}={text!r}: must be at least {minimum}")
    return value


def allowed_domains(text: str, source: str = ALLOWED_DOMAINS_ENV) -> tuple[str, ...]:
    """Host names separated by commas or blanks (``--allowed-media-domains``' values, or its variable's),
    normalized and deduplicated; a URL or a host with a port is refused, naming ``source``."""
    names: list[str] = []
    for word in text.replace(",", " ").split():
        name = normalize_domain(word)
        if "/" in name or "@" in name or (":" in name and not _ipv6(name)) or not name:
            raise MediaKnobError(f"{source}: {word!r} is not a host name; give names such as example.com "
                                 "(no scheme, port or path)")
        if name not in names:
            names.append(name)
    return tuple(names)


def _ipv6(name: str) -> bool:
    try:
        ipaddress.IPv6Address(name)
    except ValueError:
        return False
    return True


def media_settings_from(environ: Mapping[str, str]) -> MediaSettings:
    processor = environ.get("SMG_VLLM_MM_PROCESSOR", "").strip().lower()
    if processor == "off":  # the reference's spelling of unset
        processor = ""
    if processor not in PROCESSORS:
        raise MediaKnobError(f"SMG_VLLM_MM_PROCESSOR={processor!r}: expected one of {', '.join(PROCESSORS[1:])} "
                             "or unset (off)")  # fmt: skip
    local = environ.get("ENGINELINK_ALLOWED_LOCAL_MEDIA_PATH", "").strip() or None
    if local is not None and not os.path.isabs(local):
        raise MediaKnobError(f"ENGINELINK_ALLOWED_LOCAL_MEDIA_PATH={local!r}: must be an absolute path")
    allow = environ.get("SMG_MM_ALLOW_PRIVATE_MEDIA_HOSTS", "").strip().lower()
    if allow not in ("", "0", "1", "false", "true"):
        raise MediaKnobError(f"SMG_MM_ALLOW_PRIVATE_MEDIA_HOSTS={allow!r}: expected 1 or 0")
    return MediaSettings(
        processor=processor,
        item_bytes_max=_whole(environ, "SMG_VLLM_MM_MAX_ITEM_BYTES", MediaSettings.item_bytes_max),
        inflight_max=_whole(environ, "SMG_VLLM_MM_MAX_INFLIGHT", MediaSettings.inflight_max),
        items_max=_whole(environ, "SMG_VLLM_MM_MAX_ITEMS", MediaSettings.items_max),
        fetch_timeout_s=_whole(environ, "SMG_VLLM_MM_FETCH_TIMEOUT_MS", 10_000) / 1000,
        video_fetch_timeout_s=_whole(environ, "SMG_VLLM_MM_VIDEO_FETCH_TIMEOUT_MS", 30_000) / 1000,
        redirects_max=_whole(environ, "ENGINELINK_MM_MAX_REDIRECTS", MediaSettings.redirects_max, minimum=0),
        allow_private=allow in ("1", "true"),
        allowed_local_path=local,
        allowed_domains=allowed_domains(environ.get(ALLOWED_DOMAINS_ENV, "")),
        bytes_in_flight_max=_whole(environ, "ENGINELINK_MM_MAX_BYTES_IN_FLIGHT", MediaSettings.bytes_in_flight_max),
        tensor_bytes_max=_whole(environ, "ENGINELINK_MM_MAX_TENSOR_BYTES", MediaSettings.tensor_bytes_max),
        processor_start_timeout_s=float(_whole(environ, "ENGINELINK_MM_PROCESSOR_START_TIMEOUT_S",
                                               int(MediaSettings.processor_start_timeout_s))),
        process_timeout_s=float(_whole(environ, "ENGINELINK_MM_PROCESS_TIMEOUT_S",
                                       int(MediaSettings.process_timeout_s))),
    )


@functools.cache
def media_settings() -> MediaSettings:
    """The process's media settings, read from the environment once (``serve`` checks them at start-up)."""
    return media_settings_from(os.environ)


class MediaMetrics:
    """``smg_servicer_media_*``: what the fetcher did, and its bound."""

    def __init__(self, registry: CollectorRegistry, labels: Mapping[str, str], inflight_max: int,
                 bytes_max: int, processor_bounds_s: tuple[float, float] = (0.0, 0.0)) -> None:  # fmt: skip
        names = list(labels)
        self._labels = dict(labels)
        self.fetches = Counter("smg_servicer_media_fetches", "Media items fetched, by scheme and outcome",
                               names + ["scheme", "outcome"], registry=registry)  # fmt: skip
        self.refusals = Counter("smg_servicer_media_refusals", "Media refs refused, by reason",
                                names + ["reason"], registry=registry)  # fmt: skip
        self.latency = Histogram("smg_servicer_media_fetch_seconds", "One media item's fetch, start to last byte",
                                 names + ["scheme"], buckets=FETCH_BUCKETS_S, registry=registry)  # fmt: skip
        self.inflight = Gauge("smg_servicer_media_jobs_in_flight", "Requests fetching media now", names,
                              registry=registry)  # fmt: skip
        _child(Gauge("smg_servicer_media_jobs_in_flight_max", "SMG_VLLM_MM_MAX_INFLIGHT", names, registry=registry),
               self._labels).set(inflight_max)
        self.bytes_held = Gauge("smg_servicer_media_bytes_held", "Fetched media bytes held by jobs in flight", names,
                                registry=registry)  # fmt: skip
        _child(Gauge("smg_servicer_media_bytes_held_max", "ENGINELINK_MM_MAX_BYTES_IN_FLIGHT", names,
                     registry=registry), self._labels).set(bytes_max)  # fmt: skip
        self.processor_starts = Counter("smg_servicer_media_processor_starts", "Media processor helper starts "
                                        "(the first, and one after each death)", names, registry=registry)  # fmt: skip
        self.process_latency = Histogram("smg_servicer_media_process_seconds", "One request's media through the "
                                         "model's processor, queue included", names, buckets=FETCH_BUCKETS_S,
                                         registry=registry)  # fmt: skip
        # The processor helper's bounds, as the other bounds here: its start, and one request's whole turn.
        start_s, process_s = processor_bounds_s
        _child(Gauge("smg_servicer_media_processor_start_timeout_seconds", "ENGINELINK_MM_PROCESSOR_START_TIMEOUT_S",
                     names, registry=registry), self._labels).set(start_s)  # fmt: skip
        _child(Gauge("smg_servicer_media_process_timeout_seconds", "ENGINELINK_MM_PROCESS_TIMEOUT_S", names,
                     registry=registry), self._labels).set(process_s)  # fmt: skip

    def fetched(self, scheme: str, outcome: str, seconds: float | None) -> None:
        _child(self.fetches, self._labels, scheme=scheme, outcome=outcome).inc()
        if seconds is not None:
            _child(self.latency, self._labels, scheme=scheme).observe(seconds)

    def processor_started(self) -> None:
        _child(self.processor_starts, self._labels).inc()

    def processed(self, seconds: float) -> None:
        _child(self.process_latency, self._labels).observe(seconds)

    def refused(self, reason: str) -> None:
        _child(self.refusals, self._labels, reason=reason).inc()

    def set_inflight(self, count: int) -> None:
        _child(self.inflight, self._labels).set(count)

    def set_bytes_held(self, count: int) -> None:
        _child(self.bytes_held, self._labels).set(count)


def _child(metric, labels: Mapping[str, str], **extra):
    """The metric's child for these labels (a metric with no label names is its own only child)."""
    values = {**labels, **extra}
    return metric.labels(**values) if values else metric


class MediaService:
    """One process's media fetching: its settings, its job count, its metrics and its HTTP client."""

    def __init__(self, settings: MediaSettings, *, registry: CollectorRegistry | None = None,
                 labels: Mapping[str, str] | None = None, network=None, model_dir: str | None = None,
                 processor_python=None) -> None:  # fmt: skip
        self.settings = settings
        self.jobs = 0
        self.metrics = MediaMetrics(registry or CollectorRegistry(), labels or {}, settings.inflight_max,
                                    settings.bytes_in_flight_max,
                                    (settings.processor_start_timeout_s, settings.process_timeout_s))  # fmt: skip
        # ``network``: (resolve, connect) for tests standing in for DNS and routing; None: the real ones.
        self.fetcher = Fetcher(settings, self.metrics, network=network)
        # The model's processor, where this worker has one: a model dir and the vLLM venv's interpreter
        # (``processor_python``, called at the helper's first start). None: fetched refs are refused.
        self.processor = None
        if settings.enabled and model_dir is not None and processor_python is not None:
            self.processor = MediaProcessor(
                model_dir, processor_python, start_timeout_s=settings.processor_start_timeout_s,
                process_timeout_s=settings.process_timeout_s, reply_bytes_max=settings.tensor_bytes_max,
                on_start=self.metrics.processor_started)  # fmt: skip

    async def aclose(self) -> None:
        if self.processor is not None:
            await in_trio(self.processor.aclose)

    # -- GetServerInfo ---------------------------------------------------------------

    def server_fields(self) -> dict:
        if not self.settings.enabled:
            return {}
        return {"mm_processor": self.settings.processor, "mm_media_ref_schemes": ",".join(self.settings.policy.schemes)}

    # -- one request's media ---------------------------------------------------------

    def check_refs(self, media_refs) -> list[tuple[str, str]]:
        """The refs as (modality, url), or the client's error naming the item; nothing fetched yet."""
        if not self.settings.enabled:
            self.metrics.refused("processor_off")
            raise ClientError("media_refs", "media_refs sent but --mm-processor (SMG_VLLM_MM_PROCESSOR) is off "
                              "on this worker")  # fmt: skip
        items = list(media_refs.items)
        if not items:
            raise ClientError("media_refs", "has no items")
        if len(items) > self.settings.items_max:
            self.metrics.refused("too_many_items")
            raise ClientError("media_refs", f"{len(items)} items; at most {self.settings.items_max} "
                              "(SMG_VLLM_MM_MAX_ITEMS)")  # fmt: skip
        refs = []
        for index, item in enumerate(items):
            name = f"media_refs.items[{index}]"
            modality = MODALITIES.get(item.modality)
            if modality is None:
                label = common_pb2.Modality.Name(item.modality) if item.modality in common_pb2.Modality.values() \
                    else str(item.modality)
                raise ClientError(name, f"unsupported modality {label}")
            if not item.url:
                raise ClientError(name, "url must not be empty")
            refs.append((modality, item.url))
        return refs

    async def prepare(self, media_refs, prompt: list[int] | None = None) -> tuple[list[int], list]:
        """(the prompt with its placeholders expanded, the engine's ``mm_features``) for these refs.

        Fetch and check every ref, then run the model's processor (the caller's task waits; bounded by
        ``inflight_max``, the fetch deadlines and the processor's)."""
        refs = self.check_refs(media_refs)
        if self.jobs >= self.settings.inflight_max:
            self.metrics.refused("saturated")
            raise Unavailable(f"media_refs: {self.jobs} media jobs in flight, at SMG_VLLM_MM_MAX_INFLIGHT="
                              f"{self.settings.inflight_max}; retry on another worker", reason="media_saturated")
        self.jobs += 1
        self.metrics.set_inflight(self.jobs)
        try:
            items = await in_trio(self.fetcher.fetch_all, refs)
            if self.processor is None:
                self.metrics.refused("no_processor")
                raise Precondition(
                    f"media_refs: fetched and checked {len(items)} item(s), but this worker's engine has no model "
                    "processor to turn them into multimodal inputs; send preprocessed mm_inputs"
                )
            return await in_trio(self._process, list(prompt or ()), [(item.modality, item.data) for item in items])
        finally:
            self.jobs -= 1
            self.metrics.set_inflight(self.jobs)

    async def _process(self, prompt: list[int], items: list[tuple[str, bytes]]) -> tuple[list[int], list]:
        started = trio.current_time()
        try:
            return await self.processor.process(prompt, items)
        except ServicerError as error:
            self.metrics.refused(error.reason if isinstance(error, Unavailable) else
                                 "processor_refused" if isinstance(error, ClientError) else "processor_failed")
            raise
        finally:
            self.metrics.processed(trio.current_time() - started)


async def in_trio(fn, *args):
    """``fn(*args)`` in trio: grpclib's handlers run in asyncio (trio-asyncio), the simulation in trio."""
    if sniffio.current_async_library() == "asyncio":
        import trio_asyncio

        return await trio_asyncio.trio_as_aio(fn)(*args)
    return await fn(*args)


__all__ = ["MediaService", "MediaSettings", "media_settings", "media_settings_from"]
