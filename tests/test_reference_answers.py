"""The offline references' answer reader (``tests/harness.ReferenceAnswers``): a wait that times out loses nothing.

A reference subprocess (vLLM's offline ``LLM``, mlx-lm) can be slower to
start than a wait on a loaded machine; the call that waited fails, and the
next call must still get its own answers, not time out on a line an
abandoned reader took.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.harness import ReferenceAnswers, end_process

pytestmark = pytest.mark.process  # starts processes: not in the fast loop (tests/fast_loop.py)

# Says ready once its stdin says "go", then answers each case after its "hold" lines arrive.
CHILD = r"""
import json, sys
assert sys.stdin.readline().strip() == "go"
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    case = json.loads(line)
    if case.get("id") is not None:
        print(json.dumps({"id": case["id"], "outputs": case["id"] * 2}), flush=True)
"""


@pytest.fixture
def child(tmp_path):
    log = tmp_path / "child.log"
    with open(log, "wb") as stderr:
        process = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=stderr, text=True)
    yield process, ReferenceAnswers(process, "the child", log)
    end_process(process, process.stdin.close)


def test_a_ready_wait_that_timed_out_leaves_the_ready_line_for_the_next_call(child):
    process, answers = child
    with pytest.raises(RuntimeError, match="the child gave no answer within 0.2 s"):
        answers.ask(process.stdin, [{"id": "a"}], ready_timeout_s=0.2, timeout_s=5)
    process.stdin.write("go\n")
    process.stdin.flush()
    # A reader thread left blocked by the first wait would have taken the ready line: this call would time out.
    assert answers.ask(process.stdin, [{"id": "b"}, {"id": "c"}], ready_timeout_s=30, timeout_s=30) == {
        "b": {"id": "b", "outputs": "bb"}, "c": {"id": "c", "outputs": "cc"},
    }


def test_a_reference_that_ended_says_so_at_every_wait(child):
    process, answers = child
    process.stdin.write("stop\n")  # not "go": the child's assert fails, its output ends
    process.stdin.flush()
    for _ in range(2):
        with pytest.raises(RuntimeError, match="the child ended its output"):
            answers.ask(process.stdin, [], ready_timeout_s=30, timeout_s=30)
