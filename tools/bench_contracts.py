"""The contract-specific part of a streamed token's cost, per contract, in one process: no sockets, no engine.

``python -m enginelink.tools.bench_contracts [--calls 128] [--steps 200] [--rounds 5]``

Why: on a shared machine ``enginelink bench --wire X`` pairs scatter by tens of
percent (docs/benchmarks-history.md), while what differs between the contracts is a
few known steps per token: the codec's decode of the engine's output frame,
the edge's chunk bytes, the per-output objects. This runs exactly those, the
way the servicer runs them: ``codec.decode_output`` of a step frame as each
wire's engine writes it (``calls`` requests, one token each), then
``RequestHub.on_batch`` with that contract's edge, every call streaming with
an idle writer (the direct path: ``chunk_body`` and a sender that accepts
everything). Frames are built before the clock starts. Reported: process CPU
µs per token, the best of ``rounds`` (arms alternating), and each contract ÷
vLLM. It is not the whole servicer (no HTTP/2, no journal writes, no event
loop): the whole-servicer figure is ``enginelink bench --wire X``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from enginelink.machines.link import LinkEvent, LinkMachine
from enginelink.runtime.contracts.sglang.edge import SGLANG_EDGE
from enginelink.runtime.contracts.tokenspeed.edge import TOKENSPEED_EDGE
from enginelink.runtime.contracts.vllm.edge import VLLM_EDGE
from enginelink.runtime.requests.hub import RequestHub
from enginelink.runtime.requests.validate import EngineLimits
from enginelink.wire import sglang, tokenspeed, vllm

LIMITS = EngineLimits(max_model_len=4096, vocab_size=1 << 16, eos_token_ids=(2,))
PROMPT_TOKENS = 64


class _Journal:
    def append(self, now, stream, kind, payload) -> None:
        pass

    def note_decoded(self, seq, decoded) -> None:
        pass


class _Sender:
    """A stream's direct sender with room for everything (``fastpath.DirectSender``'s interface)."""

    def send(self, messages) -> int:
        return len([message.SerializeToString() for message in messages])  # as DirectSender.send

    def send_body(self, body: bytes) -> bool:
        return True

    def send_bodies(self, bodies) -> int:
        return len(list(bodies))

    def end_ok(self) -> bool:
        return True


def _request(wire: str, request_id: str, max_tokens: int):
    from smg_grpc_proto.generated import sglang_scheduler_pb2, tokenspeed_scheduler_pb2, vllm_engine_pb2

    pb, field = {"vllm": (vllm_engine_pb2, "max_tokens"), "sglang": (sglang_scheduler_pb2, "max_new_tokens"),
                 "tokenspeed": (tokenspeed_scheduler_pb2, "max_new_tokens")}[wire]
    return pb.GenerateRequest(request_id=request_id, tokenized=pb.TokenizedInput(input_ids=[5] * PROMPT_TOKENS),
                              sampling_params=pb.SamplingParams(**{field: max_tokens}), stream=True)


def _frames(wire: str, ids: list[str], step: int) -> list[bytes]:
    """One engine step, every request one new token, as that wire's engine writes it."""
    n, tokens = len(ids), [[1000 + step] for _ in ids]
    if wire == "vllm":
        return vllm.encode_outputs(vllm.EngineCoreOutputs(
            0, [vllm.EngineCoreOutput(rid, t) for rid, t in zip(ids, tokens)], timestamp=1.0))
    if wire == "sglang":
        return sglang.encode_outputs(sglang.token_batch(ids, tokens, [None] * n, prompt_tokens=[PROMPT_TOKENS] * n,
                                                        completion_tokens=[step + 1] * n))
    return tokenspeed.encode_outputs(tokenspeed.BatchTokenIDOutSlim(
        rids=ids, output_ids=tokens, finished_reasons=[""] * n, prompt_tokens=[PROMPT_TOKENS] * n,
        completion_tokens=[step + 1] * n, cached_tokens=[0] * n, output_token_logprobs_val=[[] for _ in ids],
        output_token_logprobs_idx=[[] for _ in ids]))


ARMS = {
    "vllm": (VLLM_EDGE, vllm.VllmCodec),
    "sglang": (SGLANG_EDGE, sglang.SglangCodec),
    "tokenspeed": (TOKENSPEED_EDGE, tokenspeed.TokenSpeedCodec),
}


def measure(wire: str, calls: int, steps: int) -> float:
    """CPU µs per token of ``steps`` frames of ``calls`` streaming calls through ``wire``'s decode and edge."""
    edge, codec_class = ARMS[wire]
    codec = codec_class()
    link = LinkMachine("bench-0", 0.0)
    link.handle(LinkEvent.HANDSHAKE_DONE, 0.0)
    link.handle(LinkEvent.WARMUP_DONE, 0.0)
    hub = RequestHub(link=link, codec=codec, send_frames=lambda frames, rank=0: None, journal=_Journal(), edge=edge)
    ids = []
    for i in range(calls):
        spec = edge.validate(_request(wire, f"bench-contracts-{i}", steps + 1), LIMITS, 0.0)
        call = hub.admit(spec, 0.0, wake=asyncio.Event())
        call.direct = _Sender()
        ids.append(call.choices[0].engine_id)
    frames = [_frames(wire, ids, step) for step in range(steps)]
    start = time.process_time()
    for step, frame in enumerate(frames):
        hub.on_batch(codec.decode_output(frame), 1.0 + step)
    return (time.process_time() - start) / (calls * steps) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m enginelink.tools.bench_contracts",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=128, help="streaming calls, one token each per step (128)")
    parser.add_argument("--steps", type=int, default=200, help="engine steps per round (200)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, the arms alternating; the best counts (5)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    best = {wire: float("inf") for wire in ARMS}
    for _ in range(args.rounds):
        for wire in ARMS:
            best[wire] = min(best[wire], measure(wire, args.calls, args.steps))
    report = {"us_per_token": {w: round(v, 3) for w, v in best.items()},
              "ratio_to_vllm": {w: round(v / best["vllm"], 3) for w, v in best.items()}}
    if args.json:
        print(json.dumps(report))
    else:
        for wire in ARMS:
            us, ratio = report["us_per_token"][wire], report["ratio_to_vllm"][wire]
            print(f"{wire:11s} {us:7.3f} µs/token  ÷ vllm {ratio:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
