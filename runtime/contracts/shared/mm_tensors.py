"""Router-provided tensors (vLLM's ``mm_inputs`` / ``extra_mm_inputs``): decoded, checked, made engine features.

The router preprocesses media itself (its default) and sends each
modality's batch as ``MultimodalInputs``: tensors inline or as ``/dev/shm``
handles, which keys are batched / flat / shared, placeholder ranges in the
already-expanded prompt, hashes. This module:

- reads each ``TensorData``: inline bytes, or a shared-memory handle whose
  name is one plain file name under ``/dev/shm`` in the router's naming
  (``SHM_NAME_PREFIXES``), a regular file (never a FIFO, symlink or device:
  ``local_files.py``, which never blocks on one), holding at least its
  ``offset + nbytes``, read at its offset for exactly its ``nbytes``; a
  ``remote`` handle is refused;
- unlinks the segments it read (the reference's default: segments must not
  pile up) only once every tensor of the request was read and checked, and
  only while the name is still the file that was read: a request that is
  refused removes nothing, so a client cannot make the servicer delete
  another process's segment by naming it with a wrong size;
- bounds one request's tensor bytes (``ENGINELINK_MM_MAX_TENSOR_BYTES``)
  before reading a shared-memory segment;
- refuses a pixel-less batch (grid tensors, no ``pixel_values``: the PD
  decode side's form) unless the request carries ``kv_transfer_params``, in
  the reference's words — a local recompute would run the vision encoder on
  nothing;
- builds the ``mm_features`` (``wire/vllm_mm.py``) in a worker thread, off
  the event loop: slicing hundreds of megabytes of pixels must not stall
  the streams of every other call.

Every refusal is a ``ClientError`` naming the field (``mm_inputs.pixel_values``,
``extra_mm_inputs[0].model_specific_tensors['image_grid_thw']``, …); the
engine never sees a refused request.
"""

from __future__ import annotations

import errno
import os

import trio
from smg_grpc_proto.generated import common_pb2

from enginelink.runtime.errors import ClientError
from enginelink.runtime.requests.local_files import LocalFileRefused, ReadFile, read_regular, remove_if_same
from enginelink.runtime.contracts.shared.media import media_settings
from enginelink.wire.vllm_mm import MmBatch, MmLayoutError, MmTensor, features

SHM_ROOT = "/dev/shm"
# The names the SMG router gives the segments it writes (``smg-mm-<pid>-<n>-<i>``; ``smg-tokenspeed-``
# is its earlier prefix, as the reference accepts it): a handle naming anything else is refused
# before the file is looked at, so no other process's segment is ever opened or removed.
SHM_NAME_PREFIXES = ("smg-mm-", "smg-tokenspeed-")
MODALITY_NAMES = {common_pb2.IMAGE: "image", common_pb2.VIDEO: "video", common_pb2.AUDIO: "audio"}


def tensor_bytes_max() -> int:
    """``ENGINELINK_MM_MAX_TENSOR_BYTES``: all of one request's tensors, inline and shared-memory together."""
    return media_settings().tensor_bytes_max


def batches_of(request) -> list[tuple[str, object]]:
    """(field name, ``MultimodalInputs``) of every batch the request carries."""
    out = [("mm_inputs", request.mm_inputs)] if request.HasField("mm_inputs") else []
    out += [(f"extra_mm_inputs[{i}]", batch) for i, batch in enumerate(request.extra_mm_inputs)]
    return out


async def mm_features_of(request, prompt: list[int], has_kv_transfer: bool) -> list[dict]:
    """The request's batches as ``mm_features``, or the client's error; the work runs in a thread."""
    batches = batches_of(request)
    for name, batch in batches:
        if not batch.HasField("pixel_values") and not has_kv_transfer:
            # The reference's words: the decode side of PD is the only leg that may come without pixels.
            raise ClientError(name, "multimodal payload carries grid tensors but no pixel_values and no "
                              "kv_transfer_params; a pixel-less leg requires remote KV")  # fmt: skip
    # abandon_on_cancel: a cancelled call (its client gone, the servicer stopping) does not wait
    # for the thread; every read in it is of a regular file of bounded size, so it ends soon anyway.
    return await trio.to_thread.run_sync(build_features, batches, prompt, tensor_bytes_max(), abandon_on_cancel=True)


class _Reading:
    """One request's tensor reading: the bytes it may still take, and the segments it read."""

    __slots__ = ("bytes_left", "segments")

    def __init__(self, bytes_max: int) -> None:
        self.bytes_left = bytes_max
        self.segments: list[tuple[str, ReadFile]] = []


def build_features(batches, prompt: list[int], bytes_max: int) -> list[dict]:
    """The batches as ``mm_features``; the shared-memory segments read are unlinked only if all is good."""
    reading = _Reading(bytes_max)
    decoded = [_batch(name, batch, reading) for name, batch in batches]
    try:
        built = features([b for _, b in decoded], prompt)
    except MmLayoutError as error:
        where = next((n for n, b in decoded if error.key in b.tensors), decoded[0][0])
        raise ClientError(f"{where}.{_field_of(error.key)}", str(error)) from None
    # Consumed: the request is good, and the segments are this request's (the reference unlinks them too).
    for path, read in reading.segments:
        remove_if_same(path, read)
    return built


