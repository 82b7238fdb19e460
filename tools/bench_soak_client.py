"""The soak's client (``enginelink bench --soak``, ``tools/bench_soak.py``): churn, every stream checked.

One process, grpc.aio: ``plan["concurrency"]`` workers each draw a call from a fixed mix (``KINDS``,
seeded), send it, check what came back against the sim engine's deterministic answer
(``machines.sim_core.expected_tokens``) and go again; beside them a connection dropped with calls
open every few seconds, KV-event subscribers that come and go, and one that reads a batch a second.
It reports counts per kind and status, and the first violations, to the soak over a pipe.

Rules: a violation is a stream that is not exactly the start of the engine's answer (lost, doubled
or foreign tokens), a finish that the call's kind does not allow, a bad request not refused with
INVALID_ARGUMENT (UNAVAILABLE is allowed while the servicer restarts), INTERNAL anywhere.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field

STOP_STRINGS = ("e", "a", " t", "o")


def client_main(conn, plan: dict) -> None:
    try:
        import asyncio

        conn.send(("done", asyncio.run(_client(conn, plan))))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


@dataclass
class ClientStats:
    calls: dict = field(default_factory=dict)  # kind -> {code or "OK": n}
    tokens_checked: int = 0
    choices_checked: int = 0
    violations: list = field(default_factory=list)
    violation_count: int = 0
    disconnects: int = 0
    kv_subscriptions: int = 0
    kv_batches: int = 0
    slow_reader_batches: int = 0
    slow_reader_restarts: int = 0

    def count(self, kind: str, code: str) -> None:
        per = self.calls.setdefault(kind, {})
        per[code] = per.get(code, 0) + 1

    def violation(self, text: str) -> None:
        self.violation_count += 1
        if len(self.violations) < 50:
            self.violations.append(text)


# Call kinds and their weights in the mix; "bad" ones must be refused with INVALID_ARGUMENT.
KINDS = {"greedy": 40, "seeded": 10, "n": 8, "stop": 8, "eos": 6, "logprobs": 7, "structured": 5,
         "cancel": 6, "abort": 4, "bad": 6}
BAD = ("empty prompt", "top_p 2", "temperature -1", "over the context")


async def _client(conn, plan: dict) -> dict:
    import asyncio
    import random

    import grpc
    from smg_grpc_proto.generated import common_pb2
    from smg_grpc_proto.generated import vllm_engine_pb2 as pb
    from smg_grpc_proto.generated.vllm_engine_pb2_grpc import VllmEngineStub

    from enginelink.machines.sim_core import expected_tokens

    rng = random.Random(plan["seed"])
    vocab, eos, context = plan["vocab_size"], plan["eos_token_id"], plan["max_context_length"]
    options = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
               ("grpc.max_reconnect_backoff_ms", 1000), ("grpc.use_local_subchannel_pool", 1)]
    channel = grpc.aio.insecure_channel(plan["target"], options=options)
    stub = VllmEngineStub(channel)
    stats = ClientStats()
    # A pool of prompts, so prefixes repeat (the prefix cache and its KV events have work).
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.choice((8, 16, 24, 40)))] for _ in range(64)]
    names = list(KINDS)
    weights = [KINDS[k] for k in names]
    counter = [0]
    conn.send(("ready", None))
    message, stop_at = await asyncio.get_running_loop().run_in_executor(None, conn.recv)
    assert message == "go", message

    def request(kind: str) -> tuple[pb.GenerateRequest, dict]:
        counter[0] += 1
        rid = f"soak-{counter[0]}"
        prompt = rng.choice(prompts)
        max_tokens = rng.randint(8, 48)
        sp = dict(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        seed = None
        if kind in ("seeded", "n"):
            seed = rng.randrange(1 << 30)
            sp.update(temperature=0.8, seed=seed)
        if kind == "n":
            sp["n"] = rng.choice((2, 3))
        elif kind == "stop":
            sp["stop"] = [rng.choice(STOP_STRINGS)]
        elif kind == "eos":
            sp["ignore_eos"] = False
        elif kind == "logprobs":
            sp["logprobs"] = 2
        elif kind == "structured":
            sp["json_object"] = True
        bad = None
        if kind == "bad":
            bad = rng.choice(BAD)
            if bad == "empty prompt":
                prompt = []
            elif bad == "top_p 2":
                sp["top_p"] = 2.0
            elif bad == "temperature -1":
                sp["temperature"] = -1.0
            else:
                sp["max_tokens"] = context
        req = pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=prompt),
                                 sampling_params=pb.SamplingParams(**sp), stream=True)
        return req, {"rid": rid, "prompt": prompt, "seed": seed, "max_tokens": sp["max_tokens"], "n": sp.get("n", 1),
                     "bad": bad}

    def check(kind: str, meta: dict, got: dict[int, list[int]], finish: dict[int, str], code: str) -> None:
        rid = meta["rid"]
        if code == "INTERNAL":
            stats.violation(f"{kind} {rid}: INTERNAL")
        if kind == "bad":
            # UNAVAILABLE: the servicer was restarting (no servicer to refuse it).
            if code not in ("INVALID_ARGUMENT", "UNAVAILABLE"):
                stats.violation(f"bad request ({meta['bad']}) {rid}: {code}, not INVALID_ARGUMENT")
            return
        for index, tokens in got.items():
            if index >= meta["n"]:
                stats.violation(f"{kind} {rid}: choice {index} of n={meta['n']}")
                continue
            seed = None if meta["seed"] is None else meta["seed"] + index
            want = expected_tokens(meta["prompt"], len(tokens), vocab_size=vocab, eos_token_id=eos, seed=seed)
            stats.tokens_checked += len(tokens)
            stats.choices_checked += 1
            if tokens != want:
                at = next(i for i, (a, b) in enumerate(zip(tokens, want)) if a != b)
                stats.violation(f"{kind} {rid} choice {index}: token {at} is {tokens[at]}, the engine's is "
                                f"{want[at]} ({len(tokens)} received)")
        if code != "OK":
            return
        for index in range(meta["n"]):
            reason, tokens = finish.get(index), got.get(index, [])
            if reason is None:
                stats.violation(f"{kind} {rid} choice {index}: OK without a complete")
            elif reason == "length" and len(tokens) != meta["max_tokens"]:
                stats.violation(f"{kind} {rid} choice {index}: length with {len(tokens)} of {meta['max_tokens']} tokens")
            elif kind in ("greedy", "seeded", "n", "logprobs", "structured") and reason != "length":
                stats.violation(f"{kind} {rid} choice {index}: finish {reason!r}, expected length")
            elif kind == "eos" and reason == "stop" and (not tokens or tokens[-1] != eos):
                stats.violation(f"{kind} {rid} choice {index}: stop without the EOS id last")

    async def one(kind: str, the_stub=None) -> str:
        req, meta = request(kind)
        call = (the_stub or stub).Generate(req)
        got: dict[int, list[int]] = {}
        finish: dict[int, str] = {}
        cut_after = rng.randint(1, 6) if kind in ("cancel", "abort") else None
        chunks = 0
        code = "OK"
        try:
            async for response in call:
                which = response.WhichOneof("response")
                if which == "chunk":
                    got.setdefault(response.chunk.index, []).extend(response.chunk.token_ids)
                    chunks += 1
                    if cut_after is not None and chunks == cut_after:
                        cut_after = None
                        if kind == "cancel":
                            call.cancel()
                        else:
                            await stub.Abort(pb.AbortRequest(request_ids=[meta["rid"]]), timeout=10)
                elif which == "complete":
                    finish[response.complete.index] = response.complete.finish_reason
        except asyncio.CancelledError:
            if kind != "cancel":
                raise
            code = "CANCELLED"
        except grpc.aio.AioRpcError as error:
            code = error.code().name
        if kind == "abort" and code == "OK" and any(r != "abort" for r in finish.values()) and \
                all(len(got.get(i, [])) < meta["max_tokens"] for i in finish):
            stats.violation(f"abort {meta['rid']}: ended {finish} before max_tokens without 'abort'")
        check(kind, meta, got, finish, code)
        stats.count(kind, code)
        return code

    async def worker() -> None:
        while time.monotonic() < stop_at:
            kind = rng.choices(names, weights)[0]
            code = await one(kind)
            if code == "UNAVAILABLE":
                await asyncio.sleep(0.2 + rng.random() * 0.3)  # the servicer is restarting: as a router backs off

    async def disconnector() -> None:
        """A connection dropped with calls open, every few seconds."""
        while time.monotonic() < stop_at:
            await asyncio.sleep(3 + rng.random() * 4)
            extra = grpc.aio.insecure_channel(plan["target"], options=options)
            extra_stub = VllmEngineStub(extra)
            tasks = [asyncio.ensure_future(one("greedy", extra_stub)) for _ in range(rng.randint(2, 6))]
            await asyncio.sleep(0.2 + rng.random() * 0.8)
            await extra.close(grace=None)
            await asyncio.gather(*tasks, return_exceptions=True)
            stats.disconnects += 1

    async def kv_comer() -> None:
        """KV subscribers that come and go."""
        while time.monotonic() < stop_at:
            call = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=0))
            stats.kv_subscriptions += 1
            deadline = time.monotonic() + 1 + rng.random() * 6
            try:
                async for _ in call:
                    stats.kv_batches += 1
                    if time.monotonic() > deadline:
                        call.cancel()
                        break
            except (grpc.aio.AioRpcError, asyncio.CancelledError):
                pass
            await asyncio.sleep(rng.random() * 3)

    async def kv_slow() -> None:
        """One subscriber that reads a batch a second for the whole run."""
        while time.monotonic() < stop_at:
            call = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=0))
            try:
                async for _ in call:
                    stats.slow_reader_batches += 1
                    if time.monotonic() > stop_at:
                        call.cancel()
                        break
                    await asyncio.sleep(1.0)
            except (grpc.aio.AioRpcError, asyncio.CancelledError):
                pass
            stats.slow_reader_restarts += 1
            await asyncio.sleep(1.0)

    await asyncio.gather(*(worker() for _ in range(plan["concurrency"])), disconnector(), kv_comer(), kv_slow())
    await channel.close()
    return stats.__dict__
