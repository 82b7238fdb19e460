"""Every ``SMG_*`` and ``ENGINELINK_*`` environment variable either project defines, in one registry.

A deployment that moves from the reference servicer (smg-grpc-servicer
0.14.1) to enginelink keeps its environment, so each of the reference's
names is accounted for here, with what enginelink does with it:

- ``honoured``: read with the reference's meaning (``setting`` says which
  of enginelink's knobs it sets, ``contracts`` which served contract reads it);
- ``inapplicable``: it cannot apply (the reference's Rust-only machinery, or a
  design with no such knob); set, it gets one WARNING line at start-up
  naming it and ``why``;
- ``router``: read by the router (smg), not by a servicer: listed, never warned;
- ``selection``: picks the servicer implementation in the engine launchers
  (``docs/launchers.md``); ``enginelink serve`` itself ignores it;
- ``tooling``: enginelink's development and test switches.

Engine-specific names (``SMG_<ENGINE>_SERVICER_*``) apply to the contract
they are named for; served another, they are named in a WARNING as not read.

A variable with either prefix that no version of either project defines is a
typo until shown otherwise: it gets a WARNING with the closest known name
(difflib), as the command line's unknown flags do (``tools/cli.py``).

Precedence, one rule for every setting (``names``): the flag (where one
exists), then ``ENGINELINK_*`` (enginelink's own spelling: set only for
enginelink, so the deliberate choice), then the served contract's own
reference name, then ``SMG_VLLM_SERVICER_*`` (the spelling enginelink read
for every engine before the engine-specific names were honoured), then the
default. ``tools/ref_settings.py`` resolves them and logs which decided;
``docs/compatibility.md`` is generated from this module (``tools/compat_table.py``).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from enginelink.tools.ref_flags import MM_FLAGS

HONOURED = "honoured"
INAPPLICABLE = "inapplicable"
ROUTER = "router"
SELECTION = "selection"
TOOLING = "tooling"

CONTRACTS = ("vllm", "sglang", "tokenspeed", "mlx")
# The reference's engine word in its names, by contract.
ENGINE_WORD = {"vllm": "VLLM", "sglang": "SGLANG", "tokenspeed": "TOKENSPEED"}
CONTRACT_TITLE = {"vllm": "VllmEngine", "sglang": "SglangScheduler", "tokenspeed": "TokenSpeedScheduler",
                  "mlx": "MlxEngine"}


@dataclass(frozen=True)
class Knob:
    name: str
    status: str
    meaning: str  # what the name means where it is defined (the reference's meaning for its names)
    behaviour: str  # what enginelink does with it
    test: str = ""  # the test that checks the behaviour (path::test_name)
    origin: str = "reference"  # "reference" (smg-grpc-servicer 0.14.1 source or README) or "enginelink"
    contracts: tuple[str, ...] = CONTRACTS  # the served contracts that read it
    setting: str = ""  # enginelink's setting it sets (``names``)
    why: str = ""  # inapplicable: the warning's reason
    unless_engine: tuple[str, ...] = ()  # engines under which an honoured name cannot apply (``engine_why``)
    engine_why: str = ""


# --- the reference's per-engine launcher knobs (its rust.py, warmup.py, __init__.py per engine) ----------------

_SUPERVISION = {  # suffix -> (setting, meaning)
    "DRAIN_SECS": ("drain_s", "seconds in-flight requests get on SIGTERM before they are aborted (5)"),
    "STARTUP_TIMEOUT_SECS": ("startup_timeout_s", "engine start-up silence bound, extended while it lives (1800)"),
    "STARTUP_CEILING_SECS": ("startup_ceiling_s", "engine start-up ceiling; 0 lifts it (14400)"),
    "SILENCE_TIMEOUT_SECS": ("silence_timeout_s", "a connected engine's silence bound with work in flight (300)"),
    "PREFILL_TOKENS_PER_SEC": ("prefill_tokens_per_s", "prefill rate that extends the silence bound (2000)"),
}
_OWN_NAME = {  # setting -> enginelink's own variable
    "drain_s": "ENGINELINK_DRAIN_SECS",
    "startup_timeout_s": "ENGINELINK_STARTUP_TIMEOUT_SECS",
    "startup_ceiling_s": "ENGINELINK_STARTUP_CEILING_SECS",
    "silence_timeout_s": "ENGINELINK_SILENCE_TIMEOUT_SECS",
    "prefill_tokens_per_s": "ENGINELINK_PREFILL_TOKENS_PER_SEC",
    "warmup": "ENGINELINK_WARMUP",
    "kv_events": "ENGINELINK_KV_EVENTS",
}
_ENGINE_TEST = "tests/test_ref_settings.py::test_each_contract_reads_its_own_reference_names"


def _engine_knobs(contract: str) -> list[Knob]:
    word = ENGINE_WORD[contract]
    only = (contract,)
    knobs = [Knob(f"SMG_{word}_SERVICER_{suffix}", HONOURED, meaning,
                  f"`{_OWN_NAME[setting]}`'s setting for {CONTRACT_TITLE[contract]}"
                  + (" (and, after the engine's own name, for every engine)" if contract == "vllm" else ""),
                  _ENGINE_TEST, contracts=CONTRACTS if contract == "vllm" else only, setting=setting)
             for suffix, (setting, meaning) in _SUPERVISION.items()]
    knobs.append(Knob(f"SMG_{word}_SERVICER_WARMUP", HONOURED,
                      "planned warm-up: full, fast, off, a budget in seconds, or <level>:<seconds>",
                      "the warm-up setting (`ENGINELINK_WARMUP` wins); a bad value exits 2", _ENGINE_TEST,
                      contracts=CONTRACTS if contract == "vllm" else only, setting="warmup"))
    knobs.append(Knob(f"SMG_{word}_SERVICER_KV_EVENTS", HONOURED,
                      "0/off leaves the engine's KV-event publisher off when no --kv-events-config is given",
                      "the KV-event relay's on/off (`ENGINELINK_KV_EVENTS` wins)", _ENGINE_TEST,
                      contracts=CONTRACTS if contract == "vllm" else only, setting="kv_events"))
    for part, flag in (("PORT", "--metrics-port"), ("HOST", "--metrics-host")):
        knobs.append(Knob(f"SMG_{word}_SERVICER_METRICS_{part}", HONOURED,
                          f"the servicer's Prometheus endpoint {part.lower()} when `{flag}` is not given",
                          f"`{flag}`'s fallback", "tests/test_ref_settings.py::test_metrics_flag_then_the_contracts_"
                          "name_then_the_vllm_name", contracts=CONTRACTS if contract == "vllm" else only,
                          setting=f"metrics_{part.lower()}"))
    knobs.append(Knob(f"SMG_{word}_SERVICER_IMPL", SELECTION,
                      "which servicer implementation the engine's launcher runs (python or rust)",
                      {"vllm": "`enginelink` selects enginelink under `vllm serve --grpc` and vLLM's gRPC launcher "
                               "modules (`--servicer-impl` wins)",
                       "sglang": "`enginelink` selects enginelink under `sglang serve --grpc-mode` "
                                 "(`--servicer-impl` wins)",
                       "tokenspeed": "not read: `ts serve` runs enginelink when `TS_SERVE_ENGINE_MODULE` names "
                                     "`enginelink.tools.tokenspeed_entry`"}[contract],
                      {"vllm": "tests/test_vllm_plugin.py::test_selection_flag_then_environment",
                       "sglang": "tests/test_sglang_plugin.py::test_selection_needs_the_grpc_flag_and_enginelink_"
                                 "asked_for",
                       "tokenspeed": "tests/test_tokenspeed_entry.py::test_the_references_servicer_flags_reach_"
                                     "the_servicer"}[contract], contracts=only))
    handshake_why = {
        "vllm": "the vLLM handshake is an ipc socket in the private socket directory (SMG_ZMQ_SOCKET_DIR), "
                "so there is no TCP port to pin",
        "sglang": "the SGLang scheduler reports ready on a pipe enginelink hands it, so there is no handshake port",
    }
    if contract == "tokenspeed":
        knobs.append(Knob("SMG_TOKENSPEED_SERVICER_HANDSHAKE_PORT", HONOURED,
                          "TCP port of the engine handshake (unset or 0: a free one)",
                          "pins the loopback TCP port TokenSpeed's ranks dial for the handshake",
                          "tests/test_tokenspeed_launch.py::test_the_reference_handshake_port_pins_the_handshake",
                          contracts=only, setting="handshake_port"))
    else:
        knobs.append(Knob(f"SMG_{word}_SERVICER_HANDSHAKE_PORT", INAPPLICABLE,
                          "TCP port of the engine handshake (unset or 0: a free one)", "warned at start-up",
                          "tests/test_ref_settings.py::test_inapplicable_names_get_one_warning_each_naming_why",
                          contracts=only, why=handshake_why[contract]))
    return knobs


_RDMA_WHY = ("the RDMA pixel lane of the reference's encode/prefill disaggregation, which enginelink "
             "does not provide")
_WARN_TEST = "tests/test_ref_settings.py::test_inapplicable_names_get_one_warning_each_naming_why"
_ROUTER_TEST = "tests/test_ref_settings.py::test_router_names_are_listed_not_warned"

_MM_BEHAVIOUR = {
    "processor": ("off, inprocess and redis are served; smg exits 2 naming why",
                  "tests/test_ref_settings.py::test_the_redis_sidecar_settings_are_taken_and_handed_on"),
    "redis_url": ("the sidecar's Redis (a URL redis-py cannot parse exits 2)",
                  "tests/adversarial/test_adv_media_sidecar.py::test_redis_killed_mid_job_is_unavailable_at_once_"
                  "and_the_worker_recovers"),
    "sidecar_timeout_ms": ("the result wait, and each job's deadline",
                           "tests/adversarial/test_adv_media_sidecar.py::test_with_no_sidecar_the_wait_ends_"
                           "unavailable_at_the_timeout"),
    "sidecar_max_queue": ("UNAVAILABLE at once past it",
                          "tests/adversarial/test_adv_media_sidecar.py::test_a_deep_queue_is_refused_at_once_and_"
                          "nothing_more_is_queued"),
    "sidecar_namespace": ("the keys' namespace instead of the fingerprint's",
                          "tests/adversarial/test_adv_media_sidecar.py::test_the_namespace_is_the_fingerprints_"
                          "unless_the_operator_names_one"),
    "max_inflight": ("the fetcher's job cap (UNAVAILABLE past it)",
                     "tests/adversarial/test_adv_media.py::test_at_the_inflight_cap_a_request_is_unavailable_at_once"),
    "max_item_bytes": ("one item's size cap",
                       "tests/adversarial/test_adv_media.py::test_an_oversized_body_is_refused_by_its_length_or_as_"
                       "it_streams"),
    "max_items": ("items of one modality per request, media refs and router tensors alike: it tightens the "
                  "engine's own --limit-mm-per-prompt, never loosens it (unset: the engine's limits)",
                  "tests/test_media_bounds.py::test_the_operators_cap_tightens_the_engines_limits_per_modality_and_"
                  "never_loosens_them"),
    "fetch_timeout_ms": ("enginelink's own fetcher's per-item deadline (the reference's smg pipeline's only)",
                         "tests/adversarial/test_adv_media.py::test_a_stalled_origin_is_unavailable_after_the_fetch_"
                         "deadline"),
    "video_fetch_timeout_ms": ("enginelink's own fetcher's per-video deadline",
                               "tests/adversarial/test_adv_media.py::test_media_knobs_defaults_and_values"),
}


def _mm_knobs() -> list[Knob]:
    knobs = []
    for spec in MM_FLAGS:
        if spec.setting in _MM_BEHAVIOUR:
            behaviour, test = _MM_BEHAVIOUR[spec.setting]
            knobs.append(Knob(spec.env, HONOURED, f"`{spec.flag}`'s fallback: {spec.help}",
                              f"`{spec.flag}`'s fallback: {behaviour}", test, contracts=("vllm",),
                              setting=f"mm_{spec.setting}"))
        elif spec.setting == "turbojpeg":
            knobs.append(Knob(spec.env, INAPPLICABLE, f"`{spec.flag}`'s fallback: {spec.help}", "warned at start-up",
                              _WARN_TEST, contracts=("vllm",),
                              why="it is the libjpeg-turbo policy of smg's own Rust media pipeline "
                                  "(--mm-processor smg), which enginelink does not run"))
    return knobs


_REFERENCE_OTHER = [
    Knob("SMG_VLLM_MM_MAX_RESULT_BYTES", HONOURED, "largest result the media sidecar writes back (512 MiB, lowered "
         "to Redis's proto-max-bulk-len)", "read by `enginelink media-sidecar`: a larger result is answered "
         "`result_too_large` (the worker's INVALID_ARGUMENT `media_too_large`)",
         "tests/adversarial/test_adv_media_sidecar.py::test_a_result_over_the_cap_is_media_too_large_and_one_redis_"
         "refuses_is_reported_at_once", contracts=("vllm",)),
    Knob("SMG_VLLM_MM_MAX_VIDEO_FRAMES", HONOURED, "frames sampled from one video media ref (0: vLLM decides)",
         "a cap on the frames vLLM's video loader samples (its --media-io-kwargs num_frames, else its default), "
         "never a raise; read by the worker's processor under inprocess, by `enginelink media-sidecar` under "
         "redis (as the reference's sidecar reads it)",
         "tests/test_media_processor_child.py::test_the_frame_cap_lowers_the_loaders_sampling_and_never_raises_it",
         contracts=("vllm",)),
    Knob("SMG_VLLM_CUDAGRAPH_CAPTURE_CAP", HONOURED, "CUDA-graph capture cap: auto, engine or a number",
         "the same derivation (runtime/contracts/vllm/capture_cap.py)",
         "tests/test_capture_cap.py::test_a_knob_value_it_does_not_take_is_refused_by_name", contracts=("vllm",)),
    Knob("SMG_ZMQ_SOCKET_DIR", HONOURED, "directory of the ipc sockets between servicer and engine",
         "honoured; refused (exit 2) unless a 0700 directory owned by this user",
         "tests/adversarial/test_adv_socket_dir.py::test_serve_exits_2_with_one_line_saying_what_to_do"),
    Knob("SMG_SERVICER_WORKER_THREADS", INAPPLICABLE, "worker threads of the Rust servicer's tokio runtime",
         "warned at start-up", _WARN_TEST,
         why="it sizes the Rust servicer's tokio runtime; enginelink's servicer is one trio thread"),
    Knob("SMG_PAIRING_PROTOCOL", HONOURED, "PD pairing protocol advertised in GetServerInfo",
         "advertised as given",
         "tests/test_kv_transfer.py::test_server_fields_from_the_engine_facts_and_the_pairing_protocol_env"),
    Knob("SMG_MM_ALLOW_PRIVATE_MEDIA_HOSTS", HONOURED, "1 lets media fetches reach non-public addresses",
         "honoured, checked at connect time",
         "tests/adversarial/test_adv_media.py::test_the_allow_knob_lets_loopback_through_and_nothing_else_changes",
         contracts=("vllm",)),
    Knob("SMG_KV_EVENT_HASH_CHECK", INAPPLICABLE, "the reference relay's check of engine block hashes",
         "warned at start-up", _WARN_TEST,
         why="enginelink's relay forwards the engine's block hashes as sent and does not recompute them"),
    Knob("SMG_CACHE_TRACE", INAPPLICABLE, "the reference TokenSpeed servicer's per-request cache trace log",
         "warned at start-up", _WARN_TEST, contracts=("tokenspeed",),
         why="a debug log of the reference's TokenSpeed Python servicer; enginelink journals every engine frame"),
    Knob("SMG_SGLANG_ZMQ_HANDSHAKE", INAPPLICABLE, "the reference's direct-ZMQ handshake address, set for "
         "scheduler ranks", "warned at start-up", _WARN_TEST, contracts=("sglang",),
         why="it wires the reference's in-rank ZMQ plugin to its Rust servicer; enginelink drives the "
             "scheduler over SGLang's own sockets"),
    Knob("SMG_SGLANG_ZMQ_ENGINE_INDEX", INAPPLICABLE, "the reference's direct-ZMQ engine index, set for "
         "scheduler ranks", "warned at start-up", _WARN_TEST, contracts=("sglang",),
         why="it wires the reference's in-rank ZMQ plugin to its Rust servicer; enginelink drives the "
             "scheduler over SGLang's own sockets"),
    Knob("SMG_SGLANG_ATTRIBUTE_GRAMMAR_ABORTS", HONOURED, "turns on the in-rank stamping of a grammar's aborts "
         "(`err_type` GrammarRejectedToken), which the servicer answers FAILED_PRECONDITION + "
         "`smg-constraint-failed: engine`",
         "set to 1 for the scheduler ranks unless given (the reference's setdefault); enginelink's SGLang plugin "
         "(`tools/sglang_grammar_attribution.py`) hooks the grammar paths; 0 leaves those aborts unnamed (INTERNAL)",
         "tests/sglang/test_sglang_grammar.py::test_a_rejected_token_is_attributed_in_sglangs_own_result_processor",
         contracts=("sglang",)),
    *(Knob(name, INAPPLICABLE, meaning, "warned at start-up", _WARN_TEST, why=_RDMA_WHY) for name, meaning in (
        ("SMG_MM_PIXEL_RDMA", "turns on the RDMA pixel lane"),
        ("SMG_RDMA_SLOT_BYTES", "size of one RDMA landing slot"),
        ("SMG_RDMA_LANDING_SLOTS", "RDMA landing slots"),
        ("SMG_RDMA_SEND_MD", "RDMA memory-descriptor exchange"),
        ("SMG_RDMA_LANDING_WAIT_S", "wait for a free RDMA landing slot"),
        ("SMG_RDMA_READ_TIMEOUT_S", "RDMA read deadline"))),
    *(Knob(name, ROUTER, meaning, "not read by a servicer (the router's)", _ROUTER_TEST) for name, meaning in (
        ("SMG_MM_PROCESSING", "where the router processes media (router or worker)"),
        ("SMG_IMAGE_MAX_INPUT_BYTES", "the router's cap on one image"),
        ("SMG_VIDEO_MAX_INPUT_BYTES", "the router's cap on one video"),
        ("SMG_AUDIO_MAX_INPUT_BYTES", "the router's cap on one audio clip"),
        ("SMG_MM_FETCH_TIMEOUT_MS", "the router's media fetch deadline"),
        ("SMG_MM_VIDEO_FETCH_TIMEOUT_MS", "the router's video fetch deadline"),
        ("SMG_MM_TURBOJPEG", "the router's libjpeg-turbo policy"))),
]

# --- enginelink's own names -----------------------------------------------------------------------------------------

_OWN = {
    # name: (meaning, test)
    "ENGINELINK_ENGINE": ("`serve --engine`'s default", ""),
    "ENGINELINK_WIRE": ("`serve --wire`'s default", ""),
    "ENGINELINK_HOST": ("`serve --host`'s default", ""),
    "ENGINELINK_PORT": ("`serve --port`'s default", ""),
    "ENGINELINK_LOG_LEVEL": ("`serve --log-level`'s default", ""),
    "ENGINELINK_JOURNAL_KEEP": ("previous runs' journals kept", ""),
    "ENGINELINK_JOURNAL_RING_RECORDS": ("records the journal's in-memory ring keeps",
                                        "tests/tools/test_soak.py::test_two_minutes_of_churn_stay_flat_and_every_stream_is_the_engines"),
    "ENGINELINK_SNAPSHOT_INTERVAL_SECS": ("journal snapshot period", ""),
    "ENGINELINK_DRAIN_SECS": ("drain on SIGTERM", ""),
    "ENGINELINK_STARTUP_TIMEOUT_SECS": ("start-up silence bound", ""),
    "ENGINELINK_STARTUP_CEILING_SECS": ("start-up ceiling", ""),
    "ENGINELINK_SILENCE_TIMEOUT_SECS": ("engine silence bound", ""),
    "ENGINELINK_PREFILL_TOKENS_PER_SEC": ("prefill rate of the silence bound", ""),
    "ENGINELINK_ENGINE_STOP_GRACE_SECS": ("engine stop grace", ""),
    "ENGINELINK_IDLE_PROBE_SECS": ("idle liveness probe period", ""),
    "ENGINELINK_IDLE_PROBE_TIMEOUT_SECS": ("idle liveness probe bound", ""),
    "ENGINELINK_ENGINE_RESTARTS": ("`serve --engine-restarts`' default: engine restarts within the window, each "
                                   "resuming the open streams (0: off; docs/resume.md)",
                                   "tests/test_resume_serve.py::test_the_restart_knobs_come_from_flags_then_variables"),
    "ENGINELINK_ENGINE_RESTART_WINDOW_SECS": ("`serve --engine-restart-window`' default: the window of the restart "
                                              "count", "tests/test_resume_serve.py::test_the_restart_knobs_come_from_flags_then_variables"),
    "ENGINELINK_RESUME_TIMEOUT_SECS": ("`serve --resume-timeout`' default: how long a held stream waits for the "
                                       "restarted engine", "tests/test_resume_serve.py::test_the_restart_knobs_come_from_flags_then_variables"),
    "ENGINELINK_RESUME_MEDIA_ITEMS_MAX": ("media items a request may carry and still be resumed",
                                          "tests/test_resume_serve.py::test_the_restart_knobs_come_from_flags_then_variables"),
    "ENGINELINK_ENGINE_NICE": ("engine CPU priority", ""),
    "ENGINELINK_SERVICER_SCHED": ("servicer scheduling policy", ""),
    "ENGINELINK_PLACEMENT": ("CPU placement", ""),
    "ENGINELINK_HELD_WRITES_BUDGET_MS": ("longest a wake-up holds its frames' writes (opt-in)",
                                         "tests/test_engine_receive.py::test_a_wake_up_behind_its_engine_writes_what_it_read_within_the_time_budget"),
    "ENGINELINK_WARMUP": ("planned warm-up", ""),
    "ENGINELINK_KV_EVENTS": ("KV-event relay on/off", ""),
    "ENGINELINK_KV_MAX_SUBSCRIBERS": ("open SubscribeKvEvents streams", ""),
    "ENGINELINK_KV_SEND_STALL_SECS": ("KV stream send stall bound", ""),
    "ENGINELINK_KV_MAX_SUBSCRIBERS_PER_PEER": ("open SubscribeKvEvents streams of one peer", ""),
    "ENGINELINK_GRPC_MAX_RECV_BYTES": ("largest gRPC message", ""),
    "ENGINELINK_GRPC_MAX_CONNECTION_RECV_BYTES": ("reassembly bytes per connection", ""),
    "ENGINELINK_GRPC_MAX_CONNECTIONS": ("gRPC connections", ""),
    "ENGINELINK_GRPC_HANDSHAKE_TIMEOUT_SECS": ("HTTP/2 preface bound", ""),
    "ENGINELINK_GRPC_IDLE_TIMEOUT_SECS": ("idle connection bound", ""),
    "ENGINELINK_GRPC_MAX_HANDSHAKING_CONNECTIONS": ("connections still in the HTTP/2 handshake", ""),
    "ENGINELINK_GRPC_MAX_CONNECTIONS_PER_PEER": ("gRPC connections of one peer (an IPv4 address or IPv6 /64)", ""),
    "ENGINELINK_GRPC_EVICT_IDLE_SECS": ("idle time after which a connection gives way at the cap", ""),
    "ENGINELINK_FAST_PATH": ("the gRPC fast path", ""),
    "ENGINELINK_GC_FREEZE": ("gc.freeze once serving", ""),
    "ENGINELINK_GC_YOUNG": ("young-generation threshold", ""),
    "ENGINELINK_TRACE_CHUNKS_MAX": ("chunks listed per trace span (`--otlp-traces-endpoint`; docs/tracing.md)",
                                    "tests/test_tracing.py::test_refused_aborted_and_n_2_calls_say_how_they_went"),
    "ENGINELINK_HEALTH_CHECK_TIMEOUT_SECS": ("SGLang HealthCheck probe bound", ""),
    "ENGINELINK_MAX_REQUEST_ID_BYTES": ("request id length", ""),
    "ENGINELINK_MAX_STOP_STRINGS": ("stop strings per call", ""),
    "ENGINELINK_MAX_STOP_STRING_BYTES": ("bytes of one stop string", ""),
    "ENGINELINK_MAX_STOP_BYTES_TOTAL": ("bytes of all stop strings", ""),
    "ENGINELINK_MAX_CONSTRAINT_BYTES": ("constraint text bytes", ""),
    "ENGINELINK_MAX_KV_TRANSFER_PARAMS_BYTES": ("kv_transfer_params_json bytes", ""),
    "ENGINELINK_MAX_JSON_DEPTH": ("JSON nesting depth", ""),
    "ENGINELINK_MAX_STOP_TOKEN_IDS": ("stop token ids per call", ""),
    "ENGINELINK_MAX_LOGIT_BIAS_ENTRIES": ("logit bias entries per call", ""),
    "ENGINELINK_MAX_CHOICES": ("items of a choice constraint", ""),
    "ENGINELINK_MAX_ABORT_IDS": ("request ids in one Abort", ""),
    "ENGINELINK_ALLOWED_LOCAL_MEDIA_PATH": ("`--allowed-local-media-path`'s fallback", ""),
    "ENGINELINK_ALLOWED_MEDIA_DOMAINS": ("`--allowed-media-domains`' fallback: the media fetcher's host allow-list",
                                         "tests/test_allowed_media_domains.py::test_the_variable_stands_when_no_flag_is_given"),
    "ENGINELINK_ALLOW_UNTESTED_VLLM": ("`--allow-untested-vllm`: run a vLLM release outside 0.28.0-0.34.0 whose "
                                       "layout the codec speaks", "tests/test_vllm_compat.py::test_the_allow_variable_takes_yes_or_no"),
    "ENGINELINK_MM_MAX_REDIRECTS": ("redirects per media item", ""),
    "ENGINELINK_MM_MAX_BYTES_IN_FLIGHT": ("fetched media bytes held", ""),
    "ENGINELINK_MM_MAX_TENSOR_BYTES": ("router tensor bytes per request", ""),
    "ENGINELINK_MM_PROCESSOR_START_TIMEOUT_S": ("media processor helper's start bound", ""),
    "ENGINELINK_MM_PROCESS_TIMEOUT_S": ("one request's turn in the media processor", ""),
    "ENGINELINK_MM_ENGINE_ARGS": ("set by enginelink for its media processor helper: the engine's arguments (JSON), "
                                  "the model's config is built from", ""),
    "ENGINELINK_ENGINE_FACTS": ("set by enginelink for its engine: where the engine writes its facts", ""),
    "ENGINELINK_PYTHON": ("enginelink's interpreter for `ts serve`'s engine module", ""),
    "ENGINELINK_VLLM_PYTHON": ("the vLLM engine's interpreter", ""),
    "ENGINELINK_VLLM_VENV": ("the vLLM venv", ""),
    "ENGINELINK_VLLM_LAYOUT_FILE": ("vLLM layout to check against (test hook)", ""),
    "ENGINELINK_MLX_PYTHON": ("the MLX engine's interpreter", ""),
    "ENGINELINK_MLX_VENV": ("the MLX venv", ""),
    "ENGINELINK_MLX_REFERENCE": ("the reference MLX servicer for `bench`", ""),
    "ENGINELINK_SGLANG_PYTHON": ("the SGLang scheduler's interpreter", ""),
    "ENGINELINK_SGLANG_VENV": ("the SGLang venv", ""),
    "ENGINELINK_SGLANG_LAYOUT_FILE": ("SGLang layout to check against (test hook)", ""),
    "ENGINELINK_SGLANG_GPU_GLOB": ("where `--engine sglang` looks for CUDA devices (test hook)", ""),
    "ENGINELINK_TOKENSPEED_PYTHON": ("the TokenSpeed engine's interpreter", ""),
    "ENGINELINK_TOKENSPEED_VENV": ("the TokenSpeed venv", ""),
    "ENGINELINK_TOKENSPEED_LAYOUT_FILE": ("TokenSpeed layout to check against (test hook)", ""),
    "ENGINELINK_BENCH_REFS_VENV": ("the venv of the reference servicers `bench --against` runs", ""),
}
_OWN_TOOLING = {
    "ENGINELINK_VENV": "enginelink's own venv (tools/run-tests, tools/serve)",
    "ENGINELINK_TEST_WORKERS": "pytest-xdist workers of tools/run-tests",
    "ENGINELINK_SIM_SEED": "one simulation seed (tests/sim)",
    "ENGINELINK_SIM_SEEDS": "simulation seeds per sweep (tests/sim)",
    "ENGINELINK_SIM_LOG": "keep the servicer's INFO log in simulation sweeps",
    "ENGINELINK_RESUME_EVIDENCE": "tests/vllm/test_vllm_resume.py keeps its inspect view and journal story there",
    "ENGINELINK_MEASURE_STEPS": "tests/adversarial/measure_inputs.py: where the servicer writes its long loop steps",
    "ENGINELINK_FAST_LOOP_CANARY": "tests/test_fast_loop.py: the canary test that must fail under --fast",
    "ENGINELINK_VLLM_PLUGIN": "tools/setup-vllm: install enginelink into the vLLM venv (the plugin)",
    "ENGINELINK_VLLM_0_28": "tests/vllm_0_28: the release those tests run",
    "ENGINELINK_VLLM_0_28_VENV": "the vLLM 0.28.0 venv (tools/setup-vllm-0.28)",
    "ENGINELINK_VLLM_0_28_PYTHON": "the vLLM 0.28.0 engine's interpreter (tests/vllm_0_28)",
    "ENGINELINK_VLLM_WHEELS": "a folder of vLLM wheels for tools/vllm_layouts.py --check (tests/wire)",
    "ENGINELINK_SKIP_VLLM_0_28": "tools/run-tests leaves the vLLM 0.28.0 venv out",
    "ENGINELINK_REQUIRE_VLLM_0_28": "a missing vLLM 0.28.0 install fails its tests instead of skipping them",
    "ENGINELINK_SKIP_REDIS": "tools/run-tests leaves Debian's redis-server out (tools/setup-redis)",
    "ENGINELINK_REQUIRE_REDIS": "a missing redis-server fails the Redis media sidecar's tests instead of skipping them",
    **{f"ENGINELINK_SKIP_{e}": f"tools/run-tests leaves the {e.title()} venv out" for e in
       ("VLLM", "MLX", "SGLANG", "TOKENSPEED")},
    **{f"ENGINELINK_REQUIRE_{e}": f"a missing {e.title()} install fails its tests instead of skipping them" for e in
       ("VLLM", "MLX", "SGLANG", "TOKENSPEED", "BENCH_REFS")},
}
_ENGINELINK = [
    *(Knob(name, HONOURED, meaning, "read by enginelink", test, origin="enginelink",
           setting=next((s for s, own in _OWN_NAME.items() if own == name), ""))
      for name, (meaning, test) in _OWN.items()),
    *(Knob(name, TOOLING, meaning, "read by enginelink's tools and tests", origin="enginelink")
      for name, meaning in _OWN_TOOLING.items()),
    Knob("SMG_KV_EVENT_HISTORY_BATCHES", HONOURED, "KV history per DP rank, batches", "read by enginelink",
         "tests/kv/test_kv_config.py::test_history_bounds_come_from_the_environment", origin="enginelink"),
    Knob("SMG_KV_EVENT_HISTORY_BYTES", HONOURED, "KV history per DP rank, bytes", "read by enginelink",
         "tests/kv/test_kv_config.py::test_history_bounds_come_from_the_environment", origin="enginelink"),
]

KNOBS: tuple[Knob, ...] = (*(k for c in ("vllm", "sglang", "tokenspeed") for k in _engine_knobs(c)), *_mm_knobs(),
                           *_REFERENCE_OTHER, *_ENGINELINK)
BY_NAME: dict[str, Knob] = {knob.name: knob for knob in KNOBS}
assert len(BY_NAME) == len(KNOBS), "a name registered twice"
PREFIXES = ("SMG_", "ENGINELINK_")


def names(setting: str, contract: str) -> tuple[str, ...]:
    """The variables of one setting for the served contract, first wins: enginelink's own, the contract's
    reference name, then the vLLM reference name (read for every engine before the engine names were)."""
    own = _OWN_NAME.get(setting)
    found = [own] if own else []
    word = ENGINE_WORD.get(contract)
    candidates = [k.name for k in KNOBS if k.setting == setting and k.origin == "reference"]
    for knob_name in candidates:
        if word and knob_name.startswith(f"SMG_{word}_"):
            found.append(knob_name)
    for knob_name in candidates:
        if knob_name.startswith("SMG_VLLM_") and knob_name not in found and contract in BY_NAME[knob_name].contracts:
            found.append(knob_name)
    return tuple(found)


def closest(name: str) -> str | None:
    """The known name nearest to ``name`` (difflib), if any is near: judged on what follows the shared
    prefix (every name shares ``SMG_`` or ``ENGINELINK_``, which would make anything look near), else on
    the whole name, for a word put under the other prefix."""
    prefix = next((p for p in PREFIXES if name.startswith(p)), "")
    rests = {known[len(prefix):]: known for known in BY_NAME if prefix and known.startswith(prefix)}
    close = difflib.get_close_matches(name[len(prefix):], list(rests), n=1, cutoff=0.6)
    if close:
        return rests[close[0]]
    close = difflib.get_close_matches(name, list(BY_NAME), n=1, cutoff=0.8)
    return close[0] if close else None


def environment_warnings(environ: Mapping[str, str], contract: str, engine: str) -> list[str]:
    """One line per ``SMG_*`` / ``ENGINELINK_*`` variable set that enginelink does not read here: an
    inapplicable one with why, another contract's with which, an unknown one with the closest known name."""
    lines = []
    for name in sorted(n for n in environ if n.startswith(PREFIXES)):
        knob = BY_NAME.get(name)
        if knob is None:
            near = closest(name)
            hint = f"; did you mean {near}?" if near else ""
            lines.append(f"{name} is not a variable enginelink or the reference servicer defines: ignored{hint}")
        elif knob.status == INAPPLICABLE:
            if contract in knob.contracts:
                lines.append(f"{name} cannot apply to enginelink: {knob.why}; ignored")
            else:
                lines.append(_other_contract(knob, contract))
        elif knob.status == HONOURED and contract not in knob.contracts:
            lines.append(_other_contract(knob, contract))
        elif knob.status == HONOURED and engine in knob.unless_engine:
            lines.append(f"{name} cannot apply to --engine {engine}: {knob.engine_why}; ignored")
    return lines


def _other_contract(knob: Knob, contract: str) -> str:
    served = ", ".join(CONTRACT_TITLE[c] for c in knob.contracts)
    return (f"{knob.name} is read for the {served} contract; this servicer serves {CONTRACT_TITLE[contract]}: "
            "ignored")


def reference_names() -> list[str]:
    return sorted(k.name for k in KNOBS if k.origin == "reference")


def of_status(status: str, knobs: Iterable[Knob] = KNOBS) -> list[Knob]:
    return [k for k in knobs if k.status == status]
