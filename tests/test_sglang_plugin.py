"""The SGLang launcher hand-over: ``sglang serve ... --smg-grpc-mode`` with ``SMG_SGLANG_SERVICER_IMPL=enginelink``.

Without SGLang (stand-in modules), these check the plugin's selection, that
SGLang's gRPC entry point's import is answered with enginelink's, what the
launcher's arguments become, and that ``serve_grpc`` runs ``enginelink serve``
with them and exits with its status. The real launcher, run up to the engine
launch (no GPU here for the scheduler): ``tests/sglang/test_sglang_launcher_real.py``.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest

from enginelink.tools import sglang_grpc_launcher as launcher
from enginelink.tools import sglang_plugin as plugin


@pytest.mark.parametrize("argv, env, picked", [
    (["sglang", "serve", "--model-path", "M", "--smg-grpc-mode"], "enginelink", True),
    (["launch_server.py", "--model-path", "M", "--grpc-mode"], "ENGINELINK ", True),
    (["sglang", "serve", "--model-path", "M", "--smg-grpc-mode"], "", False),  # the reference's, not ours
    (["sglang", "serve", "--model-path", "M"], "enginelink", False),  # an HTTP server
    (["-c", "from multiprocessing.spawn import spawn_main"], "enginelink", False),  # a spawned scheduler
])  # fmt: skip
def test_selection_needs_the_grpc_flag_and_enginelink_asked_for(argv, env, picked):
    assert plugin.selected(argv, {plugin.SERVICER_IMPL_ENV: env}) is picked


@pytest.mark.parametrize("args, expected", [
    (["--model-path", "/m", "--smg-grpc-mode"],
     ["--engine", "sglang", "--model", "/m", "--host", "127.0.0.1", "--port", "30000"]),
    (["--model=/m", "--host", "0.0.0.0", "--port=31000", "--grpc-mode", "--tp-size", "2", "--skip-tokenizer-init",
      "--served-model-name", "tiny"],
     # --skip-tokenizer-init goes to the scheduler as given: without its tokenizer it builds no grammar
     # backend, and the worker then refuses constraints itself (sglang_grpc_launcher.py).
     ["--engine", "sglang", "--model", "/m", "--host", "0.0.0.0", "--port", "31000", "--",
      "--tp-size", "2", "--skip-tokenizer-init", "--served-model-name", "tiny"]),
])  # fmt: skip
def test_the_launchers_arguments_become_enginelink_serves(args, expected):
    assert launcher.handover_args(args) == expected
    assert launcher.server_arguments(["sglang", "serve", *args]) == args
    assert launcher.server_arguments(["launch_server.py", *args]) == args


def test_no_model_path_is_refused():
    with pytest.raises(SystemExit, match="--model-path is required"):
        launcher.handover_args(["--smg-grpc-mode"])


def test_the_entry_points_import_is_answered_with_enginelinks_and_serve_grpc_runs_enginelink(
        tmp_path, monkeypatch):
    # Stand-in parents of SGLang's module (the real package is not in this venv): only the leaf is ours.
    for part in ("sglang", "sglang/srt", "sglang/srt/entrypoints"):
        (tmp_path / part).mkdir()
        (tmp_path / part / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["sglang", "serve", "--model-path", "/models/tiny", "--smg-grpc-mode",
                                      "--port", "31001", "--mem-fraction-static", "0.8"])
    monkeypatch.setenv(plugin.SERVICER_IMPL_ENV, "enginelink")
    saved_python = os.environ.pop("ENGINELINK_SGLANG_PYTHON", None)
    for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
        monkeypatch.delitem(sys.modules, name)
    before = list(sys.meta_path)
    try:
        plugin.register()
        module = importlib.import_module(plugin.LAUNCHER_MODULE)
        assert module.serve_grpc is launcher.serve_grpc
        ran = []
        monkeypatch.setattr("enginelink.tools.cli.main", lambda argv: ran.append(argv) or 2)
        with pytest.raises(SystemExit) as exited:
            module.serve_grpc(object())  # what asyncio.run(serve_grpc(server_args)) evaluates first
        assert exited.value.code == 2
        assert ran == [["serve", "--engine", "sglang", "--model", "/models/tiny", "--host", "127.0.0.1",
                        "--port", "31001", "--servicer-impl-source", "env", "--", "--mem-fraction-static", "0.8"]]
        assert os.environ["ENGINELINK_SGLANG_PYTHON"] == sys.executable
    finally:
        os.environ.pop("ENGINELINK_SGLANG_PYTHON", None)
        if saved_python is not None:
            os.environ["ENGINELINK_SGLANG_PYTHON"] = saved_python
        sys.meta_path[:] = before
        for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
            del sys.modules[name]


def test_an_unselected_process_is_left_alone(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["sglang", "serve", "--model-path", "M", "--smg-grpc-mode"])
    monkeypatch.delenv(plugin.SERVICER_IMPL_ENV, raising=False)
    before = list(sys.meta_path)
    plugin.register()
    assert sys.meta_path == before


@pytest.mark.process
def test_the_real_launcher_loads_plugins_then_imports_the_entry_point_we_answer():
    """The release's own launcher code, read (tests/sglang/test_sglang_launcher_real.py runs it)."""
    import subprocess
    from pathlib import Path

    from tests.wire.engine_venvs import side_python_or_skip

    python = side_python_or_skip("sglang")
    find = "import importlib.util as u; print(u.find_spec('sglang').submodule_search_locations[0])"
    root = Path(subprocess.run([python, "-c", find], capture_output=True, text=True, timeout=60).stdout.strip())
    launch = (root / "launch_server.py").read_text()
    assert "from sglang.srt.entrypoints.grpc_server import serve_grpc" in launch
    assert "asyncio.run(serve_grpc(server_args))" in launch
    serve_cli = (root / "cli" / "serve.py").read_text()
    assert serve_cli.index("load_plugins()") > 0 and "run_server(server_args)" in serve_cli
    plugins = (root / "srt" / "plugins" / "__init__.py").read_text()
    assert 'GENERAL_PLUGINS_GROUP = "sglang.srt.plugins"' in plugins
