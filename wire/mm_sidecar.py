"""The Redis media sidecar's wire (sans-io): keys, jobs, results, and results as the engine's ``mm_features``.

``--mm-processor redis`` moves fetching and preprocessing out of the worker
into a GPU-free sidecar beside a private Redis (``runtime/requests/media_redis.py``
is the worker's side, ``media_sidecar.py`` the sidecar). The two speak the
reference servicer's layout (smg-grpc-servicer 0.14.1, ``mm_sidecar_protocol.py``),
so either side may be the reference's: an enginelink worker with the
reference's sidecar, or the reference's worker with enginelink's.

Keys, all under ``smg:mm:v1:{namespace}``:

- ``:hello``: a hash the sidecar refreshes every 5 s with a 15 s expiry: the
  fingerprint's fields, ``schema``, ``schemes`` and a few facts. A worker
  advertises ``mm_processor=redis`` only while a hello with its own
  fingerprint is there;
- ``:jobs``: a list; the worker LPUSHes a job, a sidecar BRPOPs it;
- ``:res:{job_id}``: a list per attempt; the sidecar LPUSHes the result and
  sets it to expire after 120 s, the worker BRPOPs it.

The namespace is derived from the fingerprint (the first 16 hex digits of
the SHA-256 of its fields joined by ``|``), so a worker and a sidecar that
disagree on anything the tensors depend on (model, vLLM release, dtype,
video backend, media and processor kwargs, the per-prompt limits) never
share keys; an operator may name it instead (``--mm-sidecar-namespace``).

Jobs and results are msgpack maps (msgspec ``Struct`` s, every field written,
unknown fields ignored on reading). A result carries, per modality, each
item's processed tensors as one msgpack buffer of vLLM's
``MultiModalKwargsItem`` (its ``MsgpackEncoder``, every tensor inline), the
placeholder ranges and the hashes. That buffer is exactly the ``data`` of an
``mm_features`` entry (``wire/vllm_mm.py`` says the layout), so converting
a result into the engine's request needs no tensor library, either way.

Whose fault a failed result is, by its code: ``CLIENT_CODES`` are the
request's (INVALID_ARGUMENT), ``result_too_large`` too (``media_too_large``:
the media makes a result over the transport's cap); every other code is
retryable (UNAVAILABLE), the router trying another worker.
"""

from __future__ import annotations

import hashlib

import msgspec
from msgspec.msgpack import Ext

SCHEMA_VERSION = 1
KEY_ROOT = "smg:mm:v1"
HELLO_TTL_S = 15
HELLO_REFRESH_S = 5
RESULT_TTL_S = 120
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_MAX_RESULT_BYTES = 512 << 20  # Redis's own proto-max-bulk-len default

CLIENT_CODES = frozenset({"fetch_failed", "domain_not_allowed", "scheme_not_accepted", "limit_exceeded",
                          "decode_failed", "placeholder_mismatch"})  # fmt: skip
RESULT_TOO_LARGE = "result_too_large"
RESULT_PUSH_FAILED = "result_push_failed"
RAW_VIEW = 3  # vllm/v1/serial_utils.py CUSTOM_TYPE_RAW_VIEW: a tensor's bytes, inline


class Fingerprint(msgspec.Struct, frozen=True):
    """What a worker and its sidecar must agree on, each field a string (JSON for the kwargs and limits)."""

    model: str
    vllm_version: str
    dtype: str
    video_backend: str
    media_io_kwargs: str
    mm_processor_kwargs: str
    limit_per_prompt: str

    def fields(self) -> dict[str, str]:
        return {name: getattr(self, name) for name in self.__struct_fields__}

    def namespace(self) -> str:
        joined = "|".join(getattr(self, name) for name in self.__struct_fields__)
        return hashlib.sha256(joined.encode()).hexdigest()[:16]

    def differences(self, other: Fingerprint) -> list[str]:
        return [name for name in self.__struct_fields__ if getattr(self, name) != getattr(other, name)]

    @classmethod
    def from_mapping(cls, mapping) -> Fingerprint | None:
        """From a hello hash (bytes or text keys and values); None when a field is missing."""
        text = {_text(key): _text(value) for key, value in mapping.items()}
        try:
            return cls(**{name: text[name] for name in cls.__struct_fields__})
        except KeyError:
            return None


def _text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def hello_text(mapping, name: str) -> str:
    """One field of a hello hash as text ("" when absent)."""
    for key, value in mapping.items():
        if _text(key) == name:
            return _text(value)
    return ""


class Keys(msgspec.Struct, frozen=True):
    prefix: str

    @classmethod
    def of(cls, fingerprint: Fingerprint, namespace: str | None = None) -> Keys:
        """The operator's namespace where one is given, else the fingerprint's."""
        chosen = (namespace or "").strip() or fingerprint.namespace()
        return cls(f"{KEY_ROOT}:{chosen}")

    @property
    def hello(self) -> str:
        return f"{self.prefix}:hello"

    @property
    def jobs(self) -> str:
        return f"{self.prefix}:jobs"

    def result(self, job_id: str) -> str:
        return f"{self.prefix}:res:{job_id}"


class JobItem(msgspec.Struct):
    modality: str
    url: str


