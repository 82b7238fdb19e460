"""Run SGLang 0.5.23's scheduler ranks against addresses enginelink bound; report ready on an fd.

Run by the SGLang venv's python, by path (enginelink is not importable
there): ``python sglang_headless.py --scheduler-input-ipc A --tokenizer-ipc B
--ready-fd FD -- <sglang server args>``. It does what SGLang's own gRPC
launcher does (``reference/sglang-contract.md`` §5.1) with enginelink in the
TokenizerManager's place: SGLang's own set-up steps of
``Engine._launch_subprocesses``, ``PortArgs.init_new`` with the two addresses
replaced by ours (outputs come to the tokenizer address whether or not the
scheduler keeps its tokenizer: the detokenizer address is ours too), the ranks
spawned by SGLang's own ``Engine._launch_scheduler_processes`` (TP x PP on this
node), the first rank's ``{"status": "ready", ...}`` written as one JSON line
to FD, with ``server_args``: the arguments enginelink reads (``REPORTED``) as
SGLang resolved them (the grammar backend its scheduler builds, the reasoning
parser an ``auto`` became, ...; ``resolved_server_args``), and
``supports_vision``: whether SGLang's model config takes images
(``image_understanding``). It then
blocks until the schedulers exit; SIGTERM stops them. Requires a CUDA GPU; not runnable on a CPU-only machine (written from
SGLang's source, verified only up to the release check there).

Data parallelism (``--dp-size N``): SGLang's own launcher starts its DP
controller, which reads requests from our input address and places each on
a rank (enginelink names the rank in every request: ``routed_dp_rank``);
every rank pushes its outputs to our output address. Under attention DP
(``--enable-dp-attention``) SGLang gives each rank TCP addresses derived from
``--port`` instead (``PortArgs.init_new``), so this script forwards what
arrives there to our output address (``forward_outputs``).

A prefill leg (``--disaggregation-mode prefill``): the KV bootstrap server the
decode side meets it at starts here, before the ranks that register with it,
as SGLang's tokenizer manager would start it (``start_disagg_service``).
"""

import argparse
import json
import os
import signal
import sys

# The server arguments enginelink's servicer reads (GetServerInfo's labels, the refusals ahead of the
# scheduler), reported as SGLang resolved them. A bounded list: nothing else (no credentials) leaves.
REPORTED = ("skip_tokenizer_init", "grammar_backend", "reasoning_parser", "tokenizer_path",
            "enable_custom_logit_processor", "enable_lora", "lora_paths", "limit_mm_data_per_request",
            "chunked_prefill_size", "served_model_name")
_MISSING = object()


def resolved_server_args(server_args) -> dict:
    """``REPORTED`` as the scheduler runs them: SGLang 0.5.23 keeps each argument as typed and records
    what its resolution decided (an unset ``--grammar-backend`` → ``xgrammar``, ...) in
    ``_resolved_overrides``, last writer wins (its own serving view reads them so); JSON values only."""
    overrides = list(getattr(server_args, "_resolved_overrides", None) or ())
    report = {}
    for name in REPORTED:
        value = next((declared[name] for _, declared in reversed(overrides) if name in declared), _MISSING)
        if value is _MISSING:
            value = getattr(server_args, name, _MISSING)
        if value is _MISSING:
            continue
        report[name] = json.loads(json.dumps(value, default=str))
    return report


def image_understanding(server_args) -> bool:
    """Whether the scheduler takes images: SGLang's own ``ModelConfig.is_image_understandable_model`` for the
    arguments as resolved (its HTTP server's ``/model_info`` ``has_image_understanding``: a multimodal
    architecture with a vision tower, not under ``--language-model-only``); enginelink's GetModelInfo
    ``supports_vision`` and its acceptance of router tensors follow it. False, said on stderr, when SGLang
    cannot tell (a label must not stop a scheduler that runs)."""
    try:
        from sglang.srt.configs.model_config import ModelConfig

        return bool(ModelConfig.from_server_args(server_args).is_image_understandable_model)
    except Exception as error:  # noqa: BLE001 - any failure only costs the label
        print(f"sglang_headless: cannot tell whether the model takes images ({error}); reporting it does not",
              file=sys.stderr)
        return False


