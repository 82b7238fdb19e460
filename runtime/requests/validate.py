"""What every contract's request validator shares: the engine's limits, and the neutral call it builds.

Each gRPC contract's edge validates its own request message into a
``GenerateCall`` (``machines/request_api.py``) against ``EngineLimits``:
vLLM's in ``runtime/contracts/vllm/edge.py``. The rules every edge keeps:

- every refusal is a ``ClientError`` naming the field and what is wrong with
  it (INVALID_ARGUMENT); nothing refused ever reaches the engine;
- defaults follow the smg contract's mapping (reference servicer): unset
  temperature → 1.0, top_p 0 → 1.0, repetition_penalty 0 → 1.0, n 0 → 1,
  unset max_tokens → the rest of the context;
- ``n > 1`` becomes n independent engine requests (``<id>#<index>``; a seed
  becomes ``seed + index`` per choice, as vLLM's parallel sampling does);
- every client string is bounded (``runtime/requests/inputs.py``, ``ENGINELINK_MAX_*``)
  before anything else looks at it. Ids may not take the servicer's
  reserved prefixes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from enginelink.runtime.requests.constraints import DEFAULT_BACKEND
from enginelink.runtime.requests.inputs import InputLimits, input_limits
from enginelink.runtime.requests.pd_bootstrap import NO_PD, PdLeg

# The most parallel samples one call may ask for; each is a full engine request.
N_MAX = 64
# vLLM's default --max-logprobs (the engine's own value comes with its facts).
LOGPROBS_MAX = 20


@dataclass(frozen=True)
class EngineLimits:
    """What validation needs to know about the engine behind the link."""

    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    data_parallel_size: int = 1
    # The engine's --max-logprobs; -1: the whole vocabulary.
    max_logprobs: int = LOGPROBS_MAX
    # The engine's structured-output backend (its --structured-outputs-config), "auto" by default.
    grammar_backend: str = DEFAULT_BACKEND
    # The engine's release (its ready response's vllm_version): whose front-end rules apply.
    engine_release: str = ""
    inputs: InputLimits = field(default_factory=input_limits)
    # SGLang's --enable-custom-logit-processor (its resolved arguments): the scheduler runs them.
    custom_logit_processors: bool = False
    # The model takes images (SGLang: its engine's report; else the model directory's vision tower), and the
    # engine's own per-request media counts (SGLang's --limit-mm-data-per-request): router tensors' bounds.
    supports_vision: bool = False
    mm_item_limits: dict[str, int] = field(default_factory=dict)
    # The engine's PD role (SGLang's and TokenSpeed's --disaggregation-mode; runtime/requests/pd_bootstrap.py).
    pd_leg: PdLeg = NO_PD

