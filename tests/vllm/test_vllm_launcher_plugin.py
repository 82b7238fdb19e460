"""``vllm serve MODEL --grpc --servicer-impl enginelink``: vLLM's own launcher, enginelink inside it.

The real ``vllm`` command of the vLLM venv (enginelink installed into it by
tools/setup-vllm-plugin), the real SMG router in front, a streamed completion
through both, then SIGTERM: the launcher drains and exits 0, and nothing of
the engine is left. The selection by environment (``SMG_VLLM_SERVICER_IMPL``)
and the ``VLLM_PLUGINS`` filter are checked on the parse alone (no engine),
as is the capture cap of a ``vllm serve --headless`` worker; last, a two-node
engine on loopback with the worker probe against its worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import Router, Servicer, alive, free_port, generate_request, scrape, wait_until
from tests.router.openai_http import DONE, stream
from tests.vllm.conftest import START_TIMEOUT_S, vllm_servicer

pytestmark = [pytest.mark.vllm, pytest.mark.router, pytest.mark.slow]

PLUGIN_PROBE = """
import json, sys
from importlib.metadata import entry_points
print(json.dumps([e.value for e in entry_points(group="vllm.general_plugins") if e.name == "enginelink"]))
"""


@pytest.fixture(scope="module")
def vllm_command(vllm_python) -> Path:
    """The vLLM venv's ``vllm`` command, with enginelink's plugin installed beside it."""
    command = Path(vllm_python).parent / "vllm"
    found = subprocess.run([vllm_python, "-c", PLUGIN_PROBE], capture_output=True, text=True, timeout=60)
    if not command.exists() or json.loads(found.stdout or "[]") != ["enginelink.tools.vllm_plugin:register"]:
        message = f"enginelink is not installed in the vLLM venv of {vllm_python}: run tools/setup-vllm-plugin"
        if os.environ.get("ENGINELINK_REQUIRE_VLLM") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return command


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (the engine, in a process group of its own, is still a child)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def test_vllm_serve_grpc_runs_enginelink_behind_the_router(vllm_command, test_model_dir, tmp_path):
    metrics_port = free_port()
    # The engine at the servicer's priority: its nice (not what this test is about) starves it on a shared box.
    launcher = Servicer(tmp_path, env={"ENGINELINK_WARMUP": "off", "ENGINELINK_DRAIN_SECS": "5",
                                       "SMG_VLLM_SERVICER_METRICS_HOST": "127.0.0.1", "ENGINELINK_ENGINE_NICE": "0"})
    launcher.argv = [str(vllm_command), "serve", str(test_model_dir), "--grpc", "--servicer-impl", "enginelink",
                     "--host", "127.0.0.1", "--port", str(launcher.port), "--metrics-port", str(metrics_port),
                     "--max-model-len", "1024", "--enforce-eager", "--max-num-seqs", "8",
                     "--uvicorn-log-level", "warning"]
    try:
        # Two vLLM interpreters start one after the other here: the launcher, then the engine core.
        launcher.start(timeout_s=2 * START_TIMEOUT_S)
        engine = descendants(launcher.process.pid)
        assert engine, "the engine core runs beside the launcher, as its child"
        log = launcher.log()
        assert "vllm serve flags that enginelink's servicer does not use: --uvicorn-log-level" in log
        # Eager mode: the capture cap keeps the engine's default, and says so once.
        assert log.count("CUDA-graph capture cap: no CUDA graphs (--enforce-eager)") == 1
        # --metrics-port is the servicer's Prometheus endpoint.
        assert any(name.startswith("smg_servicer_") for name in scrape(metrics_port))
        router = Router(tmp_path, launcher.port, test_model_dir).start(timeout_s=60)
        try:
            body = {"model": test_model_dir.name, "prompt": "def foo(x):", "max_tokens": 8, "temperature": 0,
                    "ignore_eos": True}
            status, events = stream(router.url, "/v1/completions", body)
            assert status == 200, events
            assert events[-1] == DONE
            chunks = events[:-1]
            assert "".join(c["choices"][0]["text"] for c in chunks)
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        finally:
            router.stop()
        launcher.signal(signal.SIGTERM)
        assert launcher.wait(timeout_s=60) == 0, launcher.log()[-3000:]
        left = {pid for pid in engine if alive(pid)}
        assert not left, f"engine processes left after the launcher exited: {left}"
    finally:
        launcher.stop()


PARSE_ONLY = """
import sys
import uvloop
def stock(coroutine):  # vLLM's own launcher got as far as its event loop: stop there
    coroutine.close()
    print("STOCK", flush=True)
    raise SystemExit(0)
