"""The front end's lean decodes of an engine step (SGLang's, TokenSpeed's) read what the full decode reads.

``SglangCodec.decode_output`` decodes a ``BatchTokenIDOutput`` with
``sglang_structs.FROM_SCHEDULER_READ``: the columns it does not read are left
as ``msgspec.Raw`` and the logprob columns decoded only when a request asks
(``wire/sglang.py``, ``_Columns``). Here: the outputs equal those read from the
full decode (``decode_message``) over random steps, logprob rows included; a
malformed token array or count column is still refused; and the read struct
has the declared struct's layout, field for field. TokenSpeed's outputs are
built by ``map`` over the step's columns (``TokenSpeedCodec.decode_output``):
a column shorter than ``rids`` is refused rather than cut short; its two
logprob columns are left Raw until a request reads them, so a short one
fails that read, not the step.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings, strategies as st

from enginelink.wire import sglang as g
from enginelink.wire import sglang_structs as s
from enginelink.wire import tokenspeed as ts
from enginelink.wire.engine import WireError

reasons = st.sampled_from([None, g.finish_stop(2), g.finish_stop("\n"), g.finish_length(8),
                           g.finish_abort("gone", 503, "ServiceUnavailable")])


@st.composite
def steps(draw):
    n = draw(st.integers(0, 12))
    tokens = [draw(st.lists(st.integers(0, (1 << 31) - 1), max_size=5)) for _ in range(n)]
    counts = st.lists(st.integers(0, 1 << 20), min_size=n, max_size=n)
    columns = {}
    if draw(st.booleans()):  # logprobs for every request: own token, then top-2
        columns = dict(
            output_token_logprobs_val=[[-0.5] * len(t) for t in tokens], output_token_logprobs_idx=tokens,
            output_top_logprobs_val=[[[-0.5, -0.9]] * len(t) for t in tokens],
            output_top_logprobs_idx=[[[x, 1] for x in t] for t in tokens],
        )
    if draw(st.booleans()):
        columns.update(spec_verify_ct=draw(counts), spec_num_correct_drafts=draw(counts))
    return g.token_batch([f"r{i}" for i in range(n)], tokens, [draw(reasons) for _ in range(n)],
                         prompt_tokens=draw(counts), completion_tokens=draw(counts), cached_tokens=draw(counts),
                         **columns)


def full_read(frames) -> list[tuple]:
    """What the outputs carry, read from every column decoded (the full struct)."""
    batch = g.decode_message(frames)
    n = len(batch.rids)
    out = []
    for i in range(n):
        finish, stop, abort = g._finish(batch.finished_reasons[i])
        out.append((batch.rids[i], list(batch.output_ids[i]), finish, stop, abort, batch.prompt_tokens[i],
                    batch.completion_tokens[i], batch.cached_tokens[i],
                    (batch.spec_num_correct_drafts or [0] * n)[i], (batch.spec_verify_ct or [0] * n)[i],
                    batch.output_token_logprobs_idx[i] or None))
    return out


@settings(max_examples=150, deadline=None)
@given(step=steps())
def test_the_lean_decode_reads_what_the_full_decode_reads(step):
    frames = g.encode_outputs(step)
    outputs = g.SglangCodec().decode_output(frames).outputs
    lean = []
    for o in outputs:
        sample, _ = g.SglangCodec.logprobs(o, frames)
        lean.append((o.request_id, o.new_token_ids, o.finish_reason, o.stop_reason, o.abort, o.prompt_tokens,
                     o.completion_tokens, o.cached_tokens, o.spec_accepted_tokens, o.spec_draft_tokens,
                     None if sample is None else list(sample.token_ids)[:: sample.cols]))
    assert lean == full_read(frames)


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(st.integers(-(1 << 63), (1 << 63) - 1), max_size=40),
       odd=st.one_of(st.none(), st.tuples(st.integers(0, 39), st.sampled_from(["l", "i", "Q"]))))
def test_a_step_of_one_token_each_reads_as_the_arrays_say(tokens, odd):
    """The common step's one-unpack read (``token_lists``): each entry's own token, and an entry of another
    typecode (same payload size or not) read as ``ext_hook`` reads it rather than as a "q"."""
    column = [s.pack_array([t]) for t in tokens]
    if odd is not None and tokens:
        at, typecode = odd
        at %= len(tokens)
        value = abs(tokens[at]) % (1 << 31)
        column[at] = s.pack_array([value], typecode)
    assert s.token_lists(column) == [s.ext_hook(e.code, memoryview(e.data)).tolist() for e in column]


def test_a_malformed_token_array_or_count_column_is_still_refused():
    step = g.token_batch(["a"], [[5]], [None], prompt_tokens=[3], completion_tokens=[1])
    seven_bytes = msgspec.msgpack.Ext(s.EXT_ARRAY, b"\x00\x00\x00\x02\xa1q" + b"\x00" * 7)  # not a whole int64
    bad_array = msgspec.structs.replace(step, output_ids=[seven_bytes])
    with pytest.raises(WireError, match="undecodable"):
        g.SglangCodec().decode_output(g.encode_outputs(bad_array))
    bad_counts = msgspec.structs.replace(step, completion_tokens=["one"])
    with pytest.raises(WireError, match="undecodable"):
        g.SglangCodec().decode_output(g.encode_outputs(bad_counts))


def test_a_malformed_logprob_column_fails_when_it_is_read():
    step = g.token_batch(["a"], [[5]], [None], prompt_tokens=[3], completion_tokens=[1],
                         output_token_logprobs_val=[[-0.5]], output_token_logprobs_idx=[["five"]])
    frames = g.encode_outputs(step)
    (output,) = g.SglangCodec().decode_output(frames).outputs
    assert output.new_token_ids == [5]  # the tokens are read; the bad column only when logprobs are
    with pytest.raises(WireError, match="logprobs of 'a' are not numbers"):
        g.SglangCodec.logprobs(output, frames)
    short = msgspec.structs.replace(step, output_token_logprobs_idx=[[]])
    (output,) = g.SglangCodec().decode_output(g.encode_outputs(short)).outputs
    with pytest.raises(WireError, match="values and ids disagree"):
        g.SglangCodec.logprobs(output, ())


def test_the_read_struct_has_the_declared_layout():
    declared = msgspec.structs.fields(s.BatchTokenIDOutput)
    read = msgspec.structs.fields(s.BatchTokenIDOutputRead)
    assert [(f.name, f.required, f.default) for f in read] == [(f.name, f.required, f.default) for f in declared]
    assert s.BatchTokenIDOutputRead.__struct_config__.tag == "BatchTokenIDOutput"
    assert {f.name for f in read if f.type is not msgspec.Raw} == set(s.READ_COLUMNS)


def _slim(**columns) -> ts.BatchTokenIDOutSlim:
    fields = dict(rids=["a", "b"], output_ids=[[5], [6, 7]], finished_reasons=["", "stop"], prompt_tokens=[3, 4],
                  completion_tokens=[1, 2], cached_tokens=[0, 2], output_token_logprobs_val=[[], []],
                  output_token_logprobs_idx=[[], []])
    fields.update(columns)
    return ts.BatchTokenIDOutSlim(**fields)


def test_tokenspeed_outputs_carry_each_request_s_columns_and_trim_a_matched_stop():
    a, b = ts.TokenSpeedCodec().decode_output(ts.encode_outputs(_slim())).outputs
    assert (a.request_id, a.new_token_ids, a.finish_reason, a.stop_reason) == ("a", [5], None, None)
    assert (a.prompt_tokens, a.completion_tokens, a.cached_tokens) == (3, 1, 0)
    assert (b.new_token_ids, b.stop_reason, b.completion_tokens, b.cached_tokens) == ([6], 7, 2, 2)


@pytest.mark.parametrize("column", ["output_ids", "finished_reasons", "prompt_tokens", "completion_tokens",
                                    "cached_tokens"])
def test_a_tokenspeed_column_shorter_than_its_rids_is_refused(column):
    short = _slim()
    setattr(short, column, getattr(short, column)[:1])
    with pytest.raises(WireError, match="2 rids"):
        ts.TokenSpeedCodec().decode_output(ts.encode_outputs(short))


def test_a_tokenspeed_finish_reason_it_does_not_know_is_refused():
    with pytest.raises(WireError, match="finish reason 'done' for 'b'"):
        ts.TokenSpeedCodec().decode_output(ts.encode_outputs(_slim(finished_reasons=["", "done"])))


@pytest.mark.parametrize("column", ["output_token_logprobs_val", "output_token_logprobs_idx"])
def test_a_short_tokenspeed_logprob_column_fails_only_the_reads_of_logprobs(column):
    """The logprob columns are read lazily: the step's tokens still go out, a read of its logprobs fails
    (the request core then fails that call alone, ``RequestCore._logprobs``)."""
    short = _slim(output_token_logprobs_val=[[-0.5], [-0.25]], output_token_logprobs_idx=[[5], [6]])
    setattr(short, column, getattr(short, column)[:1])
    a, b = ts.TokenSpeedCodec().decode_output(ts.encode_outputs(short)).outputs
    assert (a.new_token_ids, b.new_token_ids) == ([5], [6])
    with pytest.raises(WireError, match=f"2 rids but 1 {column}"):
        ts.TokenSpeedCodec.logprobs(a, [])


def test_tokenspeed_logprobs_are_read_from_the_step_and_trimmed_with_a_stop():
    step = _slim(output_token_logprobs_val=[[-0.5], [-0.25, -0.75]], output_token_logprobs_idx=[[5], [6, 7]])
    a, b = ts.TokenSpeedCodec().decode_output(ts.encode_outputs(step)).outputs
    rows_a, _ = ts.TokenSpeedCodec.logprobs(a, [])
    rows_b, _ = ts.TokenSpeedCodec.logprobs(b, [])
    assert (list(rows_a.token_ids), list(rows_a.logprobs)) == ([5], [-0.5])
    assert (list(rows_b.token_ids), list(rows_b.logprobs)) == ([6], [-0.25])  # the stop token 7 trimmed, with its logprob
    none = ts.TokenSpeedCodec().decode_output(ts.encode_outputs(_slim())).outputs[0]
    assert ts.TokenSpeedCodec.logprobs(none, []) == (None, None)


def test_the_tokenspeed_read_struct_has_the_declared_layout():
    declared = msgspec.structs.fields(ts.BatchTokenIDOutSlim)
    read = msgspec.structs.fields(ts.BatchTokenIDOutSlimRead)
    assert [(f.name, f.required, f.default) for f in read] == [(f.name, f.required, f.default) for f in declared]
    config = ts.BatchTokenIDOutSlimRead.__struct_config__
    assert (config.tag, config.tag_field, config.array_like) == ("BatchTokenIDOutSlim", ts.TAG_FIELD, True)
    assert {f.name for f in read if f.type is msgspec.Raw} == {"output_token_logprobs_val", "output_token_logprobs_idx"}
