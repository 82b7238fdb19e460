"""The multi-node worker probe: exit codes against fake /proc tables and a real loopback store.

What a kubelet sees: the exit status (0 alive, 1 not) and one line saying why.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from enginelink.tools import worker_probe
from enginelink.tools.cli import main as cli_main

HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"


def hex4(address: str, port: int) -> str:
    return f"{struct.unpack('=I', socket.inet_aton(address))[0]:08X}:{port:04X}"


def hex6(address: str, port: int) -> str:
    packed = socket.inet_pton(socket.AF_INET6, address)
    words = "".join(f"{struct.unpack('=I', packed[i:i + 4])[0]:08X}" for i in range(0, 16, 4))
    return f"{words}:{port:04X}"


def row(local: str, remote: str, state: str) -> str:
    return f"   0: {local} {remote} {state} 00000000:00000000 00:00000000 00000000     0        0 1 1\n"


def fake_proc(tmp: Path, tcp: list[str], tcp6: list[str] | None = None, cmdline: list[str] | None = None) -> Path:
    root = tmp / "proc"
    (root / "net").mkdir(parents=True)
    (root / "net" / "tcp").write_text(HEADER + "".join(tcp))
    if tcp6 is not None:
        (root / "net" / "tcp6").write_text(HEADER + "".join(tcp6))
    if cmdline is not None:
        (root / "1").mkdir()
        (root / "1" / "cmdline").write_bytes(b"\0".join(w.encode() for w in cmdline) + b"\0")
    return root


def probe(*args: str) -> int:
    return cli_main(["worker-probe", *args])


VLLM_WORKER = ["/venv/bin/python", "/venv/bin/vllm", "serve", "m", "--headless", "--nnodes", "2", "--node-rank", "1",
               "--master-addr", "10.0.0.7", "--master-port", "29555"]


def test_established_connection_to_the_leader_passes(tmp_path, capsys):
    root = fake_proc(tmp_path, [row(hex4("10.0.0.9", 40000), hex4("10.0.0.7", 29555), "01")], cmdline=VLLM_WORKER)
    assert probe("--engine", "vllm", "--proc-root", str(root)) == 0
    out = capsys.readouterr().out
    assert "alive: 1 established connection(s) to the leader's store 10.0.0.7:29555" in out
    assert "--master-port in" in out


@pytest.mark.parametrize("state, name", [("06", "TIME_WAIT"), ("08", "CLOSE_WAIT"), ("02", "SYN_SENT")])
def test_a_connection_that_is_not_established_fails(tmp_path, capsys, state, name):
    root = fake_proc(tmp_path, [row(hex4("10.0.0.9", 40000), hex4("10.0.0.7", 29555), state)], cmdline=VLLM_WORKER)
    assert probe("--engine", "vllm", "--proc-root", str(root)) == 1
    assert f"connections to it: {name}" in capsys.readouterr().out


def test_connections_elsewhere_do_not_count(tmp_path, capsys):
    # Established, but to another host on the store port, and to the leader on another port.
    root = fake_proc(tmp_path, [row(hex4("10.0.0.9", 1), hex4("10.0.0.8", 29555), "01"),
                                row(hex4("10.0.0.9", 2), hex4("10.0.0.7", 29556), "01")], cmdline=VLLM_WORKER)
    assert probe("--engine", "vllm", "--proc-root", str(root)) == 1
    assert "connections to it: none" in capsys.readouterr().out


def test_an_ipv4_peer_of_a_dual_stack_socket_counts(tmp_path):
    root = fake_proc(tmp_path, [], tcp6=[row(hex6("::ffff:10.0.0.9", 1), hex6("::ffff:10.0.0.7", 29555), "01")],
                     cmdline=VLLM_WORKER)
    assert probe("--engine", "vllm", "--proc-root", str(root)) == 0


def test_an_ipv6_leader(tmp_path):
    root = fake_proc(tmp_path, [], tcp6=[row(hex6("fd00::9", 1), hex6("fd00::7", 5000), "01")],
                     cmdline=["sglang", "serve", "--dist-init-addr", "[fd00::7]:5000", "--node-rank", "1"])
    assert probe("--engine", "sglang", "--proc-root", str(root)) == 0


@pytest.mark.parametrize("cmdline", [
    ["python", "-m", "sglang.launch_server", "--dist-init-addr=10.0.0.7:5000"],
    ["python", "-m", "sglang.launch_server", "--dist_init_addr", "10.0.0.7:5000"],
    ["/bin/sh", "-c", "exec python -m sglang.launch_server --model-path m --dist-init-addr 10.0.0.7:5000"],
])
def test_dist_init_addr_in_each_spelling(tmp_path, cmdline):
    established = [row(hex4("10.0.0.9", 1), hex4("10.0.0.7", 5000), "01")]
    for engine in ("sglang", "tokenspeed"):
        root = fake_proc(tmp_path / engine, established, cmdline=cmdline)
        assert probe("--engine", engine, "--proc-root", str(root)) == 0


def test_vllm_master_flags_in_a_shell_wrapper_and_the_default_port(tmp_path, capsys):
    wrapper = ["/bin/sh", "-c", "vllm serve m --headless --master_addr=10.0.0.7 --node-rank 1"]
    root = fake_proc(tmp_path, [row(hex4("10.0.0.9", 1), hex4("10.0.0.7", 29501), "01")], cmdline=wrapper)
    assert probe("--engine", "vllm", "--proc-root", str(root)) == 0
    assert "store port 29501 from the default" in capsys.readouterr().out


def test_no_leader_anywhere_fails_and_says_how_to_name_it(tmp_path, capsys):
    root = fake_proc(tmp_path, [row(hex4("10.0.0.9", 1), hex4("10.0.0.7", 29501), "01")], cmdline=["vllm", "serve"])
    assert probe("--engine", "vllm", "--proc-root", str(root)) == 1
    assert "no leader: pass --leader, or --master-addr" in capsys.readouterr().err
    root = fake_proc(tmp_path / "sg", [], cmdline=["sglang", "serve", "--dist-init-addr", "10.0.0.7"])
    assert probe("--engine", "sglang", "--proc-root", str(root)) == 1
    assert "no store port" in capsys.readouterr().err


def test_leader_flag_is_resolved_and_overrides_the_command_line(tmp_path):
    # The command line names a dead leader; --leader names the live one (by name, resolved now).
    root = fake_proc(tmp_path, [row(hex4("127.0.0.1", 1), hex4("127.0.0.1", 29555), "01")], cmdline=VLLM_WORKER)
    assert probe("--engine", "vllm", "--proc-root", str(root)) == 1
    assert probe("--engine", "vllm", "--proc-root", str(root), "--leader", "localhost") == 0
    assert probe("--engine", "vllm", "--proc-root", str(root), "--leader", "localhost", "--port", "29556") == 1


def test_a_leader_that_does_not_resolve_fails(tmp_path, capsys):
    root = fake_proc(tmp_path, [row(hex4("10.0.0.9", 1), hex4("10.0.0.7", 29555), "01")], cmdline=VLLM_WORKER)
    assert probe("--engine", "vllm", "--proc-root", str(root), "--leader", "no-such-host.invalid") == 1
    assert "does not resolve" in capsys.readouterr().out


def test_garbage_table_lines_are_skipped(tmp_path):
    root = fake_proc(tmp_path, ["nonsense\n", "   1: zz:zz yy:yy 01\n",
                                row(hex4("10.0.0.9", 1), hex4("10.0.0.7", 29555), "01")], cmdline=VLLM_WORKER)
    assert probe("--engine", "vllm", "--proc-root", str(root)) == 0


def run_isolated(*args: str) -> subprocess.CompletedProcess:
    """The probe as a kubelet runs it: ``python3 -I -m enginelink.tools.worker_probe``."""
    return subprocess.run([sys.executable, "-I", "-m", "enginelink.tools.worker_probe", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.process
def test_a_live_loopback_store_connection_passes_and_its_close_fails():
    store = socket.create_server(("127.0.0.1", 0))
    port = store.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = store.accept()
    try:
        alive = run_isolated("--engine", "vllm", "--leader", "127.0.0.1", "--port", str(port))
        assert alive.returncode == 0, alive.stdout + alive.stderr
        assert f"established connection(s) to the leader's store 127.0.0.1:{port}" in alive.stdout
    finally:
        client.close()
        accepted.close()
        store.close()
    # The client side is gone at once; what lingers (TIME_WAIT) is not a connection.
    dead = run_isolated("--engine", "vllm", "--leader", "127.0.0.1", "--port", str(port))
    assert dead.returncode == 1, dead.stdout + dead.stderr
    assert "NOT alive" in dead.stdout


@pytest.mark.process
def test_a_listener_alone_is_not_alive():
    store = socket.create_server(("127.0.0.1", 0))
    try:
        result = run_isolated("--engine", "sglang", "--leader", "127.0.0.1", "--port", str(store.getsockname()[1]))
        assert result.returncode == 1
    finally:
        store.close()


@pytest.mark.process
def test_it_imports_only_the_standard_library():
    code = ("import sys; before = set(sys.modules); import runpy; "
            "sys.argv = ['p', '--engine', 'vllm', '--leader', '127.0.0.1', '--port', '1', '--proc-root', '/nonexistent']\n"
            "try:\n runpy.run_module('enginelink.tools.worker_probe', run_name='__main__')\n"
            "except SystemExit: pass\n"
            "import json; print(json.dumps(sorted(set(sys.modules) - before)))")
    result = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=60)
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    ours = {name for name in loaded if name.startswith("enginelink")}
    assert ours <= {"enginelink", "enginelink.tools", "enginelink.tools.worker_probe"}, ours
    foreign = {name.split(".")[0] for name in loaded} - set(sys.stdlib_module_names) - {"enginelink"}
    # The editable install's import hook is how the module is found at all, not something it imports.
    foreign = {name for name in foreign if not name.startswith("__editable__")}
    assert not foreign, foreign
