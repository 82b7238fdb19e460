"""Which engine speaks which wire, and what each wire brings: the one table ``serve`` reads.

``enginelink serve --engine E --wire W``: ``CHOICES[(E, W)]`` names the wire's
codec (``wire/codecs.py``) and the gRPC contract served in front of it;
``CONTRACTS[name]`` is that contract's service (its edge encodes the hub's
messages) and the transport its engine link starts the engine through (vLLM's
ZeroMQ wire with its handshake, or SGLang's ready report on a pipe:
``wire/codecs.readiness``; ``runtime/engine/engine_link.py``).
A new contract is its wing (``runtime/contracts/<name>/``: edge, service,
launch) and one row here (and its launcher in ``tools/serve.py``); anything
not in the table is refused before any engine starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Final

from enginelink.runtime.engine.sglang_link import SglangTransport
from enginelink.runtime.engine.zmq_transport import ZmqTransport
from enginelink.runtime.contracts.mlx.service import MlxEngineService
from enginelink.runtime.contracts.sglang.service import SglangSchedulerService
from enginelink.runtime.contracts.tokenspeed.service import TokenSpeedSchedulerService
from enginelink.runtime.contracts.vllm.service import VllmEngineService


@dataclass(frozen=True)
class Choice:
    codec: str  # wire/codecs.py name
    contract: str  # CONTRACTS key


@dataclass(frozen=True)
class Contract:
    service: type  # the grpclib service: (app, frame_writes, kv_relay)
    # The link's transport, given the launcher and the model's context length (runtime/engine/engine_link.py).
    transport: Callable[..., object]
    health_name: str  # the service name grpc.health.v1 answers for (besides "")


CONTRACTS: Final[dict[str, Contract]] = {
    "vllm": Contract(VllmEngineService, lambda launcher, max_model_len: ZmqTransport(launcher),
                     "vllm.grpc.engine.VllmEngine"),
    "mlx": Contract(MlxEngineService, lambda launcher, max_model_len: ZmqTransport(launcher),
                    "mlx.grpc.engine.MlxEngine"),
    "sglang": Contract(SglangSchedulerService, SglangTransport, "sglang.grpc.scheduler.SglangScheduler"),
    "tokenspeed": Contract(TokenSpeedSchedulerService, lambda launcher, max_model_len: ZmqTransport(launcher),
                           "tokenspeed.grpc.scheduler.TokenSpeedScheduler"),
}

CHOICES: Final[dict[tuple[str, str], Choice]] = {
    ("sim", "vllm"): Choice("vllm", "vllm"),
    ("sim", "sglang"): Choice("sglang", "sglang"),
    ("sim", "tokenspeed"): Choice("tokenspeed", "tokenspeed"),
    ("vllm", "vllm"): Choice("vllm", "vllm"),
    ("mlx", "vllm"): Choice("vllm", "mlx"),  # the MLX engine process speaks vLLM's wire; the router sees MlxEngine
    ("sglang", "sglang"): Choice("sglang", "sglang"),
    ("tokenspeed", "tokenspeed"): Choice("tokenspeed", "tokenspeed"),
}

ENGINES: Final = tuple(dict.fromkeys(engine for engine, _ in CHOICES))
WIRES: Final = tuple(dict.fromkeys(wire for _, wire in CHOICES))


def default_wire(engine: str) -> str:
    """An engine's own wire (the first it speaks): vllm for sim, vllm and mlx; each other engine its own."""
    return next(wire for e, wire in CHOICES if e == engine)


def choose(engine: str, wire: str | None) -> Choice:
    """The row of ``--engine engine --wire wire`` (its default wire when None); ``KeyError`` says what is possible."""
    wire = wire or default_wire(engine)
    try:
        return CHOICES[(engine, wire)]
    except KeyError:
        spoken = [w for e, w in CHOICES if e == engine]
        raise KeyError(f"--engine {engine} does not speak --wire {wire}; it speaks: {', '.join(spoken) or 'nothing'}")\
            from None
