"""The seam between the contract-neutral request core and one gRPC contract: ``ContractEdge``.

The core (``machines/request_core.py``) speaks ``GenerateCall`` in and
``Chunk`` / ``Complete`` out (``machines/request_api.py``); the executor
(``runtime/requests/hub.py``) runs it. A contract (vLLM's ``VllmEngine``, MLX's
``MlxEngine``, SGLang's ``SglangScheduler``, TokenSpeed's ``TokenSpeedScheduler``) adds one edge module providing the
four members below, and its service passes the edge to the hub when it is
built. Nothing in ``machines/`` or the hub changes for a new contract
(``tests/sim/test_second_contract.py`` runs the simulation seeds through a
minimal one). ``docs/architecture.md``, "Contracts", has the picture.
"""

from __future__ import annotations

from typing import Callable, Protocol

from enginelink.machines.request_api import GenerateCall, Message
from enginelink.machines.request_call import Call, Choice
from enginelink.runtime.requests.inputs import InputLimits
from enginelink.runtime.requests.validate import EngineLimits


class ContractEdge(Protocol):
    name: str
    # The request's id field, as refusals name it (checked first, whatever the link's state).
    id_field: str

    def raw_request_id(self, request) -> str:
        """The request's id as the client sent it (unchecked: the Generate loop checks it)."""
        ...

    def validate(self, request, limits: EngineLimits, now: float) -> GenerateCall:
        """The contract's request → the neutral call; ``ClientError`` naming the field when it is bad."""
        ...

    def encode(self, messages: list[Message]) -> list:
        """The core's messages → the contract's response messages, in order (one core message may become
        several: MLX's edge sends a chunk of n tokens as n messages)."""
        ...

    # ``chunk_body(call, choice, tokens)``: a one-choice streaming call's new tokens straight to the
    # serialized bytes of the response ``encode`` would have made of them, written by the hub's fast
    # path without building a message (``chunk_bytes.py``). ``call`` / ``choice`` are the core's
    # (``machines/request_call.py``): the edge reads what its chunk carries (counts, index, and
    # what it kept on its own ``GenerateCall`` at validation, ``call.spec``). Returns None for a
    # chunk it does not hand-encode (then ``encode``); the attribute None: ``encode`` only.
    chunk_body: Callable[[Call, Choice, list[int]], bytes | None] | None

    def release_params(self, request, limits: InputLimits) -> dict | None:
        """PD: the KV-transfer params of a refused decode request to release at the engine, or None."""
        ...
