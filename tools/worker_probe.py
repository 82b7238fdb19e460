"""``enginelink worker-probe``: is this multi-node engine worker still attached to its leader?

A multi-node engine runs its front end (enginelink) and rank 0 on a leader
node and its other ranks on worker nodes (``vllm serve --headless
--node-rank N``, SGLang's and TokenSpeed's ``--node-rank``). Every rank joins
the process group through a TCP store on the leader, the rendezvous the
engine's command line names, and keeps that connection for its lifetime. When
the leader goes (its pod restarts), the workers are not told: they wait on a
dead store while the next leader waits for ranks that never join. This probe
passes (exit 0) while at least one TCP connection from this network namespace
to the leader's store port is ESTABLISHED (state ``01`` in ``/proc/net/tcp6``
or ``/proc/net/tcp``), and fails (exit 1) otherwise, so the kubelet restarts
the worker and fresh ranks join the new leader. The reference servicer's
``smg_grpc_servicer.<engine>.worker_probe`` does the same
(reference request-features.md §10); the flags and the verdicts match it.

Rules:
- the standard library only, and nothing of enginelink beyond this module:
  ``python3 -I -m enginelink.tools.worker_probe`` runs in a worker pod whose
  interpreter is saturated by the weight stream, where importing the servicer
  (trio, grpclib, protobuf) would cost seconds (tests/tools/test_worker_probe.py
  checks what it imports);
- the leader is re-resolved on every run: a recreated leader pod at a new
  address fails the probe even while stale connections to the old one linger;
- without ``--leader``/``--port`` they are read off the engine's command line
  (``/proc/1/cmdline``): vLLM's ``--master-addr``/``--master-port`` (default port
  29501), SGLang's and TokenSpeed's ``--dist-init-addr host:port``; ``--flag value``
  and ``--flag=value``, ``-`` or ``_``, inside a shell wrapper's one argument too.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import shlex
import socket
import struct
import sys
from dataclasses import dataclass

TABLES = ("net/tcp6", "net/tcp")  # under the proc root; IPv6 first (an IPv6-only cluster has no IPv4 table)
CMDLINE = "1/cmdline"  # the pod's engine: PID 1 of the worker container
TCP_ESTABLISHED = "01"
TCP_STATES = {"01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1", "05": "FIN_WAIT2",
              "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT", "09": "LAST_ACK", "0A": "LISTEN",
              "0B": "CLOSING"}
VLLM_MASTER_PORT_DEFAULT = 29501  # vLLM's own default for --master-port


@dataclass(frozen=True)
class Rendezvous:
    """How one engine's command line names the leader's store."""

    leader_flag: str
    port_flag: str  # the same flag when one host:port carries both
    default_port: int | None = None


ENGINES = {
    "vllm": Rendezvous("--master-addr", "--master-port", VLLM_MASTER_PORT_DEFAULT),
    "sglang": Rendezvous("--dist-init-addr", "--dist-init-addr"),
    "tokenspeed": Rendezvous("--dist-init-addr", "--dist-init-addr"),
}


@dataclass(frozen=True)
class Connection:
    remote: ipaddress.IPv4Address | ipaddress.IPv6Address
    port: int
    state: str


def _normalize(address):
    """An IPv4 peer of a dual-stack socket (``::ffff:a.b.c.d``) compares equal to the IPv4 address."""
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped if mapped is not None else address


def _parse_address(hex_address: str):
    # The kernel prints each 32-bit word of the address in host byte order.
    words = [hex_address[i:i + 8] for i in range(0, len(hex_address), 8)]
    return _normalize(ipaddress.ip_address(b"".join(struct.pack("=I", int(w, 16)) for w in words)))


def parse_tcp_table(text: str) -> list[Connection]:
    """The sockets one ``/proc/net/tcp*`` table lists; the header and malformed lines are skipped."""
    connections = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 4:
            continue
        remote_hex, _, port_hex = fields[2].partition(":")
        try:
            connections.append(Connection(_parse_address(remote_hex), int(port_hex, 16), fields[3].upper()))
        except (ValueError, struct.error):
            continue
    return connections


def read_connections(proc_root: str) -> list[Connection]:
    connections: list[Connection] = []
    for table in TABLES:
        try:
            with open(os.path.join(proc_root, table), encoding="ascii") as handle:
                connections.extend(parse_tcp_table(handle.read()))
        except OSError:  # a family the kernel does not provide
            continue
    return connections


def command_words(cmdline: bytes) -> list[str]:
    """The command line's words; an argument holding a whole shell command is split too."""
    words: list[str] = []
    for part in cmdline.split(b"\0"):
        if not part:
            continue
        text = part.decode("utf-8", "replace")
        if any(c.isspace() for c in text):
            try:
                words.extend(shlex.split(text))
                continue
            except ValueError:
                pass
        words.append(text)
    return words


