"""Hugging Face model ids (runtime/engine/model_source.py): resolved as vLLM resolves them, offline here.

Every test builds its own Hub-layout cache (``models--ORG--NAME/snapshots/COMMIT/…``,
``refs/main``) holding the project's test model, and runs with
``HF_HUB_OFFLINE=1``: nothing here may reach the Hub (this machine cannot
anyway). Served from the id, the servicer answers exactly as from the local
directory; the engine is given the local snapshot offline (what vLLM's own
offline mode rewrites an id to) and the id while the Hub is reachable; an id
that is not cached exits 2, naming it and the command that fetches it.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import huggingface_hub.constants
import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2 as pb

from enginelink.runtime.engine.model_source import ModelSource, ModelSourceError, resolve_model
from enginelink.tools import serve
from enginelink.tools.test_model import hub_commit, place_in_hub_cache
from tests.harness import Servicer, generate_request
from tests.test_operator import refused_with_one_line
from tests.test_operator import serve as serve_process

REPO = "enginelink-test/tiny"
OFFLINE = {"HF_HUB_OFFLINE": "1"}
PROMPT = [318, 283, 1552, 10, 90, 305]


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, test_model_dir) -> Path:
    cache = tmp_path_factory.mktemp("hf-cache")
    place_in_hub_cache(test_model_dir, cache, REPO)
    return cache


@pytest.fixture
def offline(monkeypatch):
    """HF_HUB_OFFLINE for this process's huggingface_hub (it reads the variable once, at import)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


# -- the resolver ----------------------------------------------------------------------------------------------


def test_a_cached_id_resolves_to_its_snapshot_offline(hub_cache, offline):
    source = resolve_model(REPO, download_dir=str(hub_cache))
    snapshot = hub_cache / "models--enginelink-test--tiny" / "snapshots" / hub_commit(REPO)
    assert (source.local_dir, source.repo_id, source.commit, source.offline) == (snapshot, REPO, hub_commit(REPO),
                                                                                True)
    assert source.name == REPO
    # Offline every engine gets the snapshot (vLLM's own offline rewrite); the commit names it too.
    assert {source.for_engine(engine) for engine in ("vllm", "sglang", "tokenspeed", "mlx", "sim")} == {str(snapshot)}
    assert resolve_model(REPO, revision=hub_commit(REPO), download_dir=str(hub_cache)).local_dir == snapshot


def test_online_the_engines_that_resolve_ids_get_the_id():
    source = ModelSource(given=REPO, local_dir=Path("/cache/snap"), repo_id=REPO, offline=False)
    assert [source.for_engine(e) for e in ("vllm", "sglang", "tokenspeed")] == [REPO] * 3
    assert [source.for_engine(e) for e in ("mlx", "sim")] == ["/cache/snap"] * 2  # enginelink's own engines
    local = ModelSource(given="/models/m", local_dir=Path("/models/m"))
    assert (local.for_engine("vllm"), local.name) == ("/models/m", "/models/m")


def test_a_directory_wins_over_an_id_of_the_same_name(tmp_path, monkeypatch, offline, test_model_dir):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "enginelink-test").mkdir()
    (tmp_path / "enginelink-test" / "tiny").symlink_to(test_model_dir)
    source = resolve_model(REPO, download_dir=str(tmp_path / "empty-cache"))
    assert (source.repo_id, source.local_dir) == (None, Path(REPO))


def test_an_id_not_cached_offline_names_it_and_how_to_fetch_it(hub_cache, offline):
    with pytest.raises(ModelSourceError) as refused:
        resolve_model("enginelink-test/missing", download_dir=str(hub_cache))
    message = str(refused.value)
    assert "'enginelink-test/missing' (revision main)" in message and "HF_HUB_OFFLINE" in message
    assert f"`hf download enginelink-test/missing --cache-dir {hub_cache}`" in message
    with pytest.raises(ModelSourceError, match="revision v9.*hf download enginelink-test/tiny --revision v9"):
        resolve_model(REPO, revision="v9", download_dir=str(hub_cache))


def test_neither_a_directory_nor_an_id(offline):
    with pytest.raises(ModelSourceError, match="no such directory"):
        resolve_model("/no/such/model/dir")


# -- through enginelink serve (the sim engine) --------------------------------------------------------------------


def answers(servicer: Servicer) -> dict:
    """What a client sees of the model: GetModelInfo, the tokenizer bundle's files, two generations."""
    info = servicer.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    chunks = list(servicer.stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=10))
    with zipfile.ZipFile(io.BytesIO(b"".join(chunk.data for chunk in chunks))) as bundle:
        files = {name: bundle.read(name) for name in bundle.namelist()}
    outputs = []
    for request in (generate_request("hub-1", PROMPT, max_tokens=12),
                    generate_request("hub-2", PROMPT, max_tokens=40, stop=["e"])):  # stop strings: the tokenizer
        [reply] = [m for m in servicer.stub.Generate(request, timeout=20) if m.WhichOneof("response") == "complete"]
        outputs.append((list(reply.complete.output_ids), reply.complete.finish_reason,
                        reply.complete.WhichOneof("matched_stop")))
    return {"info": info, "tokenizer": files, "outputs": outputs}


