"""An unexpected exception never vanishes (issue 21, item 13): every bug a handler hits is
answered INTERNAL, logged with its traceback once, journaled (``internal_error``) and counted.

Attacked two ways. Through a whole servicer: ``enginelink``'s own ``serve``,
with bugs injected by monkeypatching inside its process (``bug_servicer.py``;
no production hook): in a unary RPC (twice: the second is logged as a
repeat), in Generate before admission, and in Generate after admission (the
call must still end in the journal); then its log, its journal file,
``journal verify`` and ``/metrics`` are read as a user would. And on the
wrapper itself: what is not a bug is not reported, a report that fails still
answers, tracebacks and the table of distinct bugs stay bounded.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import grpc
import pytest
from google.protobuf.message import DecodeError
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from enginelink.journal import records as r
from enginelink.journal.store import open_reader
from enginelink.journal.verify import verify
from enginelink.machines.link import LINK_TABLE
from enginelink.machines.request import REQUEST_TABLE
from enginelink.runtime import errors
from enginelink.runtime.errors import BUG_SITES_MAX, TRACEBACK_CHARS_MAX, ClientError, grpc_errors
from tests.harness import ListJournal, Servicer, free_port, generate_request, scrape, wait_until

INTERNAL = grpc.StatusCode.INTERNAL
BUG_SERVICER = Path(__file__).with_name("bug_servicer.py")


@pytest.mark.process
@pytest.mark.slow
def test_bugs_in_handlers_are_answered_logged_journaled_and_counted(tmp_path, test_model_dir):
    servicer = Servicer(tmp_path, model_dir=test_model_dir)
    metrics_port = free_port()
    servicer.argv = [sys.executable, str(BUG_SERVICER), str(servicer.port), str(metrics_port),
                     str(servicer.journal), str(test_model_dir)]
    with servicer:
        stub = servicer.stub
        seen = []
        for rpc, call in [
            ("model_info", lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)),
            ("model_info", lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)),
            ("take", lambda: list(stub.Generate(generate_request("bug-after-1", [5, 6, 7], max_tokens=4,
                                                                 ignore_eos=True), timeout=10))),
            ("validate_generate", lambda: list(stub.Generate(generate_request("bug-before-1", [5, 6], max_tokens=2),
                                                             timeout=10))),
        ]:
            with pytest.raises(grpc.RpcError) as error:
                call()
            assert error.value.code() == INTERNAL
            assert f"ZeroDivisionError: injected bug in {rpc}" in error.value.details()
            seen.append(error.value)
        # The servicer serves on, and a good call is untouched.
        out = list(stub.Generate(generate_request("fine", [5, 6], max_tokens=3, ignore_eos=True), timeout=10))
        assert out[-1].complete.finish_reason == "length"
        samples = scrape(metrics_port)

        def reports():
            with open_reader(servicer.journal) as reader:
                found = reader.records(kinds=[r.KIND_INTERNAL_ERROR])
            return found if len(found) >= 4 else None

        wait_until(reports, 5, "four internal_error records")
    log = servicer.log()

    # The log: one traceback per distinct bug, a one-line repeat for the second model_info.
    lines = [line for line in log.splitlines() if "enginelink.errors" in line]
    assert len(lines) == 4, log
    assert log.count("Traceback (most recent call last)") == 3, log
    assert "seen 2 times" in lines[1]
    assert "'bug-after-1'" in lines[2] and "'bug-before-1'" in lines[3]

    # The journal: one internal_error per bug, with its traceback; the broken call still ended.
    with open_reader(servicer.journal) as reader:
        records = list(reader.iter_records())
    found = [rec for rec in records if rec.kind == r.KIND_INTERNAL_ERROR]
    assert [(rec.payload["rpc"], rec.payload["request_id"]) for rec in found] == [
        ("GetModelInfo", None), ("GetModelInfo", None), ("Generate", "bug-after-1"), ("Generate", "bug-before-1")]
    for rec, where in zip(found, ["model_info", "model_info", "take", "validate_generate"], strict=True):
        assert rec.payload["type"] == "ZeroDivisionError"
        assert f"injected bug in {where}" in rec.payload["traceback"] and "Traceback" in rec.payload["traceback"]
    report = verify(records, tables={"link": LINK_TABLE, "request": REQUEST_TABLE})
    assert report.ok, report.violations
    assert report.internal_errors == 4
    assert "bug-after-1" not in report.open_at_end  # aborted when its handler gave up

    # The metrics.
    def value(name: str, **labels) -> float:
        want = [f'{k}="{v}"' for k, v in labels.items()]
        return sum(v for k, v in samples.items() if k.startswith(name + "{") and all(w in k for w in want))

    assert value("smg_servicer_internal_errors_total", rpc="GetModelInfo") == 2
    assert value("smg_servicer_internal_errors_total", rpc="Generate") == 2
    assert value("smg_servicer_errors_total", code="INTERNAL") == 2


# -- the wrapper on its own --------------------------------------------------------------


class Counted:
    def __init__(self) -> None:
        self.rpcs: list[str] = []

    def internal_error(self, rpc: str) -> None:
        self.rpcs.append(rpc)


class Service:
    def __init__(self, raise_what) -> None:
        self.journal = ListJournal()
        self.metrics = Counted()
        self.raise_what = raise_what

    @grpc_errors
    async def Call(self, stream):
        raise self.raise_what()


@pytest.mark.parametrize(
    "error, status",
    [
        (lambda: ClientError("field", "bad"), Status.INVALID_ARGUMENT),
        (lambda: GRPCError(Status.NOT_FOUND, "no"), Status.NOT_FOUND),
        (lambda: DecodeError("Error parsing message"), Status.INVALID_ARGUMENT),
    ],
)
async def test_what_is_not_our_bug_is_not_reported(error, status, monkeypatch):
    monkeypatch.setattr(errors, "_bug_sites", {})
    service = Service(error)
    with pytest.raises(GRPCError) as raised:
        await service.Call(None)
    assert raised.value.status is status
    assert service.journal.records == [] and service.metrics.rpcs == [] and errors._bug_sites == {}


async def test_a_deep_bug_is_journaled_with_a_bounded_traceback(monkeypatch):
    monkeypatch.setattr(errors, "_bug_sites", {})

    def recurse(n):
        return recurse(n + 1)

    service = Service(lambda: recurse(0))
    with pytest.raises(GRPCError) as raised:
        await service.Call(None)
    assert raised.value.status is Status.INTERNAL and "RecursionError" in raised.value.message
    [(_, stream, kind, payload)] = service.journal.records
    assert (stream, kind, payload["rpc"], payload["type"]) == ("run", r.KIND_INTERNAL_ERROR, "Call", "RecursionError")
    assert len(payload["traceback"]) <= TRACEBACK_CHARS_MAX and "recurse" in payload["traceback"]
    assert service.metrics.rpcs == ["Call"]


async def test_many_distinct_bugs_keep_the_site_table_bounded_and_are_all_counted(monkeypatch, caplog):
    caplog.set_level(logging.ERROR, logger="enginelink.errors")
    monkeypatch.setattr(errors, "_bug_sites", {})
    service = Service(None)
    for i in range(BUG_SITES_MAX + 50):
        code = compile("def boom():\n    raise KeyError('site %d')\n" % i, f"<bug-site-{i}>", "exec")
        space: dict = {}
        exec(code, space)
        service.raise_what = space["boom"]
        with pytest.raises(GRPCError):
            await service.Call(None)
    assert len(errors._bug_sites) == BUG_SITES_MAX
    assert len(service.journal.records) == len(service.metrics.rpcs) == BUG_SITES_MAX + 50
    tracebacks = [rec for rec in caplog.records if rec.exc_info is not None]
    assert len(tracebacks) == BUG_SITES_MAX  # past the table, one line each


async def test_a_report_that_fails_still_answers_internal(monkeypatch, caplog):
    monkeypatch.setattr(errors, "_bug_sites", {})
    service = Service(lambda: ValueError("the bug"))

    def broken_append(*args):
        raise OSError("journal is gone")

    service.journal.append = broken_append
    with pytest.raises(GRPCError) as raised:
        await service.Call(None)
    assert raised.value.status is Status.INTERNAL and "the bug" in raised.value.message
    assert any("could not report a bug" in rec.getMessage() for rec in caplog.records)


@pytest.mark.parametrize("error", [AssertionError("an invariant of ours"), NotImplementedError("not yet")])
async def test_our_own_assertion_is_a_bug_not_a_truncated_request(error, monkeypatch):
    """grpclib's length assertion is the client's fault; the same exception type from our code is not."""
    monkeypatch.setattr(errors, "_bug_sites", {})

    def fail():
        raise error

    service = Service(fail)
    with pytest.raises(GRPCError) as raised:
        await service.Call(None)
    assert raised.value.status is Status.INTERNAL
    assert service.metrics.rpcs == ["Call"] and len(service.journal.records) == 1
