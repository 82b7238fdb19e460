"""The fold reads the machines' state names from the one vocabulary their tables are built from."""

from __future__ import annotations

from enginelink.journal import fold, states
from enginelink.journal.records import KIND_TRANSITION, Record, link_stream, request_stream
from enginelink.machines.link import LINK_TABLE, LinkEvent, LinkMachine
from enginelink.machines.request import REQUEST_TABLE, RequestEvent, RequestMachine


def test_tables_and_fold_share_the_state_names():
    assert set(LINK_TABLE.states) == {s.value for s in states.LinkState}
    assert set(REQUEST_TABLE.states) == {s.value for s in states.RequestState}
    assert LINK_TABLE.initial == states.LINK_INITIAL and LINK_TABLE.terminal == states.LINK_TERMINAL
    assert REQUEST_TABLE.initial == states.REQUEST_INITIAL
    assert REQUEST_TABLE.terminal == fold.TERMINAL_REQUEST_STATES == states.REQUEST_TERMINAL


def test_fold_of_a_machines_transitions_ends_in_its_state():
    """What a machine journals, the fold reads back as the same state and terminal verdict."""
    link, request = LinkMachine("vllm-0", 0.0), RequestMachine("r1", 0.0)
    made = [(link_stream("vllm-0"), link.handle(LinkEvent.HANDSHAKE_DONE, 1.0))]
    for event in (RequestEvent.FIRST_OUTPUT, RequestEvent.FINISH):
        made.append((request_stream("r1"), request.handle(event, 2.0)))
    records = [Record(seq=i + 1, time=1.0 + i, stream=stream, kind=KIND_TRANSITION, payload=t.payload())
               for i, (stream, t) in enumerate(made)]
    st = fold.fold(records)
    assert st.links["vllm-0"].state == link.state == states.LinkState.WARMING_UP
    assert st.requests["r1"].state == request.state == states.RequestState.FINISHED
    assert st.requests["r1"].state in fold.TERMINAL_REQUEST_STATES
    assert "r1" in st.ended
