"""Structured outputs on a real SGLang 0.5.23 scheduler, proven against SGLang's own code (issue 33 items 1, 2).

The scheduler cannot run here (no GPU), but the parts that decide whether a
constraint is enforced are CPU code, so they run from the SGLang venv
(``tools/setup-sglang``, which installs xgrammar 0.2.7 as SGLang pins it):

- the argv enginelink launches the scheduler with
  (``SglangLauncher.scheduler_command``) is parsed and resolved by SGLang's own
  ``prepare_server_args`` / ``resolve_once`` / ``publish``, and SGLang's own
  ``GrammarManager`` is built over the scheduler's own tokenizer (as
  ``Scheduler.init_tokenizer`` builds it) and model config: its grammar
  backend is not None, compiles a JSON schema, and the compiled grammar
  accepts a valid prefix and rejects a token outside it. The same argv with
  ``--skip-tokenizer-init`` (what enginelink launched before) builds none;
- the launch script's report of the resolved arguments
  (``sglang_headless.resolved_server_args``) says what SGLang resolved, and
  the labels GetServerInfo derives from it follow;
- a rejected token through SGLang's own result processor
  (``_accept_grammar_tokens``) with enginelink's grammar-attribution hooks
  registered through SGLang's hook registry ends with the named abort, which
  enginelink's codec answers FAILED_PRECONDITION + ``smg-constraint-failed``;
  without the hooks, SGLang's bare 500 stays INTERNAL.

The scheduler's event loop, the model's forward pass and the token masks on a
GPU are not run.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from enginelink.runtime.engine.grammar_labels import sglang_labels
from enginelink.runtime.contracts.sglang.launch import SGLANG_HEADLESS_SCRIPT, SglangLauncher
from enginelink.wire import sglang
from tests.wire.engine_venvs import side_python_or_skip

pytestmark = [pytest.mark.process, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
HOOKS = REPO / "tools" / "sglang_grammar_attribution.py"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
PROBE_TIMEOUT_S = 600.0

PROBE = r'''
import importlib.util, json, sys, types

def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

runs, headless_path, hooks_path, schema = json.loads(sys.argv[1])
headless = load("sglang_headless", headless_path)
from sglang.srt.server_args import prepare_server_args
from sglang.srt.runtime_context import SpawnRanks, get_exec, get_model, get_serving, publish
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.utils.hf_transformers_utils import get_tokenizer
from sglang.srt.constrained.grammar_manager import GrammarManager

results = []
for argv in runs:
    args = prepare_server_args(argv)
    args.resolve_once()
    args.check_server_args()
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0))  # as run_scheduler_process publishes
    config = ModelConfig.from_server_args(args)
    serving = get_serving()
    tokenizer = None
    if not serving.skip_tokenizer_init:  # Scheduler.init_tokenizer, text model branch
        tokenizer = get_tokenizer(serving.tokenizer_path, tokenizer_mode=serving.tokenizer_mode,
                                  trust_remote_code=get_model().trust_remote_code, revision=get_model().revision,
                                  tokenizer_backend=serving.tokenizer_backend)
    group = types.SimpleNamespace(world_size=1, first_rank=0, is_first_rank=True)
    scheduler = types.SimpleNamespace(server_args=args, tokenizer=tokenizer, model_config=config,
                                      dp_tp_cpu_group=None, dp_tp_group=group, pp_group=None)
    manager = GrammarManager(scheduler)
    run = {"backend": type(manager.grammar_backend).__name__ if manager.grammar_backend else None,
           "kernel_backend": get_exec().kernel.grammar_backend,
           "reported": headless.resolved_server_args(args)}
    if manager.grammar_backend is not None:
        value, _ = manager.grammar_backend.get_cached_or_future_value(("json", json.dumps(schema)), False)
        grammar = value.result() if hasattr(value, "result") else value
        run["compiled"] = type(grammar).__name__
        for token in tokenizer.encode('{"a": 1', add_special_tokens=False):
            grammar.accept_token(token)
        bad = tokenizer.encode("x", add_special_tokens=False)[0]
        # SGLang's own result processor over the rejected token: stock, then with enginelink's hooks.
        from sglang.srt.managers.scheduler_components import batch_result_processor as brp
        from sglang.srt.plugins.hook_registry import HookRegistry
        finishes = []
        for hooked in (False, True):
            if hooked:
                run["hooked"] = load("sglang_grammar_attribution", hooks_path).register()
                HookRegistry.apply_hooks()
            req = types.SimpleNamespace(rid="r1", grammar=grammar, to_finish=None)
            brp.SchedulerBatchResultProcessor._accept_grammar_tokens(object(), req, [bad])
            finishes.append(req.to_finish.to_json() if req.to_finish is not None else None)
        run["finishes"] = finishes
    results.append(run)
print("RESULT " + json.dumps(results))
'''


@pytest.fixture(scope="module")
def sglang_python() -> str:
    python = side_python_or_skip("sglang")
    found = subprocess.run([python, "-c", "import xgrammar"], capture_output=True, text=True, timeout=300)
    if found.returncode != 0:
        message = f"the SGLang venv of {python} has no xgrammar (SGLang's grammar backend): rerun tools/setup-sglang"
        if os.environ.get("ENGINELINK_REQUIRE_SGLANG") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return python


@pytest.fixture(scope="module")
def probe(sglang_python, test_model_dir) -> list[dict]:
    """SGLang's own resolution and grammar manager over the argv enginelink builds, and with --skip-tokenizer-init."""
    # --device cpu: SGLang's argument resolution stops without an accelerator otherwise (an operator's flag).
    launcher = SglangLauncher(python=sglang_python, model_dir=test_model_dir,
                              extra_args=["--device", "cpu", "--reasoning-parser", "qwen3"])
    argv, env = launcher.scheduler_command("ipc:///x/in", "ipc:///x/out", 3, environ={})
    assert argv[:2] == [sglang_python, str(SGLANG_HEADLESS_SCRIPT)]
    ours = argv[argv.index("--") + 1:]
    assert "--skip-tokenizer-init" not in ours
    assert env["SMG_SGLANG_ATTRIBUTE_GRAMMAR_ABORTS"] == "1"
    runs = [ours, [*ours, "--skip-tokenizer-init"]]
    done = subprocess.run([sglang_python, "-c", PROBE, json.dumps([runs, str(SGLANG_HEADLESS_SCRIPT), str(HOOKS),
                                                                    SCHEMA])],
                          capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                          env={**os.environ, "SGLANG_USE_PICKLE_IPC": "0"})
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def test_the_scheduler_enginelink_launches_builds_a_grammar_backend_that_compiles_a_schema(probe):
    ours, skipped = probe
    assert ours["backend"] == "XGrammarGrammarBackend" and ours["kernel_backend"] == "xgrammar"
    assert ours["compiled"] == "XGrammarGrammar"
    # What enginelink launched before: SGLang builds no backend, and aborts every constraint.
    assert skipped["backend"] is None


