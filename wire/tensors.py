"""vLLM's tensors on the EngineCore wire, read and written without torch or numpy.

vLLM's ``MsgpackEncoder`` (``vllm/v1/serial_utils.py``) writes a tensor as the
triple ``[dtype, shape, data]``: ``dtype`` is torch's name without ``torch.``
(``"float32"``, ``"bfloat16"``) or, for a numpy array, numpy's ``dtype.str``
(``"<f4"``); ``data`` is either the raw bytes inline as msgpack ``Ext`` type 3
(``CUSTOM_TYPE_RAW_VIEW``, tensors under ``VLLM_MSGPACK_ZERO_COPY_THRESHOLD``,
256 bytes by default) or an int: the index of an extra ZMQ frame of the same
message that holds the bytes ("aux frames"; frame 0 is the msgpack itself).
The bytes are the tensor's memory, C order, in the machine's byte order; the
engine runs on the servicer's machine (ipc sockets), so that is ours too.

Rules:
- sans-io, no torch, no numpy: the servicer's venv has neither, and a pooled
  vector is a few thousand floats, which ``array``/``memoryview`` turn into
  Python floats as fast as numpy would once ``tolist`` is paid;
- anything that does not read as a tensor is ``WireError`` (the engine's
  fault), never an exception from ``array`` or ``struct`` leaking out;
- an aux index past the frames we were given is not an error here: the
  journal keeps only frame 0 of a message, so a replay decodes tensors
  without their bytes (``data is None``); the live path, which has every
  frame, treats a missing frame as the engine's fault where it needs the values.
"""

from __future__ import annotations

import array
import math
import struct
from typing import Any, Final, Sequence

import msgspec

from enginelink.wire.engine import WireError

# vLLM's CUSTOM_TYPE_RAW_VIEW: a tensor's bytes inline.
EXT_RAW_VIEW: Final = 3
# vLLM's default VLLM_MSGPACK_ZERO_COPY_THRESHOLD: smaller tensors go inline.
ZERO_COPY_THRESHOLD_BYTES: Final = 256
# The most elements one decoded tensor may hold (a pooled vector is the
# model's hidden size: thousands). A bound on what a broken engine can make
# us allocate from a shape it claims.
TENSOR_ELEMENTS_MAX: Final = 1 << 24

# dtype name -> (array typecode of the stored width, bytes per element).
_DTYPES: Final = {
    "float32": ("f", 4), "<f4": ("f", 4),
    "float64": ("d", 8), "<f8": ("d", 8),
    "float16": ("e", 2), "<f2": ("e", 2),
    "bfloat16": ("H", 2),
}


class Tensor(msgspec.Struct, frozen=True):
    """One decoded tensor: its dtype name, shape and bytes (None: in a frame we were not given)."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes | None

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def floats(self) -> list[float]:
        """The elements, flat in C order, as Python floats (float32 values exactly)."""
        if self.data is None:
            raise WireError("tensor bytes are missing (an aux frame the message did not carry)")
        code, width = _DTYPES[self.dtype]
        if len(self.data) != self.size * width:
            raise WireError(f"tensor {self.dtype}{list(self.shape)} has {len(self.data)} bytes, not {self.size * width}")
        if code == "e":  # half floats: array has no typecode for them, struct does
            return list(struct.unpack(f"={self.size}e", self.data))  # native order, as written
        if code == "H":  # bfloat16: the high half of a float32
            wide = array.array("I", [h << 16 for h in array.array("H", self.data)])
            return array.array("f", wide.tobytes()).tolist()
        return array.array(code, self.data).tolist()


def decode_tensor(value: Any, frames: Sequence[bytes]) -> Tensor:
    """The triple vLLM wrote, with its bytes found inline or in ``frames[index]``."""
    if not (isinstance(value, (list, tuple)) and len(value) == 3):
        raise WireError(f"a tensor is [dtype, shape, data], got {type(value).__name__}")
    dtype, shape, data = value
    if dtype not in _DTYPES:
        raise WireError(f"unsupported tensor dtype {dtype!r}")
    if not (isinstance(shape, (list, tuple)) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise WireError(f"a tensor shape is a list of sizes, got {shape!r}")
    shape = tuple(shape)
    if math.prod(shape) > TENSOR_ELEMENTS_MAX:
        raise WireError(f"tensor shape {list(shape)} is over {TENSOR_ELEMENTS_MAX} elements")
    if isinstance(data, msgspec.msgpack.Ext):
        if data.code != EXT_RAW_VIEW:
            raise WireError(f"tensor data is msgpack ext type {data.code}, not {EXT_RAW_VIEW} (raw view)")
        raw: bytes | None = bytes(data.data)
    elif isinstance(data, int) and not isinstance(data, bool):
        if data < 1:
            raise WireError(f"tensor aux frame index {data}: frame 0 is the message itself")
        raw = bytes(frames[data]) if data < len(frames) else None
    elif isinstance(data, dict):
        raise WireError("tensor sent out of band (a GPU tensor IPC handle); this front end reads only inline or aux data")
    else:
        raise WireError(f"tensor data must be raw bytes or a frame index, got {type(data).__name__}")
    return Tensor(dtype, shape, raw)


def encode_float32(values: Sequence[float], aux: list[bytes], threshold: int = ZERO_COPY_THRESHOLD_BYTES) -> list:
    """Engine side (the sim engine): a 1-D float32 tensor as vLLM writes it.

    Inline under ``threshold`` bytes, else appended to ``aux`` (the message's
    frames after frame 0) and referred to by its frame index, as vLLM does.
    """
    raw = array.array("f", values).tobytes()
    if len(raw) < threshold:
        return ["float32", [len(values)], msgspec.msgpack.Ext(EXT_RAW_VIEW, raw)]
    aux.append(raw)
    return ["float32", [len(values)], len(aux)]
