"""Worker-side media refs (vLLM's ``GenerateRequest.media_refs``): the settings, the caps, the metrics.

The router either preprocesses media itself and sends tensors (``mm_inputs``,
``runtime/contracts/shared/mm_tensors.py``) or, where a worker says it has a media
processor (``GetServerInfo.mm_processor``), forwards the URLs for the worker
to fetch. This module holds the second path's shell:

- ``MediaSettings``: the operator's knobs (``SMG_VLLM_MM_*``,
  ``SMG_MM_ALLOW_PRIVATE_MEDIA_HOSTS``, ``ENGINELINK_*``), read once per process;
- ``MediaService.prepare``: check the field's shape (on this worker at all,
  modalities, items per modality against the engine's limits,
  ``media_bounds.py``), take a job slot (at ``inflight_max`` the call is
  refused UNAVAILABLE at once, so the router retries elsewhere instead of
  queueing behind slow origins), fetch every item concurrently under one
  deadline (``media_fetch.py``: the SSRF policy, size caps, redirects), check
  each is the media its modality says, then hand them to the model's own
  processor (``media_processor.py``: a helper process in the vLLM venv),
  which returns the prompt with its placeholders expanded and the engine's
  ``mm_features`` (images, videos and audio, each through vLLM's own loader
  and processor); each item's feature tokens are held to the engine's
  encoder budget before the engine sees them;
- metrics: fetches by scheme and outcome, refusals by reason, fetch latency,
  jobs in flight and their cap.

Whose fault: a URL or body the client chose (bad URL, refused host, 4xx,
wrong media, too large) → ``ClientError`` naming the item
(INVALID_ARGUMENT); the origin's (timeout, 5xx, broken transfer) →
``Unavailable`` naming the item (the router answers 502).

A worker with media on but no processor (the sim engine, an SGLang or
TokenSpeed wire) refuses a fetched ref FAILED_PRECONDITION: the engine never
sees a request without its media.

Under ``--mm-processor redis`` the worker fetches nothing: each request's
refs become one job for a sidecar beside a private Redis, which fetches and
preprocesses (``media_redis.py``, ``wire/mm_sidecar.py``, the sidecar
``media_sidecar.py``, images, videos and audio alike); the job slot, the
item checks above and the encoder budget (from the result's placeholder
ranges) stay the worker's. A PD prefill side under redis gives no media
identity (the decode side processes the media itself).

Every setting is validated when read (``serve`` reads them at start: exit 2
naming the setting), the reference's that enginelink does not act on too
(``--mm-turbojpeg``'s policy), so a stale unreadable value fails loudly
wherever it is.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from smg_grpc_proto.generated import common_pb2

from enginelink.machines.media_policy import MediaPolicy, normalize_domain
from enginelink.runtime.errors import ClientError, Precondition, ServicerError, Unavailable
from enginelink.runtime.requests.bridge import in_trio
from enginelink.runtime.requests.media_bounds import MediaBounds
from enginelink.runtime.requests.media_processor import MediaProcessor, Processed
from enginelink.wire import mm_sidecar

if TYPE_CHECKING:
    from enginelink.runtime.requests.media_fetch import Fetcher

log = logging.getLogger("enginelink.media")

MIB = 1 << 20
FETCH_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# The modalities a media ref may name, by the proto's enum value.
MODALITIES = {common_pb2.IMAGE: "image", common_pb2.VIDEO: "video", common_pb2.AUDIO: "audio"}
PROCESSORS = ("", "inprocess", "redis")
TURBOJPEG_POLICIES = ("prefer", "require")
# vLLM's own fetch deadlines (vllm/envs.py, whole seconds), which the reference's inprocess and redis
# processors fetch under: honoured here where the operator set one and SMG_VLLM_MM_*_FETCH_TIMEOUT_MS
# (enginelink's own fetcher's knob, the reference's smg pipeline's) is not set.
VLLM_FETCH_TIMEOUTS = {"image": "VLLM_IMAGE_FETCH_TIMEOUT", "video": "VLLM_VIDEO_FETCH_TIMEOUT",
                       "audio": "VLLM_AUDIO_FETCH_TIMEOUT"}
# The allowed media domains, as ``serve`` sets it from ``--allowed-media-domains`` (its own flag, or vLLM's
# among the engine arguments).
ALLOWED_DOMAINS_ENV = "ENGINELINK_ALLOWED_MEDIA_DOMAINS"


class MediaKnobError(ValueError):
    """A media setting that does not parse (serve exits 2)."""


@dataclass(frozen=True)
class MediaSettings:
    """The media knobs (docs/running.md, "Settings"; docs/limits.md, "Media refs")."""

    processor: str = ""  # SMG_VLLM_MM_PROCESSOR / --mm-processor: "" (off), "inprocess" or "redis"
    # Which setting decided the processor (the reference's words): "flag", "env" or "default".
    processor_source: str = "default"
    item_bytes_max: int = 32 * MIB  # SMG_VLLM_MM_MAX_ITEM_BYTES: one fetched or decoded item
    inflight_max: int = 64  # SMG_VLLM_MM_MAX_INFLIGHT: requests fetching media at once
    # SMG_VLLM_MM_MAX_ITEMS / --mm-max-items: items of one modality in one request, a ceiling on the engine's
    # own --limit-mm-per-prompt (media_bounds.py); None: the engine's limits alone.
    items_max: int | None = None
    fetch_timeout_s: float = 10.0  # SMG_VLLM_MM_FETCH_TIMEOUT_MS: one item, connect to last byte
    video_fetch_timeout_s: float = 30.0  # SMG_VLLM_MM_VIDEO_FETCH_TIMEOUT_MS
    audio_fetch_timeout_s: float = 10.0  # SMG_VLLM_MM_FETCH_TIMEOUT_MS as well, else VLLM_AUDIO_FETCH_TIMEOUT
    # The setting that decided each modality's fetch deadline, for the messages that name it.
    fetch_timeout_names: Mapping[str, str] = field(default_factory=lambda: {
        "image": "SMG_VLLM_MM_FETCH_TIMEOUT_MS", "video": "SMG_VLLM_MM_VIDEO_FETCH_TIMEOUT_MS",
        "audio": "SMG_VLLM_MM_FETCH_TIMEOUT_MS"})  # fmt: skip
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
    # --mm-processor redis (media_redis.py): the sidecar's Redis, the result wait, the queue bound, the keys.
    redis_url: str = mm_sidecar.DEFAULT_REDIS_URL  # SMG_VLLM_MM_REDIS_URL / --mm-redis-url
    sidecar_timeout_s: float = 30.0  # SMG_VLLM_MM_SIDECAR_TIMEOUT_MS / --mm-sidecar-timeout-ms
    sidecar_queue_max: int = 256  # SMG_VLLM_MM_SIDECAR_MAX_QUEUE / --mm-sidecar-max-queue
    sidecar_namespace: str | None = None  # SMG_VLLM_MM_SIDECAR_NAMESPACE / --mm-sidecar-namespace
    # SMG_VLLM_MM_MAX_VIDEO_FRAMES: a video's sampled frames, a cap on vLLM's loader (0: vLLM decides); the
    # processor's (this worker's under inprocess, the sidecar's own under redis, as the reference's reads it).
    video_frames_max: int = 0
    # The reference's setting read by nothing here, validated all the same (a bad value exits 2).
    turbojpeg: str = "prefer"  # SMG_VLLM_MM_TURBOJPEG: smg's Rust pipeline's libjpeg-turbo policy

    def fetch_deadline(self, modality: str) -> tuple[float, str]:
        """One item's fetch deadline, connect to last byte, and the setting that decided it."""
        seconds = {"video": self.video_fetch_timeout_s, "audio": self.audio_fetch_timeout_s}.get(
            modality, self.fetch_timeout_s)
        return seconds, self.fetch_timeout_names.get(modality, "SMG_VLLM_MM_FETCH_TIMEOUT_MS")

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