uvloop.run = stock
from vllm.entrypoints.cli.main import main
from enginelink.tools import vllm_grpc_launcher
# What would run: the handover's engine arguments, not an engine.
def show(args):
    from enginelink.tools import vllm_plugin
    plan = vllm_plugin.handover()
    engine, unused = vllm_grpc_launcher.split_engine_args(plan.parser, plan.args, vllm_grpc_launcher.engine_dests())
    print("HANDOVER", engine, unused, args.port, flush=True)
    raise SystemExit(0)
vllm_grpc_launcher.run = show
sys.argv = ["vllm", "serve", sys.argv[1], "--grpc", "--port", "50999", "--max-model-len", "1024", "--enforce-eager"]
main()
"""


def parse_only(vllm_python: str, model: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("SMG_VLLM_SERVICER_IMPL", "VLLM_PLUGINS")}
    return subprocess.run([vllm_python, "-c", PARSE_ONLY, str(model)], capture_output=True, text=True,
                          timeout=300, env={**environ, **env})


def test_the_environment_selects_enginelink_and_vllm_plugins_filters_it(vllm_command, vllm_python, test_model_dir):
    chosen = parse_only(vllm_python, test_model_dir, SMG_VLLM_SERVICER_IMPL="enginelink")
    assert chosen.returncode == 0, chosen.stderr[-3000:]
    assert "HANDOVER ['--max-model-len', '1024', '--enforce-eager'] [] 50999" in chosen.stdout
    # Filtered out by VLLM_PLUGINS, or not selected: vLLM's own launcher, which needs the reference package.
    for env in ({"SMG_VLLM_SERVICER_IMPL": "enginelink", "VLLM_PLUGINS": "someone-else"}, {}):
        stock = parse_only(vllm_python, test_model_dir, **env)
        assert "HANDOVER" not in stock.stdout
        # Without the reference package its import fails; with it, its serve_grpc reaches the event loop.
        assert "STOCK" in stock.stdout or "gRPC mode requires smg-grpc-servicer" in stock.stderr, stock.stderr[-2000:]


HEADLESS_PARSE = """
import json, sys
import vllm.entrypoints.cli.serve as serve
from vllm.engine.arg_utils import AsyncEngineArgs
def show(args):  # what the worker would build its engine from, then stop
    engine_args = AsyncEngineArgs.from_cli_args(args)
    print("ENGINE", engine_args.max_cudagraph_capture_size, flush=True)
    raise SystemExit(0)
serve.run_headless = show
from vllm.entrypoints.cli.main import main
for extra in json.loads(sys.argv[2]):  # one import of vLLM, a parse per case
    print("CASE", json.dumps(extra), flush=True)
    sys.argv = ["vllm", "serve", sys.argv[1], "--headless", "--nnodes", "2", "--node-rank", "1", "--master-addr",
                "127.0.0.1", "--max-num-seqs", "32", *extra]
    try:
        main()
    except SystemExit as done:
        print("EXIT", done.code, flush=True)
