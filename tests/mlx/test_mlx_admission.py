"""The MLX engine's admission rule (``tools/mlx_admission.py``): a burst joins mlx-lm's batch at once.

Pure bookkeeping with the clock passed in, so these need no MLX; the real
engine core's side is ``test_mlx_generate.test_a_burst_spread_over_the_wire_...``.
"""

from __future__ import annotations

import pytest

from enginelink.tools.mlx_admission import Admission

MS = 1e-3


def test_a_burst_spread_over_milliseconds_goes_in_together_once_it_stops():
    held = Admission(gap_s=5 * MS, max_s=50 * MS)
    for i, t in enumerate((0.0, 1 * MS, 2.5 * MS, 4 * MS)):
        held.hold(f"r{i}", t)
        assert held.take_due(t, free_slots=8) == []  # still arriving: nobody goes in alone
    assert held.wait_s(6 * MS, free_slots=8) == pytest.approx(3 * MS)  # the gap counts from the LAST arrival
    assert held.take_due(8.5 * MS, free_slots=8) == []
    assert held.take_due(9 * MS, free_slots=8) == ["r0", "r1", "r2", "r3"]
    assert len(held) == 0 and held.wait_s(9 * MS, free_slots=8) is None


def test_a_lone_request_waits_one_gap_and_a_steady_trickle_no_longer_than_the_cap():
    lone = Admission(gap_s=5 * MS, max_s=50 * MS)
    lone.hold("a", 10.0)
    assert lone.wait_s(10.0, free_slots=8) == pytest.approx(5 * MS)
    assert lone.take_due(10.0 + 5 * MS, free_slots=8) == ["a"]

    trickle = Admission(gap_s=5 * MS, max_s=50 * MS)
    t, admitted = 0.0, []
    while not admitted:  # one request every 4 ms never leaves a 5 ms gap
        trickle.hold(len(trickle), t)
        admitted = trickle.take_due(t, free_slots=1000)
        t += 4 * MS
    assert t - 4 * MS == pytest.approx(52 * MS)  # the first check at or past the 50 ms cap
    assert len(admitted) == 14


def test_a_burst_that_fills_the_free_slots_goes_in_at_once():
    held = Admission(gap_s=5 * MS, max_s=50 * MS)
    held.hold("a", 0.0)
    held.hold("b", 0.0)
    assert held.take_due(0.0, free_slots=3) == []
    held.hold("c", 0.0)
    assert held.wait_s(0.0, free_slots=3) == 0.0
    assert held.take_due(0.0, free_slots=3) == ["a", "b", "c"]
    held.hold("d", 1.0)  # a full batch: it waits in mlx-lm's own queue, no need to wait here
    assert held.take_due(1.0, free_slots=0) == ["d"]


def test_max_zero_admits_each_request_as_it_arrives():
    held = Admission(gap_s=5 * MS, max_s=0.0)
    held.hold("a", 0.0)
    assert held.take_due(0.0, free_slots=8) == ["a"]


def test_an_aborted_request_leaves_the_burst_and_the_rest_keep_their_times():
    held = Admission(gap_s=5 * MS, max_s=50 * MS)
    held.hold("a", 0.0)
    held.hold("b", 2 * MS)
    assert held.drop(lambda r: r == "b") == ["b"]
    assert held.drop(lambda r: r == "zzz") == []
    assert held.take_due(6 * MS, free_slots=8) == []  # the burst's last arrival is still b's
    assert held.take_due(7 * MS, free_slots=8) == ["a"]
    held.hold("c", 1.0)
    assert held.drop(lambda r: True) == ["c"] and held.wait_s(1.0, free_slots=8) is None


@pytest.mark.parametrize("gap_s, max_s", [(-1e-3, 0.05), (0.005, -1.0)])
def test_negative_times_are_refused(gap_s, max_s):
    with pytest.raises(ValueError, match="expected >= 0"):
        Admission(gap_s, max_s)


def test_the_summary_names_each_bursts_size_and_what_let_it_in():
    held = Admission(gap_s=5 * MS, max_s=50 * MS)
    for name in "abc":
        held.hold(name, 0.0)
    assert len(held.take_due(0.0, free_slots=3)) == 3  # full
    held.hold("d", 1.0)
    assert held.take_due(1.0 + 5 * MS, free_slots=8) == ["d"]  # gap
    t = 2.0
    while not held.take_due(t, free_slots=1000):  # a trickle: the cap
        held.hold(t, t)
        t += 4 * MS
    assert held.summary() == "bursts 13x1 3x1 1x1 (full 1, gap 1, max 1)"
    assert Admission().summary() == "bursts none"