def _fetch_deadlines(environ) -> dict:
    """Each modality's fetch deadline: SMG_VLLM_MM_*FETCH_TIMEOUT_MS where set, else vLLM's own
    ``VLLM_<MODALITY>_FETCH_TIMEOUT`` (whole seconds, as vLLM reads it) where set, else the default."""
    ours = {"image": "SMG_VLLM_MM_FETCH_TIMEOUT_MS", "audio": "SMG_VLLM_MM_FETCH_TIMEOUT_MS",
            "video": "SMG_VLLM_MM_VIDEO_FETCH_TIMEOUT_MS"}  # fmt: skip
    defaults_ms = {"image": 10_000, "audio": 10_000, "video": 30_000}
    seconds, names = {}, {}
    for modality, name in ours.items():
        vllm_name = VLLM_FETCH_TIMEOUTS[modality]
        vllm_seconds = _whole(environ, vllm_name, 0)  # validated wherever it is set, used only as a fallback
        if environ.get(name, "").strip() or not vllm_seconds:
            seconds[modality], names[modality] = _whole(environ, name, defaults_ms[modality]) / 1000, name
        else:
            seconds[modality], names[modality] = float(vllm_seconds), vllm_name
    return {"fetch_timeout_s": seconds["image"], "video_fetch_timeout_s": seconds["video"],
            "audio_fetch_timeout_s": seconds["audio"], "fetch_timeout_names": names}


