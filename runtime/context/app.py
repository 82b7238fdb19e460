"""What every contract's handlers share: the link, the hub, the loads and the engine's facts.

Facts come from two places: the model directory (vocab, EOS ids, architecture,
sampling defaults, tokenizer) and the engine's ready response (context length,
block size, dtype, DP size, scheduler limits). Both are known once the link is
up; before that, handlers that need them answer UNAVAILABLE. Everything here
is contract-neutral (``facts.py``, ``loads.py``): each contract's wing encodes
it into its own messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import trio

from enginelink.journal.records import KIND_ERROR, request_stream
from enginelink.runtime.requests.constraints import DEFAULT_BACKEND
from enginelink.runtime.errors import ClientError, Precondition, ServicerError, Unavailable
from enginelink.runtime.context.loads import Loads
from enginelink.runtime.engine.mm_item_limits import item_limits
from enginelink.runtime.engine.model_dir import ModelFacts
from enginelink.runtime.engine.tokenizer_bundle import tokenizer_bundle_chunks
from enginelink.runtime.requests.pd_bootstrap import PdLeg
from enginelink.runtime.requests.validate import LOGPROBS_MAX, EngineLimits

# The journal stream and id prefix kept for a call refused for its request id.
REFUSED_ID_STREAM = "<refused id>"
REFUSED_ID_CHARS_KEPT = 64


@dataclass
class App:
    link: object  # EngineLink
    hub: object  # RequestHub
    journal: object
    model: ModelFacts
    served_model_name: str
    run_start_wall: float
    run_start_trio: float
    loads: Loads = field(default_factory=Loads)
    # Worker-side media refs (runtime/contracts/shared/media.py); None: media_refs are refused as "processor off".
    media: object = None
    # Generate/Embed calls whose writer has not returned (runtime/requests/writers.py): a drain waits for them.
    open_writers: int = 0
    # Trace continuation (runtime/lifetime/tracing.py); None: off, and Generate pays one test for it.
    tracing: object = None

    # -- time ------------------------------------------------------------------------

    def wall_time(self, now: float) -> float:
        return self.run_start_wall + (now - self.run_start_trio)

    # -- engine facts ----------------------------------------------------------------

    @property
    def ready(self) -> dict:
        return self.link.ready

    @property
    def limits(self) -> EngineLimits:
        ready = self.ready
        if not ready:
            raise Unavailable("engine is starting; retry on another worker or later")
        return EngineLimits(
            max_model_len=int(ready["max_model_len"]),
            vocab_size=self.model.vocab_size,
            eos_token_ids=tuple(self.model.eos_token_ids),
            data_parallel_size=self.link.ranks.size,  # the ranks this servicer fronts: a pin's [0, N)
            # The engine's --max-logprobs (its facts; vLLM's default when it does not say).
            max_logprobs=int(ready.get("max_logprobs", LOGPROBS_MAX)),
            grammar_backend=str(ready.get("structured_outputs_backend") or DEFAULT_BACKEND),
            engine_release=str(ready.get("vllm_version") or ""),
            custom_logit_processors=bool((ready.get("server_args") or {}).get("enable_custom_logit_processor")),
            supports_vision=bool(ready.get("supports_vision", self.model.supports_vision)),
            mm_item_limits=item_limits((ready.get("server_args") or {}).get("limit_mm_data_per_request")),
            pd_leg=PdLeg.of(ready),  # a prefill/decode leg of SGLang or TokenSpeed (their launch facts)
        )

    @property
    def max_num_seqs(self) -> int:
        return int(self.ready.get("max_num_seqs") or 0)

    @property
    def kv_capacity_tokens(self) -> int:
        ready = self.ready
        return int(ready.get("num_gpu_blocks") or 0) * int(ready.get("block_size") or 0)

    def uptime_s(self) -> float:
        return trio.current_time() - self.run_start_trio

    def tokenizer_chunks(self) -> list[tuple[bytes, str]]:
        if not self.model.tokenizer_path:
            raise Precondition("this worker has no tokenizer directory to send")
        return tokenizer_bundle_chunks(self.model.tokenizer_path)

    # -- refusals --------------------------------------------------------------------

    def refused(self, request_id: str, error: ServicerError, now: float) -> None:
        """A Generate refused before admission: journal it (whose fault, what)."""
        code = error.status.name
        self.hub.metrics.refused(error.reason, code)
        stream = request_stream(request_id or "<empty>")
        if isinstance(error, ClientError) and error.field == "request_id":
            # An id refused for itself (too long, reserved, control characters) lands
            # in the journal clipped and apart from every admitted request's stream.
            stream = request_stream(REFUSED_ID_STREAM)
            request_id = request_id[:REFUSED_ID_CHARS_KEPT]
        self.journal.append(
            now,
            stream,
            KIND_ERROR,
            {"whose": error.whose, "code": code, "message": str(error), "id": request_id},
        )