def test_the_reported_arguments_are_sglangs_resolution_and_the_labels_follow_them(probe):
    ours, skipped = probe
    assert ours["reported"]["grammar_backend"] == ours["kernel_backend"] == "xgrammar"  # resolved from unset
    assert ours["reported"]["skip_tokenizer_init"] is False and skipped["reported"]["skip_tokenizer_init"] is True
    assert sglang_labels(ours["reported"]) == {"grammar_backend": "xgrammar", "engine_reasoning_parser": "qwen3",
                                               "constrained_decoding_start": "after_reasoning"}
    assert sglang_labels(skipped["reported"])["grammar_backend"] == "none"


def test_a_rejected_token_is_attributed_in_sglangs_own_result_processor(probe):
    ours, _ = probe
    assert len(ours["hooked"]) == 3  # all three grammar paths exist in 0.5.23
    stock, hooked = ours["finishes"]
    # Stock SGLang: a bare 500 that names nothing; enginelink answers it INTERNAL, as the reference does.
    assert stock["type"] == "abort" and stock["status_code"] == 500 and stock["err_type"] == "InternalServerError"
    outcome = sglang.abort_outcome(sglang._finish(stock)[2])
    assert outcome.code == "INTERNAL" and outcome.trailer is None
    # With the hooks: named by the engine, so a constraint failure with the reference's trailer.
    assert hooked["err_type"] == sglang.GRAMMAR_ERR_TYPE and hooked["status_code"] == 500
    outcome = sglang.abort_outcome(sglang._finish(hooked)[2])
    assert outcome.code == "FAILED_PRECONDITION" and outcome.trailer == ("smg-constraint-failed", "engine")
    assert "Grammar accept_token failed" in outcome.message