def _redis_url(environ) -> str:
    url = environ.get("SMG_VLLM_MM_REDIS_URL", "").strip()
    if not url:
        return mm_sidecar.DEFAULT_REDIS_URL  # good as it is: redis-py (0.19 CPU-s to import) only for one set
    from redis.asyncio.connection import parse_url

    try:
        parse_url(url)
    except ValueError as error:
        raise MediaKnobError(f"SMG_VLLM_MM_REDIS_URL={_shown_url(url)!r}: {error}") from None
    return url


def _shown_url(url: str) -> str:
    """A Redis URL for a message: its password masked."""
    scheme, sep, rest = url.partition("://")
    if sep and "@" in rest.split("/", 1)[0]:
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url


def media_settings_from(environ: Mapping[str, str], processor_source: str | None = None) -> MediaSettings:
    """The media settings from ``environ``; ``processor_source`` says "flag" where a flag set the processor
    (``serve`` puts flag values in the environment), else it is "env" or "default" as the variable is set."""
    processor = environ.get("SMG_VLLM_MM_PROCESSOR", "").strip().lower()
    source = processor_source or ("env" if processor else "default")
    if processor == "off":  # the reference's spelling of unset
        processor = ""
    if processor not in PROCESSORS:
        raise MediaKnobError(f"SMG_VLLM_MM_PROCESSOR={processor!r}: expected one of {', '.join(PROCESSORS[1:])} "
                             "or unset (off)")  # fmt: skip
    turbojpeg = environ.get("SMG_VLLM_MM_TURBOJPEG", "").strip().lower() or "prefer"
    if turbojpeg not in TURBOJPEG_POLICIES:
        raise MediaKnobError(f"SMG_VLLM_MM_TURBOJPEG={turbojpeg!r}: expected one of {', '.join(TURBOJPEG_POLICIES)}")
    namespace = environ.get("SMG_VLLM_MM_SIDECAR_NAMESPACE", "").strip() or None
    local = environ.get("ENGINELINK_ALLOWED_LOCAL_MEDIA_PATH", "").strip() or None
    if local is not None and not os.path.isabs(local):
        raise MediaKnobError(f"ENGINELINK_ALLOWED_LOCAL_MEDIA_PATH={local!r}: must be an absolute path")
    allow = environ.get("SMG_MM_ALLOW_PRIVATE_MEDIA_HOSTS", "").strip().lower()
    if allow not in ("", "0", "1", "false", "true"):
        raise MediaKnobError(f"SMG_MM_ALLOW_PRIVATE_MEDIA_HOSTS={allow!r}: expected 1 or 0")
    return MediaSettings(
        processor=processor,
        processor_source=source,
        item_bytes_max=_whole(environ, "SMG_VLLM_MM_MAX_ITEM_BYTES", MediaSettings.item_bytes_max),
        inflight_max=_whole(environ, "SMG_VLLM_MM_MAX_INFLIGHT", MediaSettings.inflight_max),
        items_max=_whole(environ, "SMG_VLLM_MM_MAX_ITEMS", 0) or None,
        **_fetch_deadlines(environ),
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
        redis_url=_redis_url(environ),
        sidecar_timeout_s=_whole(environ, "SMG_VLLM_MM_SIDECAR_TIMEOUT_MS", 30_000) / 1000,
        sidecar_queue_max=_whole(environ, "SMG_VLLM_MM_SIDECAR_MAX_QUEUE", MediaSettings.sidecar_queue_max),
        sidecar_namespace=namespace,
        turbojpeg=turbojpeg,
        video_frames_max=_whole(environ, "SMG_VLLM_MM_MAX_VIDEO_FRAMES", 0, minimum=0),
    )


