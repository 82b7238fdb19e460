"""A journal writer in its own process, for the cross-process store tests.

Usage: ``python writer_proc.py PATH kill N`` appends N records, flushes,
appends N more, flushes, prints the last flushed seq and SIGKILLs itself
(no close, no checkpoint: the WAL and shared-memory files stay as a crash
leaves them). ``python writer_proc.py PATH live`` reads commands from stdin:
``append K`` appends K records, flushes and prints the last flushed seq;
``exit`` closes the journal cleanly.
"""

from __future__ import annotations

import os
import signal
import sys

from enginelink.journal import records as r
from enginelink.journal.journal import Journal


def append_some(journal: Journal, count: int) -> None:
    for i in range(count):
        seq = journal.last_seq + 1
        if i % 2:
            journal.append(float(seq), r.engine_stream(0), r.KIND_ENGINE_FRAME, seq.to_bytes(4, "big") * 8)
        else:
            journal.append(float(seq), r.request_stream(f"q{seq}"), r.KIND_CLIENT_GENERATE, {
                "request_id": f"q{seq}", "n": 1, "prompt_tokens": seq, "stream": False, "max_tokens": 4})
    journal.flush_sync()


def main() -> None:
    path, mode = sys.argv[1], sys.argv[2]
    journal = Journal(path)
    if mode == "kill":
        count = int(sys.argv[3])
        append_some(journal, count)
        append_some(journal, count)
        print(journal.stats().last_flushed_seq, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "append":
            append_some(journal, int(cmd[1]))
            print(journal.stats().last_flushed_seq, flush=True)
        elif cmd[0] == "exit":
            journal.close()
            return


if __name__ == "__main__":
    main()
