"""Run SGLang 0.5.23's scheduler ranks against addresses enginelink bound; report ready on an fd.

Run by the SGLang venv's python, by path (enginelink is not importable
there): ``python sglang_headless.py --scheduler-input-ipc A --tokenizer-ipc B
--ready-fd FD -- <sglang server args>``. It does what SGLang's own gRPC
launcher does (``reference/sglang-contract.md`` §5.1) with enginelink in the
TokenizerManager's place: SGLang's own set-up steps of
``Engine._launch_subprocesses``, ``PortArgs.init_new`` with the two addresses
replaced by ours (outputs come to the tokenizer address under
``--skip-tokenizer-init``), the ranks spawned by SGLang's own
``Engine._launch_scheduler_processes`` (TP x PP on this node), the first
rank's ``{"status": "ready", ...}`` written as one JSON line to FD. It then
blocks until the schedulers exit; SIGTERM stops them. Requires a CUDA GPU; not runnable on a CPU-only machine (written from
SGLang's source, verified only up to the release check there).
"""

import argparse
import json
import os
import signal
import sys


def main() -> int:
    os.environ.setdefault("SGLANG_USE_PICKLE_IPC", "0")
    split = sys.argv.index("--")
    parser = argparse.ArgumentParser()
    parser.add_argument("--scheduler-input-ipc", required=True)
    parser.add_argument("--tokenizer-ipc", required=True)
    parser.add_argument("--ready-fd", type=int, required=True)
    args = parser.parse_args(sys.argv[1:split])
    import sglang.srt.entrypoints.engine as engine
    from sglang.srt.managers.scheduler import run_scheduler_process
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
    port_args = PortArgs.init_new(server_args)
    port_args.scheduler_input_ipc_name = args.scheduler_input_ipc
    # Under --skip-tokenizer-init the scheduler pushes its outputs to the tokenizer address.
    port_args.tokenizer_ipc_name = args.tokenizer_ipc
    port_args.detokenizer_ipc_name = args.tokenizer_ipc
    result, procs = engine.Engine._launch_scheduler_processes(server_args, port_args, run_scheduler_process)
    signal.signal(signal.SIGTERM, lambda *_: [proc.terminate() for proc in procs or ()])
    result.wait_for_ready()  # raises when a rank dies before it is ready
    infos = result.scheduler_infos
    with os.fdopen(args.ready_fd, "w") as pipe:
        pipe.write(json.dumps(infos[0] if infos else {"status": "no scheduler info"}, default=str) + "\n")
    result.block_until_scheduler_exits()
    return next((proc.exitcode for proc in procs or () if proc.exitcode), 0)


if __name__ == "__main__":
    sys.exit(main())
