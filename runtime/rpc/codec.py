"""grpclib's protobuf codec, taking a message already serialized as it is.

Why: a response whose logprobs are too much work for one step is serialized
by its writer in slices (``runtime/requests/logprob_bytes.py``, issue 38), and
the writer then has its bytes, not a message. grpclib's ``ProtoCodec`` would
refuse them (it checks the message's type); parsing them back into a message
only for grpclib to serialize it again would be the very work the slices
spread out. Everything else is ``ProtoCodec``'s.
"""

from __future__ import annotations

from grpclib.encoding.proto import ProtoCodec


class ServicerCodec(ProtoCodec):
    """``ProtoCodec``, except that ``bytes`` are sent as they are (the caller serialized the message)."""

    def encode(self, message, message_type) -> bytes:
        if type(message) is bytes:
            return message
        return super().encode(message, message_type)