@pytest.fixture(scope="module")
def from_directory(tmp_path_factory, test_model_dir):
    with Servicer(tmp_path_factory.mktemp("hub-local"), model_dir=test_model_dir,
                  env={"ENGINELINK_WARMUP": "off", **OFFLINE}) as running:
        yield answers(running)


@pytest.mark.process
@pytest.mark.parametrize("where", ["HF_HUB_CACHE", "HF_HOME", "--download-dir"])
def test_the_id_answers_as_the_directory_does(tmp_path, hub_cache, test_model_dir, from_directory, where):
    env, extra = {"ENGINELINK_WARMUP": "off", **OFFLINE}, []
    if where == "HF_HUB_CACHE":
        env["HF_HUB_CACHE"] = str(hub_cache)
    elif where == "HF_HOME":
        home = tmp_path / "hf-home"
        home.mkdir()
        (home / "hub").symlink_to(hub_cache)
        env["HF_HOME"] = str(home)
    else:
        extra = ["--download-dir", str(hub_cache)]
    with Servicer(tmp_path, model_dir=None, extra=["--model", REPO, *extra], env=env) as running:
        got = answers(running)
        log = running.log()
    expected = from_directory
    snapshot = hub_cache / "models--enginelink-test--tiny" / "snapshots" / hub_commit(REPO)
    # As the reference (vLLM's model_config.model) and vLLM's default served name: the id.
    assert (got["info"].model_path, got["info"].served_model_name) == (REPO, REPO)
    assert Path(got["info"].tokenizer_path) == snapshot
    assert _without_paths(got["info"]) == _without_paths(expected["info"])
    assert got["tokenizer"] == expected["tokenizer"] and "tokenizer.json" in got["tokenizer"]
    assert got["outputs"] == expected["outputs"] and got["outputs"][1][2] == "matched_stop_str"
    assert f"snapshot {hub_commit(REPO)}" in log and "offline" in log


def _without_paths(info):
    copy = type(info)()
    copy.CopyFrom(info)
    for field in ("model_path", "served_model_name", "tokenizer_path"):
        copy.ClearField(field)
    return copy


@pytest.mark.process
def test_an_id_not_cached_exits_2_naming_it_and_the_fetch(tmp_path, hub_cache):
    line = refused_with_one_line(serve_process(tmp_path, "--model", "Qwen/Qwen3-0.6B", "--port", "50999",
                                               env={**OFFLINE, "HF_HUB_CACHE": str(hub_cache)}))
    assert "'Qwen/Qwen3-0.6B' (revision main)" in line and "`hf download Qwen/Qwen3-0.6B`" in line
    assert str(hub_cache) in line and "HF_HUB_OFFLINE" in line
    # vLLM's --hf-token is the resolver's token too, and appears nowhere.
    done = serve_process(tmp_path, "--engine", "vllm", "--model", "org/gated", "--port", "50999", "--",
                         "--hf-token", "s3cret-token", env={**OFFLINE, "HF_HUB_CACHE": str(hub_cache)})
    assert "'org/gated' (revision main)" in refused_with_one_line(done)
    assert "s3cret-token" not in done.stderr + done.stdout


# -- what each engine is launched with -------------------------------------------------------------------------

# build_config in a process of its own (grpclib's and grpcio's protos cannot share one descriptor pool), each
# engine's launcher built without its venv; prints the engine's model argument and its extra arguments.
LAUNCH = """
import argparse, json, sys
from enginelink.runtime.contracts.vllm.launch import VllmLauncher
from enginelink.runtime.contracts.mlx.launch import MlxLauncher
from enginelink.runtime.contracts.sglang.launch import SglangLauncher
from enginelink.runtime.contracts.tokenspeed.launch import TokenSpeedLauncher
from enginelink.tools import serve
serve._vllm_launcher = lambda m, a, allow_untested=False: VllmLauncher("/py", m, a)
serve._sglang_launcher = lambda m, a: SglangLauncher("/py", m, a)
serve._tokenspeed_launcher = lambda m, a: TokenSpeedLauncher("/py", m, a)
serve._mlx_launcher = lambda m, a: MlxLauncher("/py", m, a)
parser = argparse.ArgumentParser()
serve.add_arguments(parser)
argv = sys.argv[1:]
split = argv.index("--") if "--" in argv else len(argv)
args = parser.parse_args(argv[:split])
args.engine_args = argv[split + 1:]
config = serve.build_config(args)
print(json.dumps({"model": str(config.launcher.model_dir), "args": config.launcher.extra_args,
                  "model_path": config.model.model_path, "served": config.served_model_name,
                  "local": str(config.model_dir)}))
"""


