"""Router-preprocessed media as vLLM 0.32's ``EngineCoreRequest.mm_features`` (sans-io, no torch).

The router sends each modality's batch already preprocessed: tensors (raw
little-endian bytes, a dtype name, a shape), which keys are batched (one
row per item) or flat (rows split by a sizes tensor; everything else is
shared by every item), the placeholder ranges in the (already expanded)
prompt, and a hash per item. vLLM's front end would turn that into one
``MultiModalFeatureSpec`` per item, ordered by position, and its msgpack
encoder (``vllm/v1/serial_utils.py``) writes each as a map::

    {"data": {key: {"data": [dtype, shape, Ext(3, bytes)],
                    "field": [factory, {field's dataclass fields}]}},
     "modality": "image", "identifier": hash, "mm_hash": hash,
     "mm_position": {"offset": o, "length": n, "is_embed": tensor | None}}

``factory`` is ``batched`` (``keep_on_cpu``), ``flat`` (``keep_on_cpu``,
``slices`` as ``[start, stop, step]`` triples, ``dim``) or ``shared``
(``keep_on_cpu``, ``batch_size``), the names ``MultiModalFieldConfig``'s
factories take back on the engine side. Tensors travel inline (ext type 3,
``CUSTOM_TYPE_RAW_VIEW``), which the engine's decoder takes at any size.

Slicing rows needs no tensor library: the bytes are C-contiguous, so row
``i`` of a ``[n, ...]`` tensor is one byte range. Every inconsistency
(counts, sizes, lengths, ranges) is an ``MmLayoutError`` naming the key;
the caller makes it the client's error. ``tests/vllm`` decodes what this
writes with vLLM's own decoder.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from dataclasses import dataclass, field

from msgspec.msgpack import Ext

RAW_VIEW = 3  # vllm/v1/serial_utils.py CUSTOM_TYPE_RAW_VIEW
# The dtype names the router sends (smg TensorData.dtype), with their widths; the engine reads them as torch's.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "uint8": 1, "int64": 8, "uint32": 4}
_SIZE_TYPECODES = {"int64": "q", "uint32": "I", "uint8": "B"}


class MmLayoutError(ValueError):
    """A batch whose parts do not fit together; ``key`` names the part."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class MmTensor:
    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def check(self, key: str) -> None:
        width = DTYPE_BYTES.get(self.dtype)
        if width is None:
            raise MmLayoutError(key, f"dtype {self.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        expected = math.prod(self.shape) * width
        if len(self.data) != expected:
            raise MmLayoutError(key, f"{len(self.data)} bytes for dtype {self.dtype} and shape {list(self.shape)}: "
                                f"expected {expected}")  # fmt: skip

    def rows(self, start: int, stop: int, keep_dim: bool) -> "MmTensor":
        """Rows ``start:stop`` of the first dimension (``keep_dim`` False: the single row ``start``)."""
        row = len(self.data) // self.shape[0] if self.shape[0] else 0
        shape = ((stop - start,) if keep_dim else ()) + self.shape[1:]
        return MmTensor(self.dtype, shape, self.data[start * row : stop * row])

    def wire(self) -> list:
        return [self.dtype, list(self.shape), Ext(RAW_VIEW, self.data)]


@dataclass(frozen=True)
class MmBatch:
    """One modality's preprocessed batch (smg ``MultimodalInputs``), decoded but not yet checked."""

    modality: str
    tensors: dict[str, MmTensor]
    placeholders: list[tuple[int, int]]
    hashes: list[str] = field(default_factory=list)
    batched_keys: frozenset[str] = frozenset()
    flat_keys: dict[str, str] = field(default_factory=dict)  # key → the key of its per-item sizes
    keep_on_cpu_keys: frozenset[str] = frozenset()
    im_token_id: int | None = None


def features(batches: list[MmBatch], prompt: list[int]) -> list[dict]:
    """Every item of every batch as an ``mm_features`` entry, in prompt order."""
    out = []
    for batch in batches:
        out.extend(_batch_features(batch, prompt))
    out.sort(key=lambda f: f["mm_position"]["offset"])
    for before, after in zip(out, out[1:]):
        end = before["mm_position"]["offset"] + before["mm_position"]["length"]
        if after["mm_position"]["offset"] < end:
            raise MmLayoutError("mm_placeholders", f"placeholder ranges overlap at token {after['mm_position']['offset']}")
    return out


def _batch_features(batch: MmBatch, prompt: list[int]) -> list[dict]:
    n = len(batch.placeholders)
    if n == 0:
        raise MmLayoutError("mm_placeholders", "a multimodal batch needs one placeholder range per item")
    if batch.hashes and len(batch.hashes) != n:
        raise MmLayoutError("mm_hashes", f"{len(batch.hashes)} hashes for {n} placeholder ranges")
    for key, tensor in batch.tensors.items():
        tensor.check(key)
    per_item: list[dict[str, dict]] = [{} for _ in range(n)]
    for key, tensor in batch.tensors.items():
        on_cpu = key in batch.keep_on_cpu_keys
        if key in batch.batched_keys:
            if not tensor.shape or tensor.shape[0] != n:
                raise MmLayoutError(key, f"a batched tensor of shape {list(tensor.shape)} for {n} items")
            fld = ["batched", {"keep_on_cpu": on_cpu}]
            for i in range(n):
                per_item[i][key] = {"data": tensor.rows(i, i + 1, keep_dim=False).wire(), "field": fld}
        elif key in batch.flat_keys:
            bounds = _flat_bounds(key, tensor, batch.tensors.get(batch.flat_keys[key]), batch.flat_keys[key], n)
            fld = ["flat", {"keep_on_cpu": on_cpu, "slices": [[a, b, None] for a, b in bounds], "dim": 0}]
            for i, (start, stop) in enumerate(bounds):
                per_item[i][key] = {"data": tensor.rows(start, stop, keep_dim=True).wire(), "field": fld}
        else:
            fld = ["shared", {"keep_on_cpu": on_cpu, "batch_size": n}]
            for i in range(n):
                per_item[i][key] = {"data": tensor.wire(), "field": fld}
    out = []
    for i, (offset, length) in enumerate(batch.placeholders):
        if length < 1 or offset + length > len(prompt):
            raise MmLayoutError("mm_placeholders", f"range {offset}+{length} is outside the {len(prompt)}-token prompt")
        item_hash = batch.hashes[i] if batch.hashes else _content_hash(batch.modality, per_item[i])
        out.append({
            "data": per_item[i], "modality": batch.modality, "identifier": item_hash, "mm_hash": item_hash,
            "mm_position": {"offset": offset, "length": length,
                            "is_embed": _is_embed(prompt, offset, length, batch.im_token_id)},
        })  # fmt: skip
    return out


def _flat_bounds(key: str, tensor: MmTensor, sizes: MmTensor | None, sizes_key: str, n: int) -> list[tuple[int, int]]:
    """Each item's row range of a flat tensor, from its sizes tensor (one count per item, summing to the rows)."""
    if sizes is None:
        raise MmLayoutError(key, f"its sizes key {sizes_key!r} is not among the tensors")
    code = _SIZE_TYPECODES.get(sizes.dtype)
    if code is None:
        raise MmLayoutError(sizes_key, f"sizes of dtype {sizes.dtype!r}; expected an integer dtype")
    # Flattened, as the reference servicer reads it (``flat_from_sizes(sizes.flatten())``).
    counts = list(array(code, sizes.data))
    if len(counts) != n or any(c < 0 for c in counts):
        raise MmLayoutError(sizes_key, f"{len(counts)} sizes for {n} items")
    if not tensor.shape or sum(counts) != tensor.shape[0]:
        raise MmLayoutError(key, f"{tensor.shape[0] if tensor.shape else 0} rows but its sizes sum to {sum(counts)}")
    bounds, start = [], 0
    for count in counts:
        bounds.append((start, start + count))
        start += count
    return bounds


def _is_embed(prompt: list[int], offset: int, length: int, im_token_id: int | None):
    """Which positions of a range take the encoder's output (None: all of them), as the reference sets it."""
    if im_token_id is None:
        return None
    mask = bytes(1 if token == im_token_id else 0 for token in prompt[offset : offset + length])
    if all(mask):
        return None
    return ["bool", [length], Ext(RAW_VIEW, mask)]


def _content_hash(modality: str, item: dict[str, dict]) -> str:
    """An item's identity from its tensors, when the router sent no hash (the engine's caches key on it)."""
    digest = hashlib.sha256(modality.encode())
    for key in sorted(item):
        dtype, shape, ext = item[key]["data"]
        digest.update(f"{key}:{dtype}:{shape}".encode())
        digest.update(ext.data)
    return digest.hexdigest()