class Job(msgspec.Struct):
    v: int
    job_id: str
    request_id: str
    fingerprint: Fingerprint
    prompt_token_ids: list[int]
    prompt: str | None
    items: list[JobItem]
    enqueued_ms: int  # wall-clock milliseconds: the deadline crosses processes
    deadline_ms: int


class Placeholder(msgspec.Struct):
    offset: int
    length: int
    is_embed: list[bool] | None = None


class Timing(msgspec.Struct):
    queue_ms: int = 0
    fetch_ms: int = 0
    process_ms: int = 0


class JobResult(msgspec.Struct):
    v: int
    job_id: str
    ok: bool
    fingerprint: Fingerprint | None = None
    prompt_token_ids: list[int] = msgspec.field(default_factory=list)
    mm_hashes: dict[str, list[str]] = msgspec.field(default_factory=dict)
    mm_placeholders: dict[str, list[Placeholder]] = msgspec.field(default_factory=dict)
    mm_kwargs: dict[str, list[bytes]] = msgspec.field(default_factory=dict)  # per item: one msgpack buffer
    code: str = ""
    message: str = ""
    timing: Timing | None = None
    cache: str = ""


def failure(job_id: str, code: str, message: str) -> JobResult:
    return JobResult(v=SCHEMA_VERSION, job_id=job_id, ok=False, code=code, message=message)


class ResultLayoutError(ValueError):
    """A result whose parts do not fit together (the sidecar's fault: retryable)."""


_encoder = msgspec.msgpack.Encoder()
_job_decoder = msgspec.msgpack.Decoder(Job)
_result_decoder = msgspec.msgpack.Decoder(JobResult)


def _keep_ext(code: int, data: memoryview) -> Ext:
    return Ext(code, bytes(data))


_item_decoder = msgspec.msgpack.Decoder(ext_hook=_keep_ext)


def encode(message: Job | JobResult) -> bytes:
    return _encoder.encode(message)


def decode_job(raw: bytes) -> Job:
    return _job_decoder.decode(raw)


def decode_result(raw: bytes) -> JobResult:
    return _result_decoder.decode(raw)


# -- results <-> the engine's mm_features ---------------------------------------------


def features_of(result: JobResult) -> list[dict]:
    """A successful result as ``mm_features`` entries in prompt order (``wire/vllm_mm.py``'s layout)."""
    out = []
    for modality, blobs in result.mm_kwargs.items():
        places = result.mm_placeholders.get(modality, [])
        hashes = result.mm_hashes.get(modality, [])
        if not (len(blobs) == len(places) == len(hashes)):
            raise ResultLayoutError(f"{modality}: {len(blobs)} items, {len(places)} placeholder ranges and "
                                    f"{len(hashes)} hashes")  # fmt: skip
        for blob, place, item_hash in zip(blobs, places, hashes):
            if place.length < 1 or place.offset < 0 or place.offset + place.length > len(result.prompt_token_ids):
                raise ResultLayoutError(f"{modality}: range {place.offset}+{place.length} is outside the "
                                        f"{len(result.prompt_token_ids)}-token prompt")  # fmt: skip
            try:
                data = _item_decoder.decode(blob)
            except msgspec.DecodeError as error:
                raise ResultLayoutError(f"{modality}: an undecodable item ({error})") from None
            if not isinstance(data, dict):
                raise ResultLayoutError(f"{modality}: an item that is not a map of tensors")
            out.append({"data": data, "modality": modality, "identifier": item_hash, "mm_hash": item_hash,
                        "mm_position": {"offset": place.offset, "length": place.length,
                                        "is_embed": _mask(place.is_embed)}})  # fmt: skip
    extra = set(result.mm_placeholders) - set(result.mm_kwargs)
    if extra:
        raise ResultLayoutError(f"placeholder ranges for {sorted(extra)} but no items")
    out.sort(key=lambda f: f["mm_position"]["offset"])
    return out


def result_parts(features: list[dict]) -> tuple[dict[str, list[bytes]], dict[str, list[Placeholder]],
                                                dict[str, list[str]]]:  # fmt: skip
    """``mm_features`` entries (as the processor helper gives them) as a result's kwargs, ranges and hashes."""
    kwargs: dict[str, list[bytes]] = {}
    places: dict[str, list[Placeholder]] = {}
    hashes: dict[str, list[str]] = {}
    for feature in sorted(features, key=lambda f: f["mm_position"]["offset"]):
        modality = feature["modality"]
        position = feature["mm_position"]
        kwargs.setdefault(modality, []).append(_encoder.encode(feature["data"]))
        places.setdefault(modality, []).append(Placeholder(int(position["offset"]), int(position["length"]),
                                                           _bools(position.get("is_embed"))))  # fmt: skip
        hashes.setdefault(modality, []).append(str(feature["mm_hash"]))
    return kwargs, places, hashes


def _mask(is_embed: list[bool] | None):
    """A range's embed mask as vLLM's encoder writes a bool tensor (None: every position)."""
    if is_embed is None:
        return None
    return ["bool", [len(is_embed)], Ext(RAW_VIEW, bytes(1 if flag else 0 for flag in is_embed))]


def _bools(tensor) -> list[bool] | None:
    """A bool tensor as vLLM's encoder writes it (inline), as the list the reference's result carries."""
    if tensor is None:
        return None
    _, _, data = tensor
    raw = data.data if isinstance(data, Ext) else bytes(data)
    return [bool(byte) for byte in raw]