@pytest.mark.process
@pytest.mark.parametrize("engine", ["vllm", "sglang", "tokenspeed", "mlx", "sim"])
def test_every_engine_is_launched_with_the_local_snapshot_offline(hub_cache, socket_dir, engine):
    env = {**os.environ, **OFFLINE, "HF_HUB_CACHE": str(hub_cache), "SMG_ZMQ_SOCKET_DIR": str(socket_dir)}
    done = subprocess.run([sys.executable, "-c", LAUNCH, "--engine", engine, "--model", REPO, "--revision", "main"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    snapshot = str(hub_cache / "models--enginelink-test--tiny" / "snapshots" / hub_commit(REPO))
    assert (got["model"], got["local"], got["model_path"], got["served"]) == (snapshot, snapshot, REPO, REPO)
    assert "--revision" not in got["args"]  # a local snapshot: nothing to resolve


def test_online_the_id_goes_to_the_engine_with_enginelinks_hub_flags():
    source = ModelSource(given=REPO, local_dir=Path("/cache/snap"), repo_id=REPO, offline=False)
    tokenizer = ModelSource(given="org/tok", local_dir=Path("/cache/tok"), repo_id="org/tok", offline=False)
    args = argparse.Namespace(engine="vllm", revision="v1", download_dir="/d", tokenizer="org/tok")
    model, engine_args = serve._engine_model(args, source, tokenizer, ["--max-model-len", "512"])
    assert model == REPO
    assert engine_args == ["--max-model-len", "512", "--tokenizer", "org/tok", "--revision", "v1",
                           "--download-dir", "/d"]
    # The engine's own flags (`vllm serve ID --revision R ...`) are kept as given, never doubled.
    _, engine_args = serve._engine_model(args, source, tokenizer, ["--revision", "v1", "--tokenizer=org/tok"])
    assert engine_args == ["--revision", "v1", "--tokenizer=org/tok", "--download-dir", "/d"]
    args.engine = "sglang"  # its scheduler keeps its tokenizer (its grammar backend's): SGLang's spelling
    _, engine_args = serve._engine_model(args, source, tokenizer, [])
    assert engine_args == ["--tokenizer-path", "org/tok", "--revision", "v1", "--download-dir", "/d"]


@pytest.mark.process
def test_the_engines_own_hub_flags_are_the_servicers_too(hub_cache, socket_dir, test_model_dir, tmp_path):
    """``vllm serve ID --revision R --download-dir D --tokenizer T`` hands those over as engine arguments."""
    env = {**os.environ, **OFFLINE, "SMG_ZMQ_SOCKET_DIR": str(socket_dir)}
    place_in_hub_cache(test_model_dir, hub_cache, "enginelink-test/tok")
    done = subprocess.run([sys.executable, "-c", LAUNCH, "--engine", "vllm", "--model", REPO, "--",
                           "--revision", hub_commit(REPO), "--download-dir", str(hub_cache),
                           "--tokenizer", "enginelink-test/tok", "--tokenizer-revision", "main"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["model"].endswith(hub_commit(REPO))
    assert got["args"][:2] == ["--revision", hub_commit(REPO)]  # the engine's own, as given


@pytest.mark.process
def test_make_test_model_files_it_under_a_hub_id(tmp_path, offline):
    """The demo's first step: the test model in a cache as ORG/NAME, found by the resolver offline."""
    from tests.harness import VENV_BIN

    cache = tmp_path / "cache"
    done = subprocess.run([str(VENV_BIN / "enginelink"), "make-test-model", str(tmp_path / "model"),
                           "--hub-id", "Qwen/Qwen3-0.6B", "--hub-cache", str(cache)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, **OFFLINE})
    assert done.returncode == 0, done.stderr
    snapshot = Path(done.stdout.strip())
    assert snapshot == cache / "models--Qwen--Qwen3-0.6B" / "snapshots" / hub_commit("Qwen/Qwen3-0.6B")
    assert (cache / "models--Qwen--Qwen3-0.6B" / "refs" / "main").read_text() == snapshot.name
    assert resolve_model("Qwen/Qwen3-0.6B", download_dir=str(cache)).local_dir == snapshot
    bad = subprocess.run([str(VENV_BIN / "enginelink"), "make-test-model", str(tmp_path / "model"),
                          "--hub-id", "not/a/valid/id", "--hub-cache", str(cache)],
                         capture_output=True, text=True, timeout=120, env={**os.environ, **OFFLINE})
    assert bad.returncode == 2 and "--hub-id 'not/a/valid/id'" in bad.stderr