@functools.cache
def media_settings() -> MediaSettings:
    """The process's media settings, read from the environment once (``serve`` checks them at start-up)."""
    return media_settings_from(os.environ)


class MediaMetrics:
    """``smg_servicer_media_*``: what the fetcher did, and its bound."""

    def __init__(self, registry: CollectorRegistry, labels: Mapping[str, str], inflight_max: int,
                 bytes_max: int, processor_bounds_s: tuple[float, float] = (0.0, 0.0),
                 settings: MediaSettings | None = None) -> None:  # fmt: skip
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
        # Every other media bound, as a gauge named for its setting (``inspect`` shows them too).
        for name, (setting, value) in media_bounds(settings or MediaSettings()).items():
            _child(Gauge(f"smg_servicer_media_{name}", setting, names, registry=registry), self._labels).set(value)
        self.sidecar_up = Gauge("smg_servicer_media_sidecar_advertised", "1 while a media sidecar with this "
                                "worker's fingerprint keeps its hello alive (--mm-processor redis)", names,
                                registry=registry)  # fmt: skip

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

    def set_sidecar(self, up: bool) -> None:
        _child(self.sidecar_up, self._labels).set(1 if up else 0)


def media_record(settings: MediaSettings, source: str | None = None) -> dict:
    """The media settings as the journal's run.start keeps them (``enginelink inspect`` shows them): the
    processor, which setting decided it, and every bound by the setting's name."""
    bounds = {setting: value for setting, value in media_bounds(settings).values()}
    bounds.update({"SMG_VLLM_MM_MAX_INFLIGHT": settings.inflight_max,
                   "ENGINELINK_MM_MAX_BYTES_IN_FLIGHT": settings.bytes_in_flight_max,
                   "ENGINELINK_MM_PROCESSOR_START_TIMEOUT_S": settings.processor_start_timeout_s,
                   "ENGINELINK_MM_PROCESS_TIMEOUT_S": settings.process_timeout_s})  # fmt: skip
    return {"mm_processor": settings.processor or "off", "mm_processor_source": source or settings.processor_source,
            "bounds": bounds}


def media_bounds(settings: MediaSettings) -> dict[str, tuple[str, float]]:
    """The media bounds not already a gauge of their own, by metric name: (the setting, its value)."""
    fetch = {modality: settings.fetch_deadline(modality) for modality in ("image", "video", "audio")}
    return {
        "item_bytes_max": ("SMG_VLLM_MM_MAX_ITEM_BYTES", settings.item_bytes_max),
        "items_max": ("SMG_VLLM_MM_MAX_ITEMS", settings.items_max or 0),  # 0: the engine's limits alone
        "redirects_max": ("ENGINELINK_MM_MAX_REDIRECTS", settings.redirects_max),
        "tensor_bytes_max": ("ENGINELINK_MM_MAX_TENSOR_BYTES", settings.tensor_bytes_max),
        "image_fetch_timeout_seconds": (fetch["image"][1], fetch["image"][0]),
        "video_fetch_timeout_seconds": (fetch["video"][1], fetch["video"][0]),
        "audio_fetch_timeout_seconds": (fetch["audio"][1], fetch["audio"][0]),
        "video_frames_max": ("SMG_VLLM_MM_MAX_VIDEO_FRAMES", settings.video_frames_max),
        "sidecar_timeout_seconds": ("SMG_VLLM_MM_SIDECAR_TIMEOUT_MS", settings.sidecar_timeout_s),
        "sidecar_queue_max": ("SMG_VLLM_MM_SIDECAR_MAX_QUEUE", settings.sidecar_queue_max),
    }


def _child(metric, labels: Mapping[str, str], **extra):
    """The metric's child for these labels (a metric with no label names is its own only child)."""
    values = {**labels, **extra}
    return metric.labels(**values) if values else metric