def _field_of(key: str) -> str:
    return key if key in ("mm_placeholders", "mm_hashes", "pixel_values") else f"model_specific_tensors[{key!r}]"


def _batch(name: str, batch, reading: _Reading) -> tuple[str, MmBatch]:
    modality = MODALITY_NAMES.get(batch.modality, "image" if batch.modality == common_pb2.MODALITY_UNSPECIFIED else None)
    if modality is None:
        raise ClientError(f"{name}.modality", f"unsupported modality {batch.modality}")
    tensors: dict[str, MmTensor] = {}
    if batch.HasField("pixel_values"):
        # The model's forward kwarg for the primary tensor (``encoder_input_key``), as the reference keys it.
        key = batch.encoder_input_key if batch.HasField("encoder_input_key") and batch.encoder_input_key else "pixel_values"
        tensors[_modality_key(key, modality)] = _tensor(f"{name}.pixel_values", batch.pixel_values, reading)
    for key, data in batch.model_specific_tensors.items():
        tensors[_modality_key(key, modality)] = _tensor(f"{name}.model_specific_tensors[{key!r}]", data, reading)
    return name, MmBatch(
        modality=modality,
        tensors=tensors,
        placeholders=[(p.offset, p.length) for p in batch.mm_placeholders],
        hashes=list(batch.mm_hashes),
        batched_keys=frozenset(_modality_key(k, modality) for k in batch.batched_keys),
        flat_keys={_modality_key(k, modality): _modality_key(v, modality) for k, v in batch.flat_keys.items()},
        keep_on_cpu_keys=frozenset(_modality_key(k, modality) for k in batch.keep_on_cpu_keys),
        im_token_id=batch.im_token_id if batch.HasField("im_token_id") else None,
    )


def _modality_key(key: str, modality: str) -> str:
    """vLLM keys a video's pixels apart from an image's (``pixel_values_videos``), as the reference renames them."""
    return f"{key}_videos" if modality == "video" and key == "pixel_values" else key


def _tensor(name: str, data, reading: _Reading) -> MmTensor:
    payload = data.WhichOneof("payload")
    if payload == "inline":
        raw = bytes(data.inline)
    elif payload == "shm":
        raw = read_shm(name, data.shm, reading)
    elif payload == "remote":
        raise ClientError(name, "a remote tensor handle is not supported by this worker; send it inline or by shm")
    else:
        raise ClientError(name, "has no payload (inline or shm)")
    reading.bytes_left -= len(raw)
    if reading.bytes_left < 0:
        raise ClientError(name, f"the request's tensors pass {tensor_bytes_max()} bytes (ENGINELINK_MM_MAX_TENSOR_BYTES)")
    tensor = MmTensor(data.dtype, tuple(data.shape), raw)
    try:
        tensor.check(name)
    except MmLayoutError as error:
        raise ClientError(name, str(error)) from None
    return tensor


def read_shm(name: str, handle, reading: _Reading) -> bytes:
    """A shared-memory segment's bytes, only from a regular file directly under /dev/shm in the router's
    naming; noted in ``reading`` for the unlink once the whole request is good (``build_features``)."""
    segment = handle.name.lstrip("/")
    if not segment or "/" in segment or segment in (".", "..") or "\x00" in segment:
        raise ClientError(f"{name}.shm.name", "must be one file name under /dev/shm")
    if not segment.startswith(SHM_NAME_PREFIXES):
        raise ClientError(f"{name}.shm.name", f"must name a segment the router wrote (a name starting with "
                          f"{' or '.join(SHM_NAME_PREFIXES)})")  # fmt: skip
    if handle.nbytes > reading.bytes_left:
        raise ClientError(f"{name}.shm.nbytes", f"{handle.nbytes} bytes; the request's tensors may take at most "
                          f"{tensor_bytes_max()} (ENGINELINK_MM_MAX_TENSOR_BYTES)")  # fmt: skip
    path = os.path.join(SHM_ROOT, segment)
    try:
        read = read_regular(path, offset=handle.offset, nbytes=handle.nbytes)
    except LocalFileRefused as error:
        field = "nbytes" if "claimed" in str(error) else "name"
        raise ClientError(f"{name}.shm.{field}", f"{segment!r} {error}") from None
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise ClientError(f"{name}.shm.name", f"{segment!r} is a symlink") from None
        raise ClientError(f"{name}.shm.name", f"{segment!r} cannot be opened under /dev/shm ({error.strerror})") from None
    if len(read.data) != handle.nbytes:  # the file shrank under the read
        raise ClientError(f"{name}.shm.nbytes", f"expected {handle.nbytes} bytes at offset {handle.offset}, "
                          f"the segment holds {len(read.data)}")  # fmt: skip
    reading.segments.append((path, read))
    return read.data
