"""Responses that repeat the call's ``request_id``: SGLang's and TokenSpeed's contracts.

Their ``GenerateResponse`` has ``request_id`` = 1 and the reference servicers
set it on every response (chunks, completes, errors), while the edges'
``encode`` is stateless and sets none. So the gRPC handler stamps each
message it writes (``CallStamp``; ``service_common.StampedSender`` on the
fast path), and the hand-encoded chunks (``chunk_body``) take the field's
bytes, made once at validation, from ``StampedCall.id_field``.
"""

from __future__ import annotations

from dataclasses import dataclass

from enginelink.machines.request_api import GenerateCall
from enginelink.runtime.requests.chunk_bytes import string_field


@dataclass
class StampedCall(GenerateCall):
    """The neutral call, plus what a stamped contract's hand-encoded chunks repeat: ``GenerateResponse.request_id``
    (field 1) already encoded, so a streamed token does not encode the id again (``chunk_body``)."""

    id_field: bytes = b""


class CallStamp:
    """One call's responses stamped with its ``request_id``, which the stateless ``encode`` has not.

    A message stamped and left for the writer is not stamped again. The
    running counts are the core's (``Chunk`` / ``Complete.completion_tokens``),
    so chunks the hub wrote as bytes (``chunk_body``) need no stamp and leave
    nothing for it to catch up on.
    """

    __slots__ = ("request_id",)

    def __init__(self, request_id: str, stream: bool = True) -> None:
        self.request_id = request_id

    def stamp(self, message):
        if type(message) is bytes:
            # A response its writer serialized in slices (logprob_bytes.py), never stamped before: the
            # id's field first (a field may come anywhere in a message's bytes).
            return string_field(b"\x0a", self.request_id) + message
        if not message.request_id:
            message.request_id = self.request_id
        return message
