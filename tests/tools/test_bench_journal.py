"""``enginelink bench-journal``: a tiny run, checked for its shape (never for speed)."""

from __future__ import annotations

import json

import pytest

from enginelink.tools.cli import main


def test_bench_journal_times_each_case_once(capsys):
    assert main(["bench-journal", "--appends", "500", "--json"]) == 0
    results = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [result["case"] for result in results] == ["transition", "engine.frame 200 B"]
    assert all(result["appends"] == 500 and result["us_per_append"] > 0 for result in results)


def test_bench_journal_refuses_zero_appends():
    with pytest.raises(SystemExit, match="--appends must be at least 1"):
        main(["bench-journal", "--appends", "0"])
