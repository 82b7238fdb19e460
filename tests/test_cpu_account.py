"""``-p tests.cpu_account --cpu-log DIR``: each test's CPU, its own and its reaped children's (tests/cpu_account.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

BUSY_CHILD = '''
import subprocess, sys
def test_a_busy_child():
    subprocess.run([sys.executable, "-c", "import time\\nend = time.process_time() + 0.5\\nwhile time.process_time() < end: pass"], check=True)
def test_idle():
    pass
'''


@pytest.mark.process
def test_each_test_gets_a_row_with_the_cpu_of_what_it_reaped(tmp_path):
    (tmp_path / "test_target.py").write_text(BUSY_CHILD)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-p",
                           "tests.cpu_account", f"--cpu-log={tmp_path / 'log'}", "-q", str(tmp_path / "test_target.py")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = {row["id"].rsplit("::", 1)[1]: row
            for row in map(json.loads, (tmp_path / "log" / "main.jsonl").read_text().splitlines())}
    assert set(rows) == {"test_a_busy_child", "test_idle"}
    busy, idle = rows["test_a_busy_child"], rows["test_idle"]
    assert busy["reaped_cpu_s"] >= 0.45 and busy["wall_s"] >= busy["reaped_cpu_s"] * 0.9, busy
    assert idle["reaped_cpu_s"] == 0 and idle["cpu_s"] < 0.2, idle
    assert idle["began"] >= busy["began"]
