"""vLLM 0.32's arrays on the EngineCore wire (logprobs, pooled vectors), read and written without numpy or torch.

vLLM's ``MsgpackEncoder`` (``vllm/v1/serial_utils.py``) writes every numpy
array and torch tensor as a 3-element array ``[dtype, shape, data]``:

- ``dtype``: numpy's ``dtype.str`` (``"<f4"``, ``"<i4"``, ``"<i8"``) for
  arrays, torch's dtype name without ``torch.`` (``"float32"``, ``"int64"``)
  for tensors;
- ``shape``: a list of ints;
- ``data``: the raw C-order bytes, either inline as msgpack **Ext type 3**
  (arrays under ``VLLM_MSGPACK_ZERO_COPY_THRESHOLD`` bytes, 256 by default,
  and 0-d ones) or an **int i**: the i-th frame of the same ZMQ message
  (frame 0 is the msgpack body; the encoder appends each large buffer).

Logprobs travel in two of those (``reference/request-features.md`` §1.3):

- ``EngineCoreOutput.new_logprobs`` is ``LogprobsLists`` (a NamedTuple, so an
  array): ``[token_ids [P, K+1], logprobs [P, K+1], sampled ranks [P],
  cu_num_generated_tokens]``, numpy arrays; one row per new token;
- ``EngineCoreOutput.new_prompt_logprobs_tensors`` is ``LogprobsTensors``:
  ``[token_ids [N, K+1], logprobs [N, K+1], ranks [N], cu, cu_tensor]``,
  torch tensors; one row per prompt position after the first.

In both, column 0 is the sampled (or prompt) token and columns 1..K the
top-K, descending. ``LogprobRows`` keeps exactly that layout, engine-neutral.

A pooling request's result (Embed) is ``EngineCoreOutput.pooling_output``, one
torch tensor (float32, or the model's float16/bfloat16), read as ``Tensor``.
The journal keeps only frame 0 of a message, so a replay decodes a pooled
tensor whose bytes were in an extra frame as ``Tensor(data=None)``; the live
path, which has every frame, treats missing bytes as the engine's fault when
it reads the values. (Logprobs are read only live, for the calls that asked.)

Rules: sans-io; the bytes are read through ``memoryview.cast`` (no copy,
no third-party dependency); anything malformed is ``WireError`` (the
engine's fault). Only the little-endian dtypes vLLM writes on the hosts it
runs on are read; a big-endian host or dtype is refused, not guessed at.
Both directions live here so the sim engine writes what vLLM writes.
"""

from __future__ import annotations

import array
import math
import struct
import sys
from typing import Any, Final, Sequence

import msgspec

from enginelink.wire.engine import LogprobRows, WireError

# msgspec Ext type of an inline raw buffer (vLLM's CUSTOM_TYPE_RAW_VIEW).
EXT_RAW_VIEW: Final = 3
# vLLM's VLLM_MSGPACK_ZERO_COPY_THRESHOLD default: smaller arrays go inline.
ZERO_COPY_THRESHOLD: Final = 256
# The most elements one decoded pooled tensor may hold (a pooled vector is the
# model's hidden size: thousands). A bound on what a broken engine can make
# us allocate from a shape it claims.
TENSOR_ELEMENTS_MAX: Final = 1 << 24

# dtype string (numpy's dtype.str or torch's name) -> memoryview format; sizes
# are checked against the formats' native sizes at import (``_check_formats``).
_FORMATS: Final = {
    "<f4": "f", "float32": "f",
    "<f8": "d", "float64": "d",
    "<i4": "i", "int32": "i",
    "<i8": "q", "int64": "q",
    "<u4": "I", "uint32": "I",
    "<f2": "e", "float16": "e",
    "bfloat16": "H",  # the high half of a float32; widened by ``Tensor.floats``
}  # fmt: skip
_SIZES: Final = {"f": 4, "d": 8, "i": 4, "q": 8, "I": 4, "e": 2, "H": 2}
# Formats memoryview.cast does not take (half floats) or that mean something else (bfloat16).
_NOT_CASTABLE: Final = frozenset({"e", "H"})


