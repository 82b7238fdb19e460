"""A simulation run, drawn from one seed: the engine, the servicer's settings, the traffic and the faults.

Everything a run does comes from here, so a seed names a run exactly. The
draws are plain ``random.Random(seed)`` calls in a fixed order; adding a
draw changes what every later seed means, which is fine (the named
regression tests pin their scenario by seed *and* keep passing because the
bug they caught stays fixed, whatever the scenario became).

Rules: no clock, no hash-ordered iteration; times are seconds of trio's
virtual clock from the run's start.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import msgspec

from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from enginelink.machines.resume import ResumePolicy
from enginelink.machines.warmup import WarmupLevel
from enginelink.runtime.engine.engine_link import Supervision
from enginelink.runtime.engine.memory_link import MemoryEngineOptions
from enginelink.machines.sim_core import SimConfig

VOCAB_SIZE = 4096  # the test model's
EOS_TOKEN_ID = 2  # the test model's <|im_end|>
FIRST_TOKEN = 3  # ids the sim engine samples from start here
# Stop strings: single characters many tokens of the test tokenizer hold, and a few rarer pairs.
STOP_STRINGS = ("e", "t", " ", "(", ".", "_", "in", "re", "):", "self")

FATAL_FAULTS = ("kill", "core_dead", "garbage", "disconnect")
FAULT_KINDS = (*FATAL_FAULTS, "silence", "stray")

# Ways a request can be invalid, each refused with INVALID_ARGUMENT before the engine sees it.
BAD_KINDS = (
    "empty_id", "no_input", "text_input", "token_outside_vocab", "empty_prompt", "prompt_fills_context",
    "max_tokens_zero", "max_tokens_too_big", "temperature_nan", "temperature_negative", "top_p_above_1",
    "min_p_above_1", "n_above_64", "empty_stop_string", "logprobs", "min_tokens_above_max", "bad_logit_bias",
    "bad_json_schema", "empty_regex", "bad_dp_rank", "bad_kv_transfer_params",
)  # fmt: skip
# Further ways, each a variant of a kind above picked by the call's index, so the
# seeded draws (and every named regression seed) stay what they were.
BAD_VARIANTS = {
    "bad_logit_bias": ("bad_logit_bias", "logit_bias_negative_id", "logit_bias_above_100"),
    "bad_json_schema": ("bad_json_schema", "json_schema_not_object", "json_object_false", "blank_grammar"),
    "empty_regex": ("empty_regex", "regex_with_nul", "empty_choice"),
    "max_tokens_too_big": ("max_tokens_too_big", "truncate_beyond_context", "truncate_below_minus_1"),
}


@dataclass
class ClientPlan:
    """One Generate call: when it arrives, what it asks, and how its client behaves."""

    index: int
    at: float
    request_id: str
    stream: bool
    prompt: list[int]
    n: int = 1
    max_tokens: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    temperature: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    bad: str | None = None  # one of BAD_KINDS: the call must be refused
    cancel_after_s: float | None = None  # the client goes away this long after it arrived
    slow_s: float = 0.0  # the client takes each message this late
    duplicate_of: int | None = None  # reuses the id of that earlier client
    retries: int = 0  # sends the same request again, this many times, as soon as the last call ended
    retry_after_s: float = 0.0

    def request(self) -> pb.GenerateRequest:
        sp = pb.SamplingParams(n=self.n, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos)
        if self.max_tokens is not None:
            sp.max_tokens = self.max_tokens
        if self.temperature is not None:
            sp.temperature = self.temperature
        if self.seed is not None:
            sp.seed = self.seed
        sp.stop.extend(self.stop)
        sp.stop_token_ids.extend(self.stop_token_ids)
        request = pb.GenerateRequest(
            request_id=self.request_id,
            tokenized=pb.TokenizedInput(input_ids=self.prompt),
            sampling_params=sp,
            stream=self.stream,
        )
        if self.bad is not None:
            _spoil(request, self.bad)
        return request


def _spoil(request: pb.GenerateRequest, bad: str) -> None:
    sp = request.sampling_params
    match bad:
        case "empty_id":
            request.request_id = ""
        case "no_input":
            request.ClearField("tokenized")
        case "text_input":
            request.text = "hello"
        case "token_outside_vocab":
            request.tokenized.input_ids.append(VOCAB_SIZE + 7)
        case "empty_prompt":
            del request.tokenized.input_ids[:]
        case "prompt_fills_context":
            request.tokenized.input_ids.extend([FIRST_TOKEN] * 4096)
        case "max_tokens_zero":
            sp.max_tokens = 0
        case "max_tokens_too_big":
            sp.max_tokens = 1 << 20
        case "temperature_nan":
            sp.temperature = float("nan")
        case "temperature_negative":
            sp.temperature = -0.5
        case "top_p_above_1":
            sp.top_p = 1.5
        case "min_p_above_1":
            sp.min_p = 2.0
        case "n_above_64":
            sp.n = 65
        case "empty_stop_string":
            sp.stop.append("")
        case "logprobs":
            # A count vLLM's front end refuses: negative, or past --max-logprobs (20).
            if len(request.tokenized.input_ids) % 2:
                sp.logprobs = -2
            else:
                sp.prompt_logprobs = 2**31 - 1
        case "min_tokens_above_max":
            sp.max_tokens = 2
            sp.min_tokens = 3
        case "bad_logit_bias":
            sp.logit_bias[VOCAB_SIZE + 1] = 1.0
        case "logit_bias_negative_id":
            sp.logit_bias[-1] = 1.0
        case "logit_bias_above_100":
            sp.logit_bias[FIRST_TOKEN] = 150.0
        case "bad_json_schema":
            sp.json_schema = "{not json"
        case "json_schema_not_object":
            sp.json_schema = "[1, 2]"
        case "json_object_false":
            sp.json_object = False
        case "blank_grammar":
            sp.grammar = "  \n "
        case "empty_regex":
            sp.regex = ""
        case "regex_with_nul":
            sp.regex = "a\x00b"
        case "empty_choice":
            sp.choice.SetInParent()
        case "truncate_beyond_context":
            sp.truncate_prompt_tokens = 1 << 20
        case "truncate_below_minus_1":
            sp.truncate_prompt_tokens = -2
        case "bad_dp_rank":
            request.data_parallel_rank = 3
        case "bad_kv_transfer_params":
            request.kv_transfer_params_json = "[1, 2]"
        case _:
            raise ValueError(f"unknown bad kind {bad!r}")


@dataclass
class AbortPlan:
    """An Abort RPC at ``at`` for these request ids (known or not)."""

    at: float
    request_ids: list[str]


@dataclass
class FaultPlan:
    at: float
    kind: str  # one of FAULT_KINDS


@dataclass
class Scenario:
    seed: int
    sim: SimConfig
    engine: MemoryEngineOptions
    supervision: Supervision
    warmup_level: WarmupLevel
    warmup_budget_s: float
    drain_s: float
    snapshot_interval_s: float
    horizon_s: float
    sigterm_at: float
    clients: list[ClientPlan] = field(default_factory=list)
    aborts: list[AbortPlan] = field(default_factory=list)
    faults: list[FaultPlan] = field(default_factory=list)
    live_checks_at: list[float] = field(default_factory=list)
    # Engine restarts (docs/resume.md): off in ``scenario``, on in ``resume_scenario``.
    resume: ResumePolicy = field(default_factory=ResumePolicy)

    def summary(self) -> str:
        faults = ", ".join(f"{f.kind}@{f.at:.3f}" for f in self.faults) or "none"
        hang = " hang_startup" if self.engine.hang_startup else ""
        if self.resume.enabled:
            hang += (f", restarts {self.resume.restarts_max} per {self.resume.window_s:g} s, resume timeout "
                     f"{self.resume.resume_timeout_s:g} s" + (f", poison {self.engine.poison_token}"
                     if self.engine.poison_token is not None else "") + (f", starts_ok {self.engine.starts_ok}"
                     if self.engine.starts_ok is not None else ""))
        return (
            f"seed {self.seed}: {len(self.clients)} clients, {len(self.aborts)} aborts, faults {faults}{hang}, "
            f"SIGTERM@{self.sigterm_at:.3f}, warm-up {self.warmup_level}, step {self.sim.step_us:g} us, "
            f"latency {self.engine.latency_s * 1e3:g} ms"
        )


def scenario(seed: int) -> Scenario:
    rng = random.Random(seed)
    max_model_len = rng.choice((64, 128, 256, 512))
    sim = SimConfig(
        vocab_size=VOCAB_SIZE,
        max_model_len=max_model_len,
        eos_token_id=EOS_TOKEN_ID,
        block_size=16,
        num_gpu_blocks=rng.choice((16, 48, 256, 8192)),  # 16 x 16 tokens: longer requests get finish "error"
        max_num_seqs=rng.choice((1, 2, 4, 16, 128)),
        max_num_batched_tokens=rng.choice((32, 128, 2048)),
        prefill_us_per_token=rng.choice((0.0, 10.0, 100.0)),
        step_us=rng.choice((0.0, 200.0, 1000.0, 5000.0)) if rng.random() < 0.9 else 0.0,
        instance_id="sim",
    )
    engine = MemoryEngineOptions(
        startup_delay_s=rng.choice((0.0, 0.01, 0.5, 2.0)),
        latency_s=rng.choice((0.0, 0.0, 0.0005, 0.005)),
        hang_startup=rng.random() < 0.03,
    )
    supervision = Supervision(
        startup_timeout_s=3.0,
        startup_ceiling_s=rng.choice((8.0, 30.0)),
        silence_timeout_s=rng.choice((0.5, 1.0, 3.0)),
        prefill_tokens_per_s=2000.0,
    )
    horizon_s = rng.uniform(1.0, 8.0)
    warmup_level = rng.choice((WarmupLevel.OFF, WarmupLevel.OFF, WarmupLevel.FAST, WarmupLevel.FULL))
    sc = Scenario(
        seed=seed,
        sim=sim,
        engine=engine,
        supervision=supervision,
        warmup_level=warmup_level,
        warmup_budget_s=rng.choice((0.05, 5.0, 300.0)),
        drain_s=rng.choice((0.1, 0.5, 2.0, 5.0)),
        snapshot_interval_s=rng.choice((0.5, 2.0)),
        horizon_s=horizon_s,
        sigterm_at=horizon_s if rng.random() < 0.7 else rng.uniform(0.0, horizon_s),
    )
    for index in range(rng.choice((0, 1, 4, 10, 20, 40))):
        sc.clients.append(_client(rng, index, sc))
    for _ in range(rng.choice((0, 0, 1, 3, 6))):
        # Mostly while the target is likely in flight: shortly after it arrived.
        target = rng.choice(sc.clients) if sc.clients else None
        targets = [target.request_id] if target is not None and target.request_id else []
        at = target.at + rng.choice((0.0, 0.001, 0.02, 0.2)) if target is not None else rng.uniform(0.0, horizon_s)
        if rng.random() < 0.2:
            targets.append(f"unknown-{rng.randrange(100)}")
        sc.aborts.append(AbortPlan(at, targets))
    if rng.random() < 0.5:
        for _ in range(rng.choice((1, 1, 2))):
            at = rng.uniform(0.0, horizon_s) if rng.random() < 0.85 else rng.uniform(0.0, engine.startup_delay_s + 0.01)
            sc.faults.append(FaultPlan(at, rng.choice(FAULT_KINDS)))
    sc.faults.sort(key=lambda f: f.at)
    sc.live_checks_at = sorted(rng.uniform(0.0, horizon_s) for _ in range(3))
    return sc


def _arrival(rng: random.Random, sc: Scenario) -> float:
    """Most calls come once the engine is likely up; some during start-up and after the end."""
    up = sc.engine.startup_delay_s + 0.2
    if rng.random() < 0.2 or up >= sc.horizon_s:
        return rng.uniform(0.0, sc.horizon_s * 1.1)
    return rng.uniform(up, sc.horizon_s)


def _client(rng: random.Random, index: int, sc: Scenario) -> ClientPlan:
    max_model_len = sc.sim.max_model_len
    earlier = [c for c in sc.clients if c.bad is None]
    duplicate_of = rng.choice(earlier).index if earlier and rng.random() < 0.1 else None
    request_id = f"c{index}" if duplicate_of is None else sc.clients[duplicate_of].request_id
    prompt_len = rng.choice((1, 2, 5, 8, 16, 17, 33)) if rng.random() < 0.9 else rng.randrange(1, max_model_len)
    plan = ClientPlan(
        index=index,
        at=_arrival(rng, sc),
        request_id=request_id,
        stream=rng.random() < 0.5,
        prompt=[rng.randrange(FIRST_TOKEN, VOCAB_SIZE) for _ in range(prompt_len)],
        n=rng.choice((1, 1, 1, 1, 2, 3, 4)),
        duplicate_of=duplicate_of,
    )
    room = max_model_len - prompt_len
    if rng.random() < 0.8:
        plan.max_tokens = rng.randrange(1, min(room, 48) + 1)
    limit = room if plan.max_tokens is None else plan.max_tokens
    if rng.random() < 0.15:
        plan.min_tokens = rng.randrange(0, limit + 1)
    plan.ignore_eos = rng.random() < 0.3
    choice = rng.random()
    if choice < 0.3:
        plan.temperature = 0.0
    elif choice < 0.6:
        plan.temperature = 1.0
    if rng.random() < 0.3:
        plan.seed = rng.randrange(1000)
    if rng.random() < 0.15:
        plan.stop = tuple(rng.sample(STOP_STRINGS, rng.choice((1, 2))))
    if rng.random() < 0.1:
        plan.stop_token_ids = tuple(rng.randrange(FIRST_TOKEN, VOCAB_SIZE) for _ in range(rng.choice((1, 50))))
    if rng.random() < 0.1:
        plan.bad = rng.choice(BAD_KINDS)
        variants = BAD_VARIANTS.get(plan.bad, (plan.bad,))
        plan.bad = variants[index % len(variants)]
        plan.request_id = "" if plan.bad == "empty_id" else f"bad{index}"
        plan.duplicate_of = None
    if rng.random() < 0.15:
        plan.cancel_after_s = rng.choice((0.0, 0.001, 0.05, 0.5, 2.0))
    if rng.random() < 0.2:
        plan.slow_s = rng.choice((0.001, 0.05, 0.3, 1.0))
    if rng.random() < 0.15:
        plan.retries = rng.choice((1, 2))
        plan.retry_after_s = rng.choice((0.0, 0.0, 0.001, 0.01))
    return plan


# Engine deaths a resume run draws (each one the link restarts the engine after, budget allowing).
RESUME_FAULTS = ("kill", "kill", "core_dead", "disconnect", "garbage", "silence", "stray")
# A client's prompt starts with this token when it is the poison (it kills the engine it reaches).
POISON_TOKEN = FIRST_TOKEN


def resume_scenario(seed: int) -> Scenario:
    """``scenario(seed)`` with engine restarts on and engine deaths at random points (docs/resume.md).

    A second generator (seeded apart) draws what resuming adds, so a resume
    seed is its plain seed's run plus: the restart budget and resume timeout,
    one to four deaths while the traffic runs, sometimes a poison request (it
    kills every engine it reaches) or an engine that stops coming up after a
    few starts. Traffic is capped at 20 clients: these seeds are many and fast.
    """
    sc = scenario(seed)
    rng = random.Random(f"resume-{seed}")
    sc.clients = [c for c in sc.clients if c.index < 20]
    while len(sc.clients) < 4:  # something to resume
        sc.clients.append(_client(rng, len(sc.clients), sc))
    kept = {c.request_id for c in sc.clients}
    sc.aborts = [a for a in sc.aborts if all(rid in kept or rid.startswith("unknown-") for rid in a.request_ids)]
    sc.resume = ResumePolicy(restarts_max=rng.choice((1, 2, 3, 5)), window_s=rng.choice((2.0, 60.0)),
                             resume_timeout_s=rng.choice((0.3, 5.0, 30.0, 30.0)))
    sc.engine.hang_startup = False  # a start-up that never ends is the plain seeds' business
    # A full warm-up at every restart would hold most seeds in ``restarting``: mostly off or fast.
    sc.warmup_level = rng.choice((WarmupLevel.OFF, WarmupLevel.OFF, WarmupLevel.FAST, sc.warmup_level))
    # Engine steps that take time, so a death finds calls in the middle of their streams.
    sc.sim = msgspec.structs.replace(sc.sim, step_us=rng.choice((1000.0, 2000.0, 5000.0)))
    # SIGTERM mostly once the deaths have played out; sometimes in the middle (a drain while restarting).
    sc.sigterm_at = sc.horizon_s + 1.0 if rng.random() < 0.85 else rng.uniform(0.0, sc.horizon_s)
    up = sc.engine.startup_delay_s + 0.05
    for client in sc.clients:  # longer streams, mostly once the engine is up, so a death finds them running
        if client.at < up + 0.3 and rng.random() < 0.8:
            client.at = up + rng.uniform(0.3, 1.0)
        room = sc.sim.max_model_len - len(client.prompt)
        if client.bad is None and room > 1 and rng.random() < 0.7:
            client.max_tokens = rng.randrange(max(1, client.min_tokens), room + 1)
            client.ignore_eos = client.ignore_eos or rng.random() < 0.6
    valid = [c for c in sc.clients if c.bad is None] or sc.clients

    def death_at() -> float:
        # Mostly just after a call arrived, while it is likely in flight; else anywhere.
        if rng.random() < 0.7:
            return max(up, rng.choice(valid).at + rng.uniform(0.002, 0.12))
        return rng.uniform(up, max(up, sc.horizon_s))

    sc.faults = [FaultPlan(death_at(), rng.choice(RESUME_FAULTS)) for _ in range(rng.choice((1, 1, 2, 3, 4)))]
    sc.faults.sort(key=lambda f: f.at)
    if sc.clients and rng.random() < 0.1:
        poisoned = rng.choice([c for c in sc.clients])
        poisoned.prompt = [POISON_TOKEN, *poisoned.prompt[1:]] if len(poisoned.prompt) > 1 else [POISON_TOKEN]
        sc.engine.poison_token = POISON_TOKEN
        for other in sc.clients:  # only the chosen one carries it
            if other is not poisoned and POISON_TOKEN in other.prompt:
                other.prompt = [t if t != POISON_TOKEN else FIRST_TOKEN + 1 for t in other.prompt]
    if rng.random() < 0.05:
        sc.engine.starts_ok = rng.choice((1, 2))
    return sc
