"""SGLang 0.5.23's own DP controller places enginelink's requests where enginelink picked (issue 33 item 3).

Under ``--dp-size N`` enginelink sends every request to SGLang's DP
controller with the rank it chose in ``routed_dp_rank``
(``runtime/engine/sglang_link.py``), and a prefill leg's request with its
room (``runtime/requests/pd_bootstrap.py``). This runs SGLang's own
controller code (``dp_controller_peer.py``, in the SGLang venv) on our codec's
bytes: a pinned request reaches its rank under the controller's default
balance and under a prefill leg's ``follow_bootstrap_room``; the residue
enginelink computes for a prefill leg is the rank SGLang's controller itself
picks for the room; a rank the controller does not have is its own refusal;
aborts and control messages reach every rank (so a flush is answered once
per rank: ``control_fan_out``).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from enginelink.runtime.requests.pd_bootstrap import PdLeg, leg_rank
from enginelink.wire.engine import GenerateSpec, SamplingSpec
from enginelink.wire.sglang import SglangCodec
from tests.wire.engine_venvs import side_python_or_skip

pytestmark = [pytest.mark.process, pytest.mark.slow]

PEER = Path(__file__).with_name("dp_controller_peer.py")
CODEC = SglangCodec()
PREFILL = PdLeg(mode="prefill", load_balance_method="follow_bootstrap_room", stand_in_host="2.2.2.2")


def _add(rid: str, rank: int | None, room: int | None = None) -> str:
    bootstrap = None if room is None else {"bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": room}
    spec = GenerateSpec(request_id=rid, prompt_token_ids=[5, 6, 7], sampling=SamplingSpec(max_tokens=4),
                        data_parallel_rank=rank, kv_transfer_params=bootstrap)
    (frame,) = CODEC.encode_add(spec)
    return frame.hex()


@pytest.fixture(scope="module")
def placed(tmp_path_factory):
    python = side_python_or_skip("sglang")
    rooms = (7, 10, 13, 2**31 - 2)
    cases = [
        {"frame": _add("pin1", 1), "method": "round_robin"},
        {"frame": _add("pin0", 0), "method": "round_robin"},
        {"frame": _add("pin5", 5), "method": "round_robin"},
        # A prefill leg: enginelink's residue in routed_dp_rank, then SGLang's own pick for the bare room.
        *({"frame": _add(f"room{room}", leg_rank(PREFILL, {"bootstrap_room": room}, None, 2, "r"), room),
           "method": "follow_bootstrap_room"} for room in rooms),
        *({"frame": _add(f"bare{room}", None, room), "method": "follow_bootstrap_room"} for room in rooms),
        {"frame": CODEC.encode_abort(["pin1"])[0].hex(), "method": "-"},
        {"frame": CODEC.encode_utility(3, "flush_cache", [])[0].hex(), "method": "-"},
    ]
    tmp = tmp_path_factory.mktemp("dpc")
    (tmp / "cases.json").write_text(json.dumps(cases))
    done = subprocess.run([python, str(PEER), str(tmp / "cases.json"), str(tmp / "results.json")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp / "results.json").read_text())
    return results["cases"], rooms, results["names"]


def test_a_pin_reaches_its_rank_and_a_rank_the_controller_lacks_is_its_refusal(placed):
    results, _, _ = placed
    assert results[0] == {"type": "TokenizedGenerateReqInput", "ranks": [1]}
    assert results[1] == {"type": "TokenizedGenerateReqInput", "ranks": [0]}
    assert results[2]["error"] == "ValueError: DP rank 5 is not active."


def test_a_prefill_legs_residue_is_the_rank_sglangs_controller_picks_for_the_room(placed):
    results, rooms, _ = placed
    ours = results[3:3 + len(rooms)]
    sglangs = results[3 + len(rooms):3 + 2 * len(rooms)]
    for room, mine, theirs in zip(rooms, ours, sglangs):
        assert mine["ranks"] == theirs["ranks"] == [room % 2], (room, mine, theirs)


def test_aborts_and_control_messages_reach_every_rank(placed):
    results, _, _ = placed
    assert results[-2] == {"type": "AbortReq", "ranks": [0, 1]}
    assert results[-1] == {"type": "FlushCacheReqInput", "ranks": [0, 1]}


def test_what_the_launch_script_calls_is_this_releases(placed):
    """``sglang_headless.py`` (DP, attention DP, a prefill leg's bootstrap server), name by name."""
    _, _, names = placed
    assert names["launch"] == ["cls", "server_args", "port_args"] or names["launch"][:2] == ["server_args", "port_args"]
    assert names["port_args"] == ["server_args", "dp_rank", "worker_ports"]
    assert names["disagg_service"] == [] and names["attn_dp_enabled"] is True
    assert names["set_up"] == ["configure_logger", "_set_envs_and_config", "load_plugins", "resolve_auto_parsers",
                               "publish"]