def _check_formats() -> None:
    for fmt, size in _SIZES.items():
        assert struct.calcsize(fmt) == size, fmt


_check_formats()


def _triple(wire: Any) -> tuple[str, str, list[int], Any]:
    """``[dtype, shape, data]`` checked: (dtype, memoryview format, shape, data)."""
    if not (isinstance(wire, (list, tuple)) and len(wire) == 3):
        raise WireError(f"an array on the wire must be [dtype, shape, data], got {type(wire).__name__}")
    dtype, shape, data = wire
    fmt = _FORMATS.get(dtype) if isinstance(dtype, str) else None
    if fmt is None:
        raise WireError(f"array dtype {dtype!r} is not one enginelink reads")
    if sys.byteorder != "little":
        raise WireError("vLLM's arrays are little-endian; this host is not")
    if not (isinstance(shape, (list, tuple)) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise WireError(f"array shape {shape!r} is not a list of sizes")
    return dtype, fmt, list(shape), data


def _buffer(data: Any, frames: Sequence[bytes], *, missing_ok: bool = False) -> bytes | memoryview | None:
    """An array's bytes: inline (Ext 3) or frame ``data`` of the message (None: not given, ``missing_ok``)."""
    if isinstance(data, msgspec.msgpack.Ext):
        if data.code != EXT_RAW_VIEW:
            raise WireError(f"array data in msgpack Ext type {data.code}, not {EXT_RAW_VIEW} (raw bytes)")
        return data.data
    if isinstance(data, int) and not isinstance(data, bool):
        if data < 1:
            raise WireError(f"array data names frame {data}; frame 0 is the message itself")
        if data < len(frames):
            return frames[data]
        if missing_ok:
            return None
        raise WireError(f"array data names frame {data}; the message has {len(frames)}")
    if isinstance(data, dict):
        # vLLM's out-of-band tensor dict (a GPU IPC handle) needs a tensor provider we never configure.
        raise WireError("array sent out of band (out-of-band tensor IPC handles are not read; only inline or extra-frame data)")
    raise WireError(f"array data must be raw bytes or a frame index, got {type(data).__name__}")


def read_array(wire: Any, frames: Sequence[bytes]) -> tuple[memoryview, list[int]]:
    """One ``[dtype, shape, data]`` triple as a flat typed memoryview and its shape."""
    dtype, fmt, shape, data = _triple(wire)
    if fmt in _NOT_CASTABLE:
        raise WireError(f"array dtype {dtype!r} is read only as a pooled tensor")
    view = memoryview(_buffer(data, frames))
    count = math.prod(shape)
    if view.nbytes != count * _SIZES[fmt]:
        raise WireError(f"array of shape {shape} {dtype} needs {count * _SIZES[fmt]} bytes, got {view.nbytes}")
    return view.cast("B").cast(fmt), shape


class Tensor(msgspec.Struct, frozen=True):
    """A pooled tensor: its dtype name, shape and bytes (None: in a frame a replay does not have)."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes | None

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def floats(self) -> list[float]:
        """The elements, flat in C order, as Python floats (float32 values exactly)."""
        if self.data is None:
            raise WireError("tensor bytes are missing (an extra frame the message did not carry)")
        fmt = _FORMATS[self.dtype]
        if len(self.data) != self.size * _SIZES[fmt]:
            raise WireError(f"tensor {self.dtype}{list(self.shape)} has {len(self.data)} bytes, "
                            f"not {self.size * _SIZES[fmt]}")
        if fmt == "e":  # half floats: array has no typecode for them, struct does
            return list(struct.unpack(f"<{self.size}e", self.data))
        if fmt == "H":  # bfloat16: the high half of a float32
            wide = array.array("I", [h << 16 for h in array.array("H", self.data)])
            return array.array("f", wide.tobytes()).tolist()
        if fmt not in ("f", "d"):
            raise WireError(f"a pooled tensor of {self.dtype} is not floats")
        return array.array(fmt, self.data).tolist()


def decode_tensor(wire: Any, frames: Sequence[bytes]) -> Tensor:
    """A pooled tensor, its bytes found inline or in ``frames`` (None when a replay lacks that frame)."""
    dtype, _, shape, data = _triple(wire)
    if math.prod(shape) > TENSOR_ELEMENTS_MAX:
        raise WireError(f"tensor shape {shape} is over {TENSOR_ELEMENTS_MAX} elements")
    raw = _buffer(data, frames, missing_ok=True)
    return Tensor(dtype, tuple(shape), None if raw is None else bytes(raw))


def logprob_rows(wire: Any, frames: Sequence[bytes]) -> LogprobRows:
    """``LogprobsLists`` or ``LogprobsTensors`` (their first three elements) as ``LogprobRows``."""
    if not (isinstance(wire, (list, tuple)) and len(wire) >= 3):
        raise WireError(f"logprobs must be an array of at least 3 arrays, got {str(wire)[:80]}")
    token_ids, ids_shape = read_array(wire[0], frames)
    logprobs, lps_shape = read_array(wire[1], frames)
    if len(ids_shape) != 2 or ids_shape != lps_shape or ids_shape[1] < 1:
        raise WireError(f"logprob token ids {ids_shape} and values {lps_shape} must be the same [rows, 1 + k]")
    if token_ids.format == "f" or token_ids.format == "d" or logprobs.format not in ("f", "d"):
        raise WireError("logprob token ids must be integers and values floats")
    return LogprobRows(rows=ids_shape[0], cols=ids_shape[1], token_ids=token_ids, logprobs=logprobs)


# -- the engine side (the sim engine) ---------------------------------------------------


class ArrayWriter:
    """Writes arrays as vLLM's encoder does; large ones become frames of the message.

    One writer per output message: ``frames`` starts with a placeholder for
    the msgpack body, which ``message`` fills in.
    """

    def __init__(self, threshold: int = ZERO_COPY_THRESHOLD) -> None:
        self.threshold = threshold
        self.frames: list[bytes] = [b""]

    def array(self, dtype: str, shape: list[int], values: Sequence[int] | Sequence[float]) -> list:
        data = array.array(_FORMATS[dtype], values).tobytes()  # native order: little-endian hosts only
        assert len(data) == math.prod(shape) * _SIZES[_FORMATS[dtype]], (dtype, shape)
        if not shape or len(data) < self.threshold:
            return [dtype, shape, msgspec.msgpack.Ext(EXT_RAW_VIEW, data)]
        self.frames.append(data)
        return [dtype, shape, len(self.frames) - 1]

    def message(self, body: bytes) -> list[bytes]:
        self.frames[0] = body
        return self.frames


def logprobs_lists(writer: ArrayWriter, token_ids: list[int], logprobs: list[float], ranks: list[int],
                   cols: int) -> list:
    """``LogprobsLists`` as vLLM's scheduler sends it (numpy arrays: int32 ids, float32 values, int64 ranks)."""
    rows = len(ranks)
    return [
        writer.array("<i4", [rows, cols], token_ids),
        writer.array("<f4", [rows, cols], logprobs),
        writer.array("<i8", [rows], ranks),
        None,
    ]


def logprobs_tensors(writer: ArrayWriter, token_ids: list[int], logprobs: list[float], ranks: list[int],
                     cols: int) -> list:
    """``LogprobsTensors`` as vLLM sends prompt logprobs (torch tensors, named dtypes)."""
    rows = len(ranks)
    return [
        writer.array("int32", [rows, cols], token_ids),
        writer.array("float32", [rows, cols], logprobs),
        writer.array("int64", [rows], ranks),
        None,
        None,
    ]
