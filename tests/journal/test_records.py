"""The record vocabulary: payload encoding is decided by the kind, and checked."""

from __future__ import annotations

import pytest

from enginelink.journal import records as r


def test_dict_payload_round_trips_through_msgpack():
    payload = r.Transition("request", "a", "admitted", "finished", "complete").payload()
    blob = r.encode_payload(r.KIND_TRANSITION, payload)
    assert isinstance(blob, bytes)
    assert r.row_to_record((3, 1.5, "req/a", r.KIND_TRANSITION, blob)) == r.Record(
        3, 1.5, "req/a", r.KIND_TRANSITION, payload
    )


def test_raw_payload_is_kept_as_given():
    frame = b"\x93\x01\x02\x03"
    assert r.encode_payload(r.KIND_ENGINE_FRAME, frame) is frame
    assert r.encode_payload(r.KIND_ENGINE_FRAME, memoryview(frame)) == frame
    assert r.decode_payload(r.KIND_ENGINE_FRAME, frame) is frame


@pytest.mark.parametrize(
    ("kind", "payload", "message"),
    [
        ("no.such.kind", {}, "unknown record kind"),
        (r.KIND_TRANSITION, b"raw", "takes a dict"),
        (r.KIND_ENGINE_FRAME, {"a": 1}, "takes raw bytes"),
    ],
)
def test_payload_outside_the_vocabulary_is_refused(kind, payload, message):
    with pytest.raises(r.PayloadError, match=message):
        r.encode_payload(kind, payload)


def test_raw_kinds_are_kinds():
    assert r.RAW_KINDS <= r.KINDS