def flag_values(cmdline: bytes, *flags: str) -> dict[str, str]:
    """The last value of each flag (``--flag v``/``--flag=v``, ``-`` or ``_``), keyed by its dashed name."""
    words = command_words(cmdline)
    values: dict[str, str] = {}
    for index, word in enumerate(words):
        name, eq, inline = word.partition("=")
        flag = name.replace("_", "-")
        if flag not in flags:
            continue
        if eq:
            values[flag] = inline
        elif index + 1 < len(words):
            values[flag] = words[index + 1]
    return values


def split_host_port(value: str) -> tuple[str | None, int | None]:
    """``host:port`` as ``--dist-init-addr`` carries it (IPv6 in brackets, ``tcp://`` tolerated)."""
    text = value.strip().removeprefix("tcp://")
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        port_text = rest[1:] if bracket and rest.startswith(":") else ""
    elif ":" in text:
        host, _, port_text = text.rpartition(":")
    else:
        host, port_text = text, ""
    return host or None, int(port_text) if port_text.isdigit() else None


def leader_from_cmdline(engine: str, cmdline: bytes) -> tuple[str | None, int | None]:
    rendezvous = ENGINES[engine]
    values = flag_values(cmdline, rendezvous.leader_flag, rendezvous.port_flag)
    if rendezvous.leader_flag == rendezvous.port_flag:
        value = values.get(rendezvous.leader_flag)
        return split_host_port(value) if value else (None, None)
    port_text = values.get(rendezvous.port_flag, "")
    return values.get(rendezvous.leader_flag) or None, int(port_text) if port_text.isdigit() else None


def resolve_leader(host: str) -> set:
    """What ``host`` resolves to now (both families); a literal address is itself."""
    literal = host.strip("[]")
    try:
        return {_normalize(ipaddress.ip_address(literal))}
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError):
        return set()
    return {_normalize(ipaddress.ip_address(info[4][0].split("%", 1)[0])) for info in infos}


def verdict(leaders: set, port: int, connections: list[Connection]) -> tuple[bool, str]:
    """(alive, why): alive while a connection to the leader's store port is ESTABLISHED."""
    if not leaders:
        return False, "the leader does not resolve to any address"
    to_leader = [c for c in connections if c.port == port and c.remote in leaders]
    established = sum(1 for c in to_leader if c.state == TCP_ESTABLISHED)
    where = ", ".join(f"[{a}]:{port}" if a.version == 6 else f"{a}:{port}" for a in sorted(leaders, key=str))
    if established:
        return True, f"{established} established connection(s) to the leader's store {where}"
    states = ", ".join(sorted(TCP_STATES.get(c.state, c.state) for c in to_leader)) or "none"
    return False, (f"no established connection to the leader's store {where} (connections to it: {states}): "
                   "the ranks are not attached to a live leader")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Liveness probe for a multi-node engine's worker: exit 0 while a TCP connection to the "
                     "leader's store is ESTABLISHED, 1 otherwise (docs/running.md, \"Multi-node engines\").")
    p.add_argument("--engine", choices=sorted(ENGINES), required=True,
                   help="the engine whose command line names the leader (vllm: --master-addr/--master-port; "
                        "sglang, tokenspeed: --dist-init-addr host:port)")
    p.add_argument("--leader", help="the leader's host name or address, re-resolved on every run "
                                    "(default: off the engine's command line)")
    p.add_argument("--port", type=int, help="the leader's store port (default: off the engine's command line; "
                                            f"vLLM's default {VLLM_MASTER_PORT_DEFAULT})")
    p.add_argument("--proc-root", default="/proc",
                   help="where the TCP tables (net/tcp, net/tcp6) and the engine's 1/cmdline are read "
                        "(default /proc; tests point it at fake tables)")


def run(args: argparse.Namespace) -> int:
    rendezvous = ENGINES[args.engine]
    cmdline_path = os.path.join(args.proc_root, CMDLINE)
    leader, port, port_source = args.leader, args.port, "--port"
    if leader is None or port is None:
        try:
            with open(cmdline_path, "rb") as handle:
                cmdline = handle.read()
        except OSError:
            cmdline = b""
        found_leader, found_port = leader_from_cmdline(args.engine, cmdline)
        leader = leader or found_leader
        if port is None:
            port, port_source = found_port, f"{rendezvous.port_flag} in {cmdline_path}"
        if port is None and rendezvous.default_port is not None:
            port, port_source = rendezvous.default_port, f"the default; no {rendezvous.port_flag} in {cmdline_path}"
    if leader is None:
        print(f"worker probe: no leader: pass --leader, or {rendezvous.leader_flag} in {cmdline_path}",
              file=sys.stderr)
        return 1
    if port is None:
        print(f"worker probe: no store port: pass --port, or {rendezvous.port_flag} with a port in "
              f"{cmdline_path}", file=sys.stderr)
        return 1
    alive, why = verdict(resolve_leader(leader), port, read_connections(args.proc_root))
    print(f"worker probe: {'alive' if alive else 'NOT alive'}: {why} (store port {port} from {port_source})")
    return 0 if alive else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -I -m enginelink.tools.worker_probe")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
