"""Run SGLang 0.5.23's scheduler ranks against addresses enginelink bound; report ready on an fd.

Run by the SGLang venv's python, by path (enginelink is not importable
there): ``python sglang_headless.py --scheduler-input-ipc A --tokenizer-ipc B
--ready-fd FD -- <sglang server args>``. It does what SGLang's own gRPC
launcher does (``reference/sglang-contract.md`` §5.1) with enginelink in the
TokenizerManager's place: ``PortArgs.init_new``, then the two addresses
replaced by ours (outputs come to the tokenizer address under
``--skip-tokenizer-init``), the ranks spawned with a pipe each, the first
rank's ``{"status": "ready", ...}`` written as one JSON line to FD. It then
waits: a rank exiting ends it with that rank's status; SIGTERM stops the
ranks. Requires a CUDA GPU; not runnable on a CPU-only machine (written from
SGLang's source, verified only up to the release check there).
"""

import argparse
import json
import multiprocessing as mp
import os
import signal
import sys


def main() -> int:
    os.environ.setdefault("SGLANG_USE_PICKLE_IPC", "0")
    parser = argparse.ArgumentParser()
    parser.add_argument("--scheduler-input-ipc", required=True)
    parser.add_argument("--tokenizer-ipc", required=True)
    parser.add_argument("--ready-fd", type=int, required=True)
    args = parser.parse_args(sys.argv[1:sys.argv.index("--")])
    from sglang.srt.managers.scheduler import run_scheduler_process
    from sglang.srt.server_args import PortArgs, prepare_server_args

    server_args = prepare_server_args(sys.argv[sys.argv.index("--") + 1:])
    port_args = PortArgs.init_new(server_args)
    port_args.scheduler_input_ipc_name = args.scheduler_input_ipc
    port_args.tokenizer_ipc_name = args.tokenizer_ipc
    port_args.detokenizer_ipc_name = args.tokenizer_ipc
    mp.set_start_method("spawn", force=True)
    procs, readers = [], []
    ranks_per_pp = server_args.tp_size // max(1, getattr(server_args, "nnodes", 1))
    for pp_rank in range(server_args.pp_size):
        for tp_rank in range(ranks_per_pp):
            reader, writer = mp.Pipe(duplex=False)
            gpu_id = server_args.base_gpu_id + (pp_rank * ranks_per_pp + tp_rank) * server_args.gpu_id_step
            proc = mp.Process(target=run_scheduler_process,
                              args=(server_args, port_args, gpu_id, tp_rank, None, pp_rank, None, writer))
            proc.start()
            procs.append(proc)
            readers.append(reader)
    signal.signal(signal.SIGTERM, lambda *_: [p.terminate() for p in procs])
    infos = []
    for proc, reader in zip(procs, readers):
        while not reader.poll(1.0):
            if not proc.is_alive():
                return proc.exitcode or 1
        infos.append(reader.recv())
    if any(info.get("status") != "ready" for info in infos):
        print(f"sglang_headless: a rank did not come up: {infos}", file=sys.stderr)
        return 1
    with os.fdopen(args.ready_fd, "w") as pipe:
        pipe.write(json.dumps(infos[0], default=str) + "\n")
    while all(proc.is_alive() for proc in procs):
        procs[0].join(1.0)
    for proc in procs:
        proc.terminate()
    return next((proc.exitcode for proc in procs if proc.exitcode), 0)


if __name__ == "__main__":
    sys.exit(main())