"""


def test_a_headless_workers_engine_arguments_get_the_capture_cap(vllm_command, vllm_python, test_model_dir):
    """A multi-node worker (`vllm serve --headless --node-rank 1`) builds its engine with the leader's cap:
    on CPU only its engine arguments show it (no CUDA graphs to capture). Both cases in one interpreter
    (vLLM's imports are ~10 s of CPU), each parse's output read apart."""
    cases = ((["--max-num-batched-tokens", "2048"], "ENGINE 512", "512, derived"),
             (["--enforce-eager"], "ENGINE None", "no CUDA graphs (--enforce-eager)"))
    done = subprocess.run([vllm_python, "-c", HEADLESS_PARSE, str(test_model_dir),
                           json.dumps([extra for extra, _, _ in cases])],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    parts = re.split(r"(?m)^CASE ", done.stdout)[1:]
    assert len(parts) == len(cases), done.stdout[-3000:]
    for (extra, engine, line), said in zip(cases, parts):
        assert said.startswith(json.dumps(extra)) and "EXIT 0" in said, said[-3000:]
        assert engine in said
        assert said.count(f"CUDA-graph capture cap: {line}") == 1, said[-3000:]


def probe_exit(proc_root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-I", "-m", "enginelink.tools.worker_probe", "--engine", "vllm",
                           "--proc-root", str(proc_root)], capture_output=True, text=True, timeout=60)


def test_a_two_node_engine_on_loopback_and_its_worker_probe(vllm_command, test_model_dir, tmp_path):
    """Multi-node vLLM, emulated on one machine: enginelink fronts node 0 (TP rank 0), `vllm serve
    --headless --node-rank 1` is node 1 (TP rank 1). The worker probe, reading the worker's own command
    line, passes while the worker holds its connection to the leader's store, and fails once the leader
    is gone while the orphaned worker still runs."""
    store_port = free_port()
    node = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(store_port),
            "--tensor-parallel-size", "2", "--max-model-len", "1024", "--enforce-eager"]
    leader = vllm_servicer(tmp_path, test_model_dir, engine_args=["--node-rank", "0", *node],
                           env={"ENGINELINK_WARMUP": "off", "ENGINELINK_ENGINE_NICE": "0"})
    worker_log = open(tmp_path / "worker.log", "wb")
    worker = subprocess.Popen([str(vllm_command), "serve", str(test_model_dir), "--headless", "--node-rank", "1",
                               *node], stdout=worker_log, stderr=subprocess.STDOUT, start_new_session=True,
                              env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    # The probe as the worker's pod runs it: its PID 1 is the worker, its network namespace this one.
    proc_root = tmp_path / "proc"
    (proc_root / "1").mkdir(parents=True)
    (proc_root / "net").symlink_to("/proc/net")
    try:
        leader.start(timeout_s=2 * START_TIMEOUT_S)
        # Read once the worker is up (right after the fork, /proc shows the parent's command line).
        (proc_root / "1" / "cmdline").write_bytes(Path(f"/proc/{worker.pid}/cmdline").read_bytes())
        replies = list(leader.stub.Generate(generate_request("two-nodes", [318, 283, 1552, 10], max_tokens=4,
                                                             ignore_eos=True, temperature=0.0), timeout=120))
        assert len(replies[-1].complete.output_ids) == 4
        alive_now = probe_exit(proc_root)
        assert alive_now.returncode == 0, alive_now.stdout + alive_now.stderr
        assert f"store port {store_port} from --master-port" in alive_now.stdout
        assert leader.stop() == 0
        assert worker.poll() is None, "the worker outlives its leader: what the probe is for"
        gone = wait_until(lambda: (done := probe_exit(proc_root)).returncode == 1 and done, 60,
                          "the worker probe failing once the leader is gone")
        assert "NOT alive" in gone.stdout
    finally:
        leader.stop()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        worker_log.close()


# -- the reference's flags under every vLLM launcher (issue 32 item 3) -------------------------

# What the vLLM venv's interpreters import at start in these tests: the start-up hook's .pth line
# (tools/vllm_launch_hook.py), as tools/setup-vllm-plugin installs it, and with DUMP, enginelink's
# serve.run replaced by a dump of what it was handed and how it resolves it.
SITECUSTOMIZE = """
import os, site
site.addsitedir(os.path.join(os.path.dirname(__file__), "pth"))
if os.path.exists(os.path.join(os.path.dirname(__file__), "DUMP")):
    import json, sys
    import enginelink.tools.serve as serve
    from enginelink.tools import ref_settings

    def dump(args):
        ref = ref_settings.resolve(args, os.environ, "vllm", args.engine)
        print("SERVE " + json.dumps({"namespace": {k: v for k, v in vars(args).items() if k != "model"},
                                     "model": str(args.model), "sources": {k: v.label for k, v in ref.values.items()},
                                     "refusals": ref.refusals}), flush=True)
        return 0

    serve.run = dump
"""


def tree_site(tmp: Path, dump: bool) -> str:
    """A PYTHONPATH for the vLLM venv that runs this checkout's enginelink (the venv's editable install may be
    another checkout's) and installs the start-up hook; ``dump``: serve.run only reports what it got."""
    from enginelink.tools.vllm_launch_hook import PTH_LINE

    root = tmp / ("site-dump" if dump else "site")
    (root / "enginelink").mkdir(parents=True)
    (root / "pth").mkdir()
    repo = Path(__file__).resolve().parents[2]
    for folder in ("journal", "machines", "proto", "runtime", "tools", "wire"):
        (root / "enginelink" / folder).symlink_to(repo / folder)
    (root / "pth" / "enginelink-vllm-launcher.pth").write_text(PTH_LINE)
    (root / "sitecustomize.py").write_text(SITECUSTOMIZE)
    if dump:
        (root / "DUMP").write_text("")
    return str(root)


def launch_forms(vllm_command: Path, vllm_python: str, model: Path) -> dict[str, list[str]]:
    return {"vllm serve": [str(vllm_command), "serve", str(model), "--grpc"],
            "python -m launchers.grpc_server": [vllm_python, "-m", "vllm.entrypoints.launchers.grpc_server",
                                                "--model", str(model)],
            "python -m grpc_server": [vllm_python, "-m", "vllm.entrypoints.grpc_server", "--model", str(model)]}


@pytest.mark.parametrize("form", ["vllm serve", "python -m launchers.grpc_server", "python -m grpc_server"])
def test_the_references_flags_reach_the_servicer_under_each_vllm_launcher(form, vllm_command, vllm_python,
                                                                           test_model_dir, tmp_path):
    """Every flag the reference's plugin adds, on each of vLLM's gRPC launchers, parsed by vLLM's own parser
    and handed to enginelink's servicer with its source; the variables behind them where no flag is given.
    vLLM's own --allowed-media-domains (enforced by the servicer's fetcher) and --media-io-kwargs (applied
    by the in-process processor's loaders) are taken too, and go to the engine as well: nothing refused.
    (One parse per launcher: each is a start of vLLM's imports, ~10 s of CPU.)"""
    argv = [*launch_forms(vllm_command, vllm_python, test_model_dir)[form], "--port", "50999",
            "--max-model-len", "1024", "--enforce-eager", "--servicer-impl", "enginelink",
            "--mm-processor", "inprocess", "--mm-max-items", "3", "--mm-max-item-bytes", "65536",
            "--mm-fetch-timeout-ms", "900", "--mm-video-fetch-timeout-ms", "1900", "--mm-turbojpeg", "prefer",
            "--allowed-local-media-path", str(tmp_path), "--metrics-port", "9123", "--metrics-host", "127.0.0.2",
            "--allowed-media-domains", "example.com", "--media-io-kwargs", '{"image": {}}',
            "--mm-redis-url", "redis://r:6379/0"]
    env = {**os.environ, "PYTHONPATH": tree_site(tmp_path, dump=True), "SMG_VLLM_MM_MAX_INFLIGHT": "5"}
    env.pop("SMG_VLLM_SERVICER_IMPL", None)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = [line for line in done.stdout.splitlines() if line.startswith("SERVE ")]
    got = json.loads(line[len("SERVE "):])
    assert got["model"] == str(test_model_dir) and got["namespace"]["port"] == 50999
    assert got["namespace"]["servicer_impl_source"] == "flag"
    assert got["sources"] == {
        "mm_processor": "--mm-processor", "mm_max_inflight": "SMG_VLLM_MM_MAX_INFLIGHT",
        "mm_max_item_bytes": "--mm-max-item-bytes", "mm_max_items": "--mm-max-items",
        "mm_redis_url": "--mm-redis-url", "mm_sidecar_timeout_ms": "default", "mm_sidecar_max_queue": "default",
        "mm_sidecar_namespace": "default", "mm_turbojpeg": "--mm-turbojpeg",
        "mm_fetch_timeout_ms": "--mm-fetch-timeout-ms", "mm_video_fetch_timeout_ms": "--mm-video-fetch-timeout-ms",
        "allowed_local_media_path": "--allowed-local-media-path",
        "allowed_media_domains": "--allowed-media-domains", "media_io_kwargs": "--media-io-kwargs",
        "metrics_port": "--metrics-port", "metrics_host": "--metrics-host"}
    assert got["refusals"] == []
    assert got["namespace"]["allowed_media_domains"] == ["example.com"]
    # The engine gets its own arguments (vLLM's media flags among them), never the servicer's.
    assert got["namespace"]["engine_args"] == ["--max-model-len", "1024", "--enforce-eager",
                                               "--allowed-local-media-path", str(tmp_path),
                                               "--allowed-media-domains", "example.com",
                                               "--media-io-kwargs", '{"image": {}}']
    assert "vllm serve flags that enginelink's servicer does not use" not in done.stderr


def test_python_m_the_stock_launcher_serves_enginelink_selected_by_the_environment(vllm_command, vllm_python,
                                                                                   test_model_dir, tmp_path):
    """``python -m vllm.entrypoints.launchers.grpc_server`` without the reference package installed: the
    start-up hook answers the module, enginelink serves, the start-up lines say what decided."""
    launcher = Servicer(tmp_path, env={"PYTHONPATH": tree_site(tmp_path, dump=False), "ENGINELINK_WARMUP": "off",
                                       "ENGINELINK_ENGINE_NICE": "0", "SMG_VLLM_SERVICER_IMPL": "enginelink",
                                       "SMG_VLLM_SERVICER_DRAIN_SECS": "2"})
    launcher.argv = [vllm_python, "-m", "vllm.entrypoints.launchers.grpc_server", "--model", str(test_model_dir),
                     "--host", "127.0.0.1", "--port", str(launcher.port), "--max-model-len", "1024",
                     "--enforce-eager", "--max-num-seqs", "8", "--mm-processor", "off"]
    try:
        launcher.start(timeout_s=2 * START_TIMEOUT_S)
        replies = list(launcher.stub.Generate(generate_request("stock", [318, 283, 1552, 10], max_tokens=4,
                                                               ignore_eos=True, temperature=0.0), timeout=120))
        assert len(replies[-1].complete.output_ids) == 4
        log = launcher.log()
        assert "servicer implementation: enginelink (source=env)" in log
        assert "worker-side media processing: off (source=flag)" in log
        assert "mm_processor=off (--mm-processor), drain_s=2 (SMG_VLLM_SERVICER_DRAIN_SECS)" in log
        launcher.signal(signal.SIGTERM)
        assert launcher.wait(timeout_s=60) == 0, launcher.log()[-3000:]
    finally:
        launcher.stop()