def grammar_attribution_loaded() -> bool:
    """Whether SGLang's ranks will load enginelink's plugin, whose hooks name a grammar's aborts
    (``tools/sglang_grammar_attribution.py``; ``SMG_SGLANG_ATTRIBUTE_GRAMMAR_ABORTS`` turns them on)."""
    from importlib.metadata import entry_points

    allowed = {name.strip() for name in os.environ.get("SGLANG_PLUGINS", "").split(",") if name.strip()}
    return any(entry.name == "enginelink" and (not allowed or entry.name in allowed)
               for entry in entry_points(group="sglang.srt.plugins"))


def main() -> int:
    os.environ.setdefault("SGLANG_USE_PICKLE_IPC", "0")
    split = sys.argv.index("--")
    parser = argparse.ArgumentParser()
    parser.add_argument("--scheduler-input-ipc", required=True)
    parser.add_argument("--tokenizer-ipc", required=True)
    parser.add_argument("--ready-fd", type=int, required=True)
    args = parser.parse_args(sys.argv[1:split])
    import sglang.srt.entrypoints.engine as engine
    from sglang.srt.managers.disagg_service import start_disagg_service
    from sglang.srt.managers.scheduler import run_scheduler_process
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.server_args import PortArgs, prepare_server_args

    server_args = prepare_server_args(sys.argv[split + 1:])
    # What Engine._launch_subprocesses does before it spawns the schedulers (sglang 0.5.23),
    # without the tokenizer manager and detokenizer: enginelink stands in for both.
    engine.configure_logger(server_args)
    server_args.resolve_once()
    engine._set_envs_and_config(server_args)
    engine.load_plugins()
    server_args.check_server_args()
    engine.resolve_auto_parsers(server_args)
    engine.publish(server_args, role="tokenizer")
    if os.environ.get("SMG_SGLANG_ATTRIBUTE_GRAMMAR_ABORTS", "").strip() not in ("", "0") \
            and not grammar_attribution_loaded():
        print("sglang_headless: enginelink's SGLang plugin is not installed here (tools/setup-sglang-plugin): "
              "a grammar's aborts stay unnamed and answer INTERNAL, not FAILED_PRECONDITION", file=sys.stderr)
    bootstrap_server = start_disagg_service()  # a prefill leg's; None on any other role (held while we run)
    port_args = PortArgs.init_new(server_args)
    # Where attention-DP ranks push (their own PortArgs, derived from --port), before ours replace them.
    derived_outputs = {port_args.tokenizer_ipc_name, port_args.detokenizer_ipc_name}
    port_args.scheduler_input_ipc_name = args.scheduler_input_ipc
    # Outputs go to the detokenizer address (to the tokenizer's under --skip-tokenizer-init): both are ours.
    port_args.tokenizer_ipc_name = args.tokenizer_ipc
    port_args.detokenizer_ipc_name = args.tokenizer_ipc
    if get_parallel().attn_dp_enabled:
        forward_outputs(sorted(a for a in derived_outputs if a.startswith("tcp://")), args.tokenizer_ipc)
    result, procs = engine.Engine._launch_scheduler_processes(server_args, port_args, run_scheduler_process)
    signal.signal(signal.SIGTERM, lambda *_: [proc.terminate() for proc in procs or ()])
    result.wait_for_ready()  # raises when a rank dies before it is ready
    infos = result.scheduler_infos
    report = dict(infos[0]) if infos else {"status": "no scheduler info"}
    report["server_args"] = resolved_server_args(server_args)
    report["supports_vision"] = image_understanding(server_args)
    with os.fdopen(args.ready_fd, "w") as pipe:
        pipe.write(json.dumps(report, default=str) + "\n")
    result.block_until_scheduler_exits()
    del bootstrap_server
    return next((proc.exitcode for proc in procs or () if proc.exitcode), 0)


def forward_outputs(addresses: list[str], ours: str) -> None:
    """Attention DP: bind where the ranks push and relay every message to our output address."""
    import threading

    import zmq

    context = zmq.Context.instance()
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    for address in addresses:
        pull.bind(address)
    push.connect(ours)
    threading.Thread(target=zmq.proxy, args=(pull, push), name="outputs", daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
