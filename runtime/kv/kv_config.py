"""KV events: whether the engine publishes them, and where its publisher and our relay meet.

``plan_kv_events`` runs before anything starts (``enginelink serve`` refuses a
bad plan with exit 2). It answers the engine arguments to launch with and a
``KvPlan`` for the relay (None: KV events are off, SubscribeKvEvents answers
UNIMPLEMENTED).

Rules (issue 5; ``reference/vllm-engine-wire.md`` §7):
- on by default. ``ENGINELINK_KV_EVENTS``, else the served engine's
  ``SMG_<ENGINE>_SERVICER_KV_EVENTS``, else ``SMG_VLLM_SERVICER_KV_EVENTS``
  (``tools/knobs.py``), ``0|off|false|no`` leaves the engine's publisher off;
- a ``--kv-events-config`` the user gave is kept exactly as given, and the
  relay follows what it names (it relays only when the config publishes:
  ``enable_kv_cache_events`` and publisher ``zmq``);
- ours never listens on all interfaces. One DP rank: the PUB and the replay
  ROUTER on ipc sockets in the link's private 0700 socket directory (the
  engine binds both; the relay's SUB and DEALER connect). Several ranks: vLLM
  offsets tcp ports by the rank and refuses ipc, so the PUB endpoint is
  ``tcp://127.0.0.1:P`` — not a wildcard, so each rank's PUB *connects* and
  the relay's SUB for rank r binds P + r — and the replay endpoint is
  ``tcp://127.0.0.1:Q``, the engine binding Q + r; P and Q are runs of ports
  found free now;
- binding follows the engine (``kv_engines.pub_binds``): vLLM's and
  TokenSpeed's PUB binds only for a wildcard, ``::``, ipc or inproc
  endpoint, SGLang's also for ``0.0.0.0`` or when its ``bind`` says so;
  otherwise the relay's SUB binds (and must keep reading from the moment it
  binds: libzmq #2267, see ``runtime/kv/kv_relay.py``). A tcp port 0 the
  engine binds is learned from vLLM's ready response after the handshake
  (one rank only); SGLang's and TokenSpeed's reports do not name it, so
  there a port 0 is refused;
- each engine reads the flag in its own dialect (``wire/kv_engines.py``):
  SGLang's ``{"publisher": "zmq", ...}`` publishes without vLLM's
  ``enable_kv_cache_events``, and the default config enginelink adds is
  written in the served engine's dialect.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Mapping

import msgspec

from enginelink.machines.kv_relay_api import KvRelayConfig
from enginelink.runtime.engine.launchers import flag_value
from enginelink.wire import kv_engines, kv_events as kv

KV_EVENTS_ENVS: Final = ("ENGINELINK_KV_EVENTS", "SMG_VLLM_SERVICER_KV_EVENTS")  # serve names the engine's (tools/knobs.py)
KV_EVENTS_FLAG: Final = "--kv-events-config"
# Our publisher's topic: anything non-empty works; vLLM's observed config used "kv".
TOPIC: Final = "kv"
# Contiguous free ports looked for this many times before giving up.
PORT_SEARCH_TRIES: Final = 64
_OFF: Final = frozenset({"0", "off", "false", "no", "none"})
_ON: Final = frozenset({"", "1", "on", "true", "yes"})


class KvConfigError(ValueError):
    """The KV event settings cannot work (operator's fault); the message says what to change."""


@dataclass(frozen=True)
class RankEndpoints:
    """Where the relay meets one rank's publisher."""

    rank: int
    pub: str | None  # the PUB's endpoint as the relay uses it; None: learned from the ready response
    sub_binds: bool  # the PUB connects, so the relay's SUB binds ``pub``
    replay: str | None  # the replay ROUTER, for the relay's DEALER; None: no replay
    replay_late: bool = False  # a port 0 the engine picks: learned from the ready response


@dataclass(frozen=True)
class KvPlan:
    config: kv_engines.EngineKvConfig  # as the engine gets it (its own dialect)
    ranks: tuple[RankEndpoints, ...]
    explicit: bool  # the user's own --kv-events-config
    relay: KvRelayConfig = field(default_factory=KvRelayConfig)
    paths: tuple[Path, ...] = ()  # ipc socket files that are ours to remove

    @property
    def topic(self) -> bytes:
        return self.config.topic.encode()

    def rank_numbers(self) -> tuple[int, ...]:
        return tuple(r.rank for r in self.ranks)


def kv_events_enabled(env: Mapping[str, str], knobs: tuple[str, ...] = KV_EVENTS_ENVS) -> bool:
    """On unless the first of ``knobs`` set says off (the caller names the served engine's, ``tools/knobs.py``)."""
    for name in knobs:
        if env.get(name, "").strip():  # unset or blank: the next name decides
            value = env[name].strip().lower()
            if value in _OFF:
                return False
            if value in _ON:
                return True
            raise KvConfigError(f"{name}={env[name]!r}: expected on/off (1/0, true/false)")
    return True


def engine_ranks(engine: str, engine_args: list[str]) -> tuple[int, ...]:
    """The DP ranks the launched engine process runs (each one publishes, each handshakes)."""
    if engine == "sim":
        # The sim engine runs N ranks from 0 with vLLM's flag (or SGLang's), else the one rank it is told.
        size = (_int_flag(engine_args, "--data-parallel-size", 0) or _int_flag(engine_args, "--dp-size", 0)
                or _int_flag(engine_args, "-dp", 1))
        if size > 1:
            return tuple(range(size))
        return (_int_flag(engine_args, "--rank", 0),)
    if engine == "sglang":
        # SGLang's spellings (its DP controller runs ranks 0..N-1 behind one launch).
        size = (_int_flag(engine_args, "--dp-size", 0) or _int_flag(engine_args, "--dp", 0)
                or _int_flag(engine_args, "--data-parallel-size", 1))
        return tuple(range(max(1, size)))
    size = _int_flag(engine_args, "--data-parallel-size-local", 0) or _int_flag(
        engine_args, "--data-parallel-size", 0) or _int_flag(engine_args, "-dp", 1)  # fmt: skip
    start = _int_flag(engine_args, "--data-parallel-rank", 0) or _int_flag(engine_args, "--data-parallel-start-rank", 0)
    return tuple(range(start, start + max(1, size)))


def plan_kv_events(engine: str, engine_args: list[str], env: Mapping[str, str], *, socket_dir: Path,
                   prefix: str, knobs: tuple[str, ...] = KV_EVENTS_ENVS,
                   dialect: str = "vllm") -> tuple[list[str], KvPlan | None]:  # fmt: skip
    """(engine args to launch with, the relay's plan or None when KV events are off).

    ``prefix`` names our ipc files (``<socket_dir>/<prefix>-kv…``); it should
    start with the link's stale-file prefix and pid so a crashed run's files
    are cleaned up by the next. ``dialect``: the engine wire's
    (``wire/kv_engines.py``), how the engine reads ``--kv-events-config``.
    """
    ranks = engine_ranks(engine, engine_args)
    given = flag_value(engine_args, KV_EVENTS_FLAG)
    try:
        relay_bounds = KvRelayConfig.from_env(env)
    except ValueError as error:
        raise KvConfigError(str(error)) from None
    if given is not None:
        try:
            config = kv_engines.parse_config(given, dialect)
        except ValueError as error:
            raise KvConfigError(str(error)) from None
        if not config.publishing:
            return list(engine_args), None
        endpoints = tuple(_explicit_endpoints(config, rank, len(ranks)) for rank in ranks)
        replay = config.replay_endpoint is not None
        return list(engine_args), KvPlan(config, endpoints, True, _with_replay(relay_bounds, replay))
    if not kv_events_enabled(env, knobs):
        return list(engine_args), None
    if len(ranks) == 1:
        base = socket_dir / f"{prefix}-kv"
        pub_path, replay_path = Path(f"{base}.sock"), Path(f"{base}-replay.sock")
        config = kv_engines.publishing_config(dialect, endpoint=f"ipc://{pub_path}",
                                              replay_endpoint=f"ipc://{replay_path}", topic=TOPIC)  # fmt: skip
        endpoints = (RankEndpoints(ranks[0], config.endpoint, False, config.replay_endpoint),)
        paths = (pub_path, replay_path)
    else:
        pub_port, replay_port = free_port_run(len(ranks)), free_port_run(len(ranks))
        config = kv_engines.publishing_config(dialect, endpoint=f"tcp://127.0.0.1:{pub_port}",
                                              replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
                                              topic=TOPIC)  # fmt: skip
        first = ranks[0]
        endpoints = tuple(
            RankEndpoints(r, f"tcp://127.0.0.1:{pub_port + r - first}", True,
                          f"tcp://127.0.0.1:{replay_port + r - first}")  # fmt: skip
            for r in ranks
        )
        paths = ()
        if first:
            # vLLM offsets by the rank itself: shift the base so rank `first` lands on the run.
            config = msgspec.structs.replace(config, endpoint=f"tcp://127.0.0.1:{pub_port - first}",
                                             replay_endpoint=f"tcp://127.0.0.1:{replay_port - first}")  # fmt: skip
    text = json.dumps(config.to_dict(), separators=(",", ":"))
    return [*engine_args, KV_EVENTS_FLAG, text], KvPlan(config, endpoints, False, relay_bounds, paths)


def _with_replay(bounds: KvRelayConfig, replay: bool) -> KvRelayConfig:
    return msgspec.structs.replace(bounds, replay=replay)


def _explicit_endpoints(config: kv_engines.EngineKvConfig, rank: int, rank_count: int) -> RankEndpoints:
    try:
        pub = kv.endpoint_for_rank(config.endpoint, rank)
        replay = kv.endpoint_for_rank(config.replay_endpoint, rank) if config.replay_endpoint else None
    except ValueError as error:
        raise KvConfigError(f"{KV_EVENTS_FLAG}: {error}") from None
    binds = kv_engines.pub_binds(config, pub)
    pub_late = binds and _port_zero(pub)
    replay_late = replay is not None and _port_zero(replay)
    if (pub_late or replay_late) and not kv_engines.learns_ports(config):
        raise KvConfigError(f"{KV_EVENTS_FLAG}: a port 0 cannot be followed: {config.dialect}'s ready report "
                            "does not say which port its publisher got; give a port")
    if (pub_late or replay_late) and rank_count > 1:
        raise KvConfigError(f"{KV_EVENTS_FLAG}: a port 0 cannot be followed across {rank_count} DP ranks; give ports")
    if not binds and _port_zero(pub):
        raise KvConfigError(f"{KV_EVENTS_FLAG}: endpoint {pub!r}: the publisher connects there, so it needs a port")
    return RankEndpoints(
        rank, None if pub_late else (loopback(pub) if binds else pub), not binds,
        None if replay_late else (loopback(replay) if replay else None), replay_late,
    )  # fmt: skip


def loopback(endpoint: str) -> str:
    """Where to connect to a publisher that binds ``endpoint``: wildcards become loopback."""
    return kv.connectable(endpoint.replace("[::]", "127.0.0.1").replace("tcp://::", "tcp://127.0.0.1"))


def _port_zero(endpoint: str) -> bool:
    return endpoint.startswith("tcp://") and endpoint.rpartition(":")[2] == "0"


def free_port_run(count: int, host: str = "127.0.0.1") -> int:
    """The first of ``count`` consecutive tcp ports free on ``host`` now."""
    for _ in range(PORT_SEARCH_TRIES):
        with socket.socket() as probe:
            probe.bind((host, 0))
            base = probe.getsockname()[1]
        if base + count > 65535:
            continue
        held = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                held.append(s)
                s.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise KvConfigError(f"no run of {count} free tcp ports on {host} for the KV event publishers")


def _int_flag(argv: list[str], flag: str, default: int) -> int:
    value = flag_value(argv, flag)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise KvConfigError(f"{flag} {value!r}: expected an integer") from None
