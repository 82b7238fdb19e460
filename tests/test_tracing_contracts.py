"""``enginelink serve --otlp-traces-endpoint``: every contract's Generate continues its caller's trace.

The real servicer process on the sim engine, one per wire (vLLM's, SGLang's,
TokenSpeed's contracts; MLX's shares vLLM's wire and is in
``tests/test_tracing.py``), exporting to an OTLP receiver this test starts;
a grpcio client of the contract's own stubs sends a W3C ``traceparent``.
Also: what ``/metrics`` says of the export, a refused configuration, and a
collector that is not there (serving goes on; the exit is not held).
"""

from __future__ import annotations

import subprocess
import time

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2, sglang_scheduler_pb2_grpc
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2, tokenspeed_scheduler_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from enginelink.journal.records import KIND_RUN_STOP, KIND_TRANSITION
from enginelink.journal.store import open_reader
from enginelink.runtime.lifetime.tracing import CLOSE_S
from tests.harness import VENV_BIN, Servicer, free_port, generate_request, scrape
from tests.otlp_receiver import OtlpReceiver

pytestmark = pytest.mark.process  # every test starts a servicer

PROMPT = [318, 283, 1552, 10, 90, 305]
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100"}


def _vllm(channel, request_id):
    return vllm_engine_pb2_grpc.VllmEngineStub(channel), generate_request(request_id, PROMPT, stream=True,
                                                                          max_tokens=6, ignore_eos=True)


def _sglang(channel, request_id):
    pb = sglang_scheduler_pb2
    return sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel), pb.GenerateRequest(
        request_id=request_id, tokenized=pb.TokenizedInput(input_ids=PROMPT), stream=True,
        sampling_params=pb.SamplingParams(max_new_tokens=6, ignore_eos=True))


def _tokenspeed(channel, request_id):
    pb = tokenspeed_scheduler_pb2
    return tokenspeed_scheduler_pb2_grpc.TokenSpeedSchedulerStub(channel), pb.GenerateRequest(
        request_id=request_id, tokenized=pb.TokenizedInput(input_ids=PROMPT), stream=True,
        sampling_params=pb.SamplingParams(max_new_tokens=6, ignore_eos=True))


CONTRACTS = {
    "vllm": ("vllm.grpc.engine.VllmEngine", _vllm),
    "sglang": ("sglang.grpc.scheduler.SglangScheduler", _sglang),
    "tokenspeed": ("tokenspeed.grpc.scheduler.TokenSpeedScheduler", _tokenspeed),
}


@pytest.mark.parametrize("wire", list(CONTRACTS))
def test_each_contracts_generate_continues_the_callers_trace(tmp_path, test_model_dir, wire):
    service, make = CONTRACTS[wire]
    metrics_port = free_port()
    with OtlpReceiver() as receiver:
        servicer = Servicer(tmp_path, model_dir=test_model_dir, health_service=service,
                            extra=["--wire", wire, "--otlp-traces-endpoint", receiver.endpoint,
                                   "--metrics-port", str(metrics_port)],
                            env={**FAST_EXPORT, "ENGINELINK_WARMUP": "fast"})
        with servicer:
            stub, request = make(servicer.channel, f"{wire}-traced")
            replies = list(stub.Generate(request, metadata=[("traceparent", TRACEPARENT)], timeout=30))
            assert replies[-1].WhichOneof("response") == "complete"
            span = receiver.wait_for(lambda s: s.attributes.get("gen_ai.request.id") == f"{wire}-traced", 10)
            samples = scrape(metrics_port)
        spans = receiver.received()
    assert (span.trace_id, span.parent_span_id, span.name) == (TRACE_ID, PARENT_ID, "llm_request")
    assert span.service == "enginelink" and span.attributes["rpc.service"] == service
    assert span.attributes["gen_ai.usage.completion_tokens"] == 6
    names = [name for name, _, _ in span.events]
    assert names[:2] == ["admitted", "engine.queued"] and names[-1] == "finished", names
    assert "first_token" in names
    assert sum(int(entry.split(":")[1]) for entry in span.attributes["enginelink.chunk.list"].split()) == 6
    # The warm-up's own calls are not traced (no client, no span): only the client's call was exported.
    assert [s.attributes.get("gen_ai.request.id") for s in spans] == [f"{wire}-traced"]
    labels = f'{{model="{test_model_dir.name}",rank="0"}}'
    assert samples[f"smg_servicer_trace_spans{labels}"] == 1
    assert samples[f"smg_servicer_trace_spans_dropped{labels}"] == 0
    assert samples[f"smg_servicer_trace_queue_max{labels}"] == 2048
    assert samples[f"smg_servicer_trace_chunks_max{labels}"] == 256


def test_tracing_is_off_unless_asked_and_a_protocol_it_cannot_speak_is_refused(tmp_path, test_model_dir):
    off = Servicer(tmp_path, model_dir=test_model_dir, extra=["--metrics-port", str(free_port())])
    with off:
        assert not any(name.startswith("smg_servicer_trace_") for name in scrape(int(off.argv[-1])))
    refused = subprocess.run(
        [str(VENV_BIN / "enginelink"), "serve", "--model", str(test_model_dir), "--port", str(free_port()),
         "--otlp-traces-endpoint", "http://127.0.0.1:4318"],
        env={**Servicer(tmp_path, model_dir=test_model_dir).env, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"},
        capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2
    assert "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='http/protobuf': enginelink exports traces over OTLP/gRPC only" \
        in refused.stderr


def test_a_collector_that_is_not_there_costs_no_answer_and_no_more_than_the_close_bound(tmp_path, test_model_dir):
    nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    servicer = Servicer(tmp_path, model_dir=test_model_dir, extra=["--otlp-traces-endpoint", nowhere],
                        env={**FAST_EXPORT, "ENGINELINK_WARMUP": "fast"})
    with servicer:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(servicer.channel)
        for index in range(5):
            replies = list(stub.Generate(generate_request(f"lost-{index}", PROMPT, max_tokens=4, ignore_eos=True),
                                         metadata=[("traceparent", TRACEPARENT)], timeout=30))
            assert replies[-1].complete.finish_reason == "length"
        started = time.monotonic()
        assert servicer.stop() == 0
        took = time.monotonic() - started
    assert "trace export: the collector at" in servicer.log()  # said once, at exit
    # By the servicer's own clock, from its link's stop (the drain, nothing in flight: at once; the engine's
    # stop) to run.stop: the front's close, then at most CLOSE_S for the spans. Without the bound the SDK's
    # shutdown waits its own 30 s. (Timed from outside, the whole stop once took 15.2 s on a box whose two
    # cores the suite's engines kept busy: that clock measures the box, this one the servicer.)
    with open_reader(servicer.journal) as reader:
        records = reader.records(kinds=[KIND_TRANSITION, KIND_RUN_STOP])
    [link_stopped] = [r.time for r in records if r.kind == KIND_TRANSITION
                      and r.payload["machine"] == "link" and r.payload["dest"] == "stopped"]
    [run_stop] = [r.time for r in records if r.kind == KIND_RUN_STOP]
    assert run_stop - link_stopped < CLOSE_S + 3, run_stop - link_stopped
    assert took < 30, took