class MediaService:
    """One process's media fetching: its settings, its job count, its metrics and its HTTP client."""

    def __init__(self, settings: MediaSettings, *, registry: CollectorRegistry | None = None,
                 labels: Mapping[str, str] | None = None, network=None, model_dir: str | None = None,
                 processor_python=None, engine_args: list[str] | None = None,
                 sidecar_fingerprint: mm_sidecar.Fingerprint | None = None) -> None:  # fmt: skip
        self.settings = settings
        self.jobs = 0
        self.metrics = MediaMetrics(registry or CollectorRegistry(), labels or {}, settings.inflight_max,
                                    settings.bytes_in_flight_max,
                                    (settings.processor_start_timeout_s, settings.process_timeout_s),
                                    settings)  # fmt: skip
        # ``network``: (resolve, connect) for tests standing in for DNS and routing; None: the real ones.
        self._network = network
        # The model's processor, where this worker has one: a model dir and the vLLM venv's interpreter
        # (``processor_python``, called at the helper's first start). None: fetched refs are refused.
        self.processor = None
        if settings.enabled and model_dir is not None and processor_python is not None:
            self.processor = MediaProcessor(
                model_dir, processor_python, start_timeout_s=settings.processor_start_timeout_s,
                process_timeout_s=settings.process_timeout_s, reply_bytes_max=settings.tensor_bytes_max,
                on_start=self.metrics.processor_started, engine_args=engine_args,
                video_frames_max=settings.video_frames_max)  # fmt: skip
        # --mm-processor redis: the sidecar's client; its fingerprint from the processor helper (run once at
        # start, then stopped: the sidecar processes), or given (tests). No helper, no fingerprint: never
        # advertised, and a media ref is UNAVAILABLE.
        self.sidecar = None
        if settings.processor == "redis":
            from enginelink.runtime.requests.media_redis import SidecarClient

            self.sidecar = SidecarClient(
                redis_url=settings.redis_url, timeout_s=settings.sidecar_timeout_s,
                queue_max=settings.sidecar_queue_max, namespace=settings.sidecar_namespace,
                result_bytes_max=settings.tensor_bytes_max, connections_max=settings.inflight_max + 4,
                fingerprint=sidecar_fingerprint or self._fingerprint, on_state=self.metrics.set_sidecar)  # fmt: skip

    async def _fingerprint(self) -> dict | None:
        if self.processor is None:
            raise Unavailable("no model processor helper on this worker (a real vLLM engine's only)")
        try:
            return await self.processor.ensure_started()
        finally:
            await self.processor.aclose()  # the sidecar processes; the helper's memory is not needed here

    async def run(self) -> None:
        """The media service's own work for the servicer's lifetime: under redis, watching the sidecar."""
        if self.sidecar is None:
            return
        if self.processor is None and self.sidecar.fingerprint is None:
            # No vLLM here to derive the fingerprint (the sim engine, SGLang): never advertised, refs UNAVAILABLE.
            self.sidecar.why_not = ("this worker's engine has no model processor to derive the sidecar's "
                                    "fingerprint from (a real vLLM engine's only)")
            log.warning("--mm-processor redis: %s; media refs are not advertised", self.sidecar.why_not)
            return
        await in_trio(self.sidecar.run)

    async def aclose(self) -> None:
        if self.processor is not None:
            await in_trio(self.processor.aclose)
        if self.sidecar is not None:
            await in_trio(self.sidecar.aclose)

    @functools.cached_property
    def fetcher(self) -> Fetcher:
        """The HTTP client for media refs, built at the first fetch: most workers serve no media, and httpx
        (with the CLI extras it imports where they are installed) was a third of every servicer's start-up."""
        from enginelink.runtime.requests.media_fetch import Fetcher

        return Fetcher(self.settings, self.metrics, network=self._network)

    # -- GetServerInfo ---------------------------------------------------------------

    def server_fields(self) -> dict:
        """``mm_processor``, its schemes and ``mm_processor_source``, while this worker can take media refs:
        under redis, only while a sidecar with its fingerprint keeps its hello alive."""
        if not self.settings.enabled:
            return {}
        if self.sidecar is not None:
            if not self.sidecar.advertised:
                return {}
            schemes = self.sidecar.schemes
        else:
            schemes = ",".join(self.settings.policy.schemes)
        return {"mm_processor": self.settings.processor, "mm_media_ref_schemes": schemes,
                "mm_processor_source": self.settings.processor_source}

    # -- one request's media ---------------------------------------------------------

    def check_refs(self, media_refs, bounds: MediaBounds | None = None) -> list[tuple[str, str]]:
        """The refs as (modality, url), or the client's error naming the item; nothing fetched yet."""
        bounds = bounds or MediaBounds(items_max=self.settings.items_max)
        if not self.settings.enabled:
            self.metrics.refused("processor_off")
            raise ClientError("media_refs", "media_refs sent but --mm-processor (SMG_VLLM_MM_PROCESSOR) is off "
                              "on this worker")  # fmt: skip
        items = list(media_refs.items)
        if not items:
            raise ClientError("media_refs", "has no items")
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
        try:
            bounds.check_counts((modality for modality, _ in refs), "media_refs")
        except ClientError:
            self.metrics.refused("too_many_items")
            raise
        return refs

    async def prepare(self, media_refs, prompt: list[int] | None = None,
                      bounds: MediaBounds | None = None) -> Processed:  # fmt: skip
        """These refs through the model's processor: the prompt with its placeholders expanded, the engine's
        ``mm_features``, each item's feature tokens (held to ``bounds``' encoder budget) and the media identity.

        Fetch and check every ref, then run the model's processor (the caller's task waits; bounded by
        ``inflight_max``, the fetch deadlines and the processor's)."""
        bounds = bounds or MediaBounds(items_max=self.settings.items_max)
        refs = self.check_refs(media_refs, bounds)
        if self.jobs >= self.settings.inflight_max:
            self.metrics.refused("saturated")
            raise Unavailable(f"media_refs: {self.jobs} media jobs in flight, at SMG_VLLM_MM_MAX_INFLIGHT="
                              f"{self.settings.inflight_max}; retry on another worker", reason="media_saturated")
        if self.sidecar is not None:
            self.sidecar.check_schemes(refs, self.settings.item_bytes_max)
        self.jobs += 1
        self.metrics.set_inflight(self.jobs)
        try:
            if self.sidecar is not None:
                processed = await in_trio(self._via_sidecar, list(prompt or ()), refs)
            else:
                items = await in_trio(self.fetcher.fetch_all, refs)
                if self.processor is None:
                    self.metrics.refused("no_processor")
                    raise Precondition(
                        f"media_refs: fetched and checked {len(items)} item(s), but this worker's engine has no "
                        "model processor to turn them into multimodal inputs; send preprocessed mm_inputs"
                    )
                processed = await in_trio(self._process, list(prompt or ()),
                                          [(item.modality, item.data) for item in items])  # fmt: skip
        finally:
            self.jobs -= 1
            self.metrics.set_inflight(self.jobs)
        # Each item's feature tokens against what the engine's encoder can place (it would never schedule it).
        for modality, nth, tokens in processed.embeds:
            of_modality = [i for i, (kind, _) in enumerate(refs) if kind == modality]
            where = f"media_refs.items[{of_modality[nth]}]" if nth < len(of_modality) else "media_refs"
            try:
                bounds.check_features(modality, tokens, where)
            except ClientError:
                self.metrics.refused("over_encoder_budget")
                raise
        return processed

    async def _via_sidecar(self, prompt: list[int], refs: list[tuple[str, str]]) -> Processed:
        started = trio.current_time()
        try:
            return await self.sidecar.process(prompt, refs)
        except ServicerError as error:
            self.metrics.refused(error.reason if isinstance(error, Unavailable) else "sidecar_refused")
            raise
        finally:
            self.metrics.processed(trio.current_time() - started)

    async def _process(self, prompt: list[int], items: list[tuple[str, bytes]]) -> Processed:
        started = trio.current_time()
        try:
            return await self.processor.process(prompt, items)
        except ServicerError as error:
            self.metrics.refused(error.reason if isinstance(error, Unavailable) else
                                 "processor_refused" if isinstance(error, ClientError) else "processor_failed")
            raise
        finally:
            self.metrics.processed(trio.current_time() - started)


__all__ = ["MediaService", "MediaSettings", "media_settings", "media_settings_from"]
