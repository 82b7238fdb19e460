"""``docs/compatibility.md``: the reference servicer's documented flags and variables, and what enginelink does.

Generated, never edited by hand: ``python -m enginelink.tools.compat_table
--write`` rewrites it, ``tests/test_knobs.py`` regenerates it and fails when
the committed file differs. The rows come from enginelink's own code:

- the servicer flags: which launcher takes each is asked of the parsers
  themselves (``enginelink serve``'s, the flags the vLLM and SGLang plugins
  add to a parser shaped like the engine's, what ``ts serve``'s engine module
  reads), and what enginelink does with each value of ``tools/ref_settings.py``;
- the variables: ``tools/knobs.py``, the registry the start-up warnings
  come from;
- the engine, router and tool flags the reference's documentation names:
  :data:`OTHER_FLAGS` below.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from enginelink.tools import knobs, ref_flags

DOC = Path(__file__).resolve().parents[1] / "docs" / "compatibility.md"

_MM_BEHAVIOUR = {
    "processor": ("`off`, `inprocess`, `redis` (with `enginelink media-sidecar` or the reference's sidecar): "
                  "served, the `mm_processor_source` label saying which setting decided; `smg`: exit 2 naming why",
                  "tests/test_ref_settings.py::test_the_redis_sidecar_settings_are_taken_and_handed_on"),
    "max_inflight": ("honoured", "tests/test_ref_settings.py::test_flag_then_variable_then_default_with_the_source"),
    "max_item_bytes": ("honoured", "tests/test_ref_settings.py::test_flag_then_variable_then_default_with_the_source"),
    "max_items": ("honoured: items of one modality per request, media refs and router tensors alike; it tightens "
                  "the engine's own `--limit-mm-per-prompt`, never loosens it (unset: the engine's limits)",
                  "tests/test_media_bounds.py::test_the_operators_cap_tightens_the_engines_limits_per_modality_and_"
                  "never_loosens_them"),
    "redis_url": ("honoured: the sidecar's Redis (a bad URL exits 2 naming it)",
                  "tests/adversarial/test_adv_media_sidecar.py::test_redis_killed_mid_job_is_unavailable_at_once_"
                  "and_the_worker_recovers"),
    "sidecar_timeout_ms": ("honoured: the result wait, and each job's deadline",
                           "tests/adversarial/test_adv_media_sidecar.py::test_with_no_sidecar_the_wait_ends_"
                           "unavailable_at_the_timeout"),
    "sidecar_max_queue": ("honoured: UNAVAILABLE at once past it",
                          "tests/adversarial/test_adv_media_sidecar.py::test_a_deep_queue_is_refused_at_once_and_"
                          "nothing_more_is_queued"),
    "sidecar_namespace": ("honoured: the keys' namespace instead of the fingerprint's",
                          "tests/adversarial/test_adv_media_sidecar.py::test_the_namespace_is_the_fingerprints_"
                          "unless_the_operator_names_one"),
    "turbojpeg": ("validated (exit 2 on a bad value); a WARNING: only smg's Rust media pipeline reads it",
                  "tests/test_ref_settings.py::test_a_feature_enginelink_lacks_is_refused_naming_it"),
    "fetch_timeout_ms": ("honoured by enginelink's own fetcher (the reference's smg pipeline only)",
                         "tests/test_ref_settings.py::test_flag_then_variable_then_default_with_the_source"),
    "video_fetch_timeout_ms": ("honoured by enginelink's own fetcher",
                               "tests/test_ref_settings.py::test_flag_then_variable_then_default_with_the_source"),
}
_OTHER_SERVICER = {
    "--servicer-impl": ("SMG_<ENGINE>_SERVICER_IMPL",
                        "`enginelink` selects enginelink (the reference's `python`/`rust` stay choices for "
                        "its own launcher); the start-up line says which decided",
                        "tests/test_ref_settings.py::test_the_start_up_lines_say_which_decided"),
    "--metrics-port": ("SMG_<ENGINE>_SERVICER_METRICS_PORT",
                       "the servicer's `/metrics` port; flag, else the served engine's variable, else "
                       "`SMG_VLLM_SERVICER_METRICS_PORT`, else no endpoint",
                       "tests/test_ref_settings.py::test_metrics_flag_then_the_contracts_name_then_the_vllm_name"),
    "--metrics-host": ("SMG_<ENGINE>_SERVICER_METRICS_HOST", "the metrics listener's host, in the same order",
                       "tests/test_ref_settings.py::test_metrics_flag_then_the_contracts_name_then_the_vllm_name"),
    "--allowed-local-media-path": ("ENGINELINK_ALLOWED_LOCAL_MEDIA_PATH",
                                   "`file:` media refs under it only (the engine gets it too under `vllm serve`)",
                                   "tests/adversarial/test_adv_media.py::test_file_urls_only_under_the_allowed_folder"),
    "--allowed-media-domains": ("", "enforced by the servicer's fetcher at every redirect (and by `enginelink "
                                "media-sidecar`'s, given it); the engine gets it too",
                                "tests/test_ref_settings.py::test_a_feature_enginelink_lacks_is_refused_naming_it"),
    "--media-io-kwargs": ("", "honoured: a vLLM engine argument, from which the media processor builds vLLM's "
                          "loaders (the worker's under `inprocess`, `enginelink media-sidecar`'s under `redis`: give "
                          "it the engine's arguments); `enginelink serve`'s own flag is handed to the engine",
                          "tests/vllm/test_vllm_av.py::test_media_io_kwargs_and_the_frame_cap_change_the_sampled_video"),
}

# Flags the reference's documentation names that are not the servicer's own: (flag, whose, what enginelink does, test).
OTHER_FLAGS: tuple[tuple[str, str, str, str], ...] = (
    ("--grpc", "vLLM (`vllm serve`)", "with `--servicer-impl enginelink`: enginelink serves gRPC",
     "tests/vllm/test_vllm_launcher_plugin.py::test_vllm_serve_grpc_runs_enginelink_behind_the_router"),
    ("--grpc-mode, --smg-grpc-mode", "SGLang (`sglang serve`)", "with enginelink selected: enginelink serves gRPC",
     "tests/sglang/test_sglang_launcher_real.py::test_the_real_launcher_hands_over_to_enginelink_up_to_the_"
     "engine_launch"),
    ("--headless", "vLLM (`vllm serve`)", "a multi-node worker gets the leader's capture cap; the leader is "
     "enginelink's", "tests/test_vllm_plugin.py::test_a_headless_worker_parse_gets_the_capture_cap"),
    ("--model, --model-path, --host, --port", "engine launchers", "the model and the gRPC listener",
     "tests/test_vllm_plugin.py::test_the_servicer_gets_the_launchers_listener_and_metrics"),
    ("--kv-events-config", "engine", "kept as given; relayed when it publishes",
     "tests/kv/test_kv_config.py::test_an_explicit_config_is_kept_and_followed"),
    ("--kv-transfer-config", "vLLM", "passed to the engine; connector params pass through",
     "tests/contract/test_pd.py::test_prefill_leg_params_reach_the_engine_and_its_answer_comes_back"),
    ("--structured-outputs-config", "vLLM", "passed to the engine; its backend is the one sent",
     "tests/vllm/test_vllm_constraints.py::test_the_configured_backend_is_the_one_sent"),
    ("--max-num-batched-tokens, --max-num-seqs, --max-cudagraph-capture-size, --cudagraph-capture-sizes, "
     "--compilation-config, --enforce-eager, --speculative-config", "vLLM",
     "passed to the engine; the capture cap derived as the reference derives it",
     "tests/test_capture_cap.py::test_derivation_table"),
    ("--nnodes, --node-rank, --master-addr, --master-port", "vLLM", "enginelink fronts node rank 0; another rank "
     "exits 2 with the worker's command", "tests/test_vllm_launch_args.py::test_the_derived_cap_is_in_the_"
     "engines_arguments"),
    ("--dist-init-addr", "SGLang, TokenSpeed", "passed to the engine; read by `enginelink worker-probe`",
     "tests/tools/test_worker_probe.py::test_dist_init_addr_in_each_spelling"),
    ("--leader", "the reference's worker probe", "`enginelink worker-probe --leader`",
     "tests/tools/test_worker_probe.py::test_dist_init_addr_in_each_spelling"),
    ("--limit-mm-per-prompt", "vLLM", "passed to the engine; held by the worker before the engine on media refs and "
     "router tensors alike, and advertised as `mm_item_limits`",
     "tests/vllm/test_vllm_av.py::test_media_refs_give_vllm_offlines_tokens_and_the_engines_bounds_hold_before_it"),
    ("--mm-processor-kwargs", "vLLM", "passed to the engine; the media processor builds the model's processor from "
     "the engine's arguments, so it reads them too", ""),
    ("--mm-device-do-normalize", "smg's Rust media pipeline", "passed to the engine; not read by enginelink", ""),
    ("--reasoning-parser, --grammar-backend", "engine", "passed to the engine", ""),
    ("--tp-size, --attn-dp-size, --chunked-prefill-size, --max-prefill-tokens, "
     "--max-running-requests, --return-hidden-states-mode", "SGLang, TokenSpeed", "passed to the scheduler", ""),
    ("--dp-size", "SGLang, TokenSpeed", "passed to the scheduler; SGLang's N ranks run behind its own DP controller, "
     "each request carrying enginelink's rank (`routed_dp_rank`)",
     "tests/contract/test_legs_and_ranks.py::test_sglang_dp_pin_runs_on_its_rank_and_out_of_range_is_refused"),
    ("--disaggregation-mode, --disaggregation-bootstrap-port, --disaggregation-transfer-backend",
     "SGLang, TokenSpeed", "passed to the engine; a prefill/decode leg takes the request's bootstrap, "
     "advertises its role, places a prefill under DP on its room's residue (docs/pd.md)",
     "tests/contract/test_legs_and_ranks.py::test_sglang_prefill_leg_runs_on_the_rooms_residue_and_prefills_only"),
    ("--language-only, --encoder-only, --encoder-bootstrap-port, --encoder-urls, --limit-mm-data-per-request",
     "SGLang, TokenSpeed", "passed to the engine; the encode roles are not served (refused per request)", ""),
    ("--zmq-handshake-address, --zmq-engine-index", "the reference's SGLang headless launcher",
     "`enginelink headless --engine sglang --zmq-handshake-address ...` (the router's ZMQ lane)",
     "tests/router/test_router_headless.py::test_the_router_registers_enginelink_as_its_sglang_engine"),
    ("--redis-url, --namespace, --concurrency", "the reference's media sidecar",
     "`enginelink media-sidecar` takes the same (the engine's own arguments after `--`); either sidecar serves "
     "either worker", "tests/adversarial/test_adv_media_sidecar.py::test_enginelinks_sidecar_serves_a_job_with_"
     "the_processors_tensors"),
    ("VLLM_IMAGE_FETCH_TIMEOUT, VLLM_VIDEO_FETCH_TIMEOUT, VLLM_AUDIO_FETCH_TIMEOUT", "vLLM (variables)",
     "each modality's fetch deadline, on the worker (`inprocess`) and in `enginelink media-sidecar`, where set "
     "and `SMG_VLLM_MM_*FETCH_TIMEOUT_MS` is not", "tests/adversarial/test_adv_media.py::test_vllms_fetch_"
     "timeouts_are_honoured_where_the_reference_honours_them"),
    ("--backend, --connection-mode, --mm-processing, --max-payload-size, --zmq-startup-timeout-secs, "
     "--router-zmq-startup-timeout-secs", "router (smg)", "not a servicer's: the router's", ""),
    ("--installed, --launcher-tree, --servicer-root", "the reference's launcher-switch smoke script",
     "the reference's development tooling", ""),
)


def _vllm_parser() -> argparse.ArgumentParser:
    """A parser shaped like ``vllm serve``'s gRPC one: ``--grpc`` and vLLM's own media flags, then the plugin."""
    from enginelink.tools import vllm_plugin

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--grpc", action="store_true")
    parser.add_argument("--port", type=int)
    ref_flags.add_media_arguments(parser)  # vLLM's own engine flags
    vllm_plugin.add_flags(parser)
    return parser


def _sglang_parser() -> argparse.ArgumentParser:
    from enginelink.tools import sglang_plugin

    parser = argparse.ArgumentParser(add_help=False)
    sglang_plugin.add_flags(parser)
    return parser


def _serve_parser() -> argparse.ArgumentParser:
    from enginelink.tools import serve

    parser = argparse.ArgumentParser(add_help=False)
    serve.add_arguments(parser)
    return parser


def servicer_flags() -> list[tuple[str, ...]]:
    """(flag, takes it, variable, enginelink's behaviour, test) for each of the reference's servicer flags."""
    from enginelink.tools import tokenspeed_entry

    parsers = {"vllm serve --grpc, python -m vllm…grpc_server": _vllm_parser(), "sglang serve --grpc-mode":
               _sglang_parser(), "enginelink serve": _serve_parser()}
    rows = []
    specs = {spec.flag: spec for spec in ref_flags.MM_FLAGS}
    for flag in ("--servicer-impl", "--metrics-port", "--metrics-host", *specs, *ref_flags.MEDIA_FLAGS):
        takers = [name for name, parser in parsers.items() if flag in parser._option_string_actions]
        if flag in tokenspeed_entry._OWN:
            takers.append("ts serve's engine module")
        if flag in specs:
            env, (behaviour, test) = specs[flag].env, _MM_BEHAVIOUR[specs[flag].setting]
        else:
            env, behaviour, test = _OTHER_SERVICER[flag]
        rows.append((f"`{flag}`", ", ".join(takers), f"`{env}`" if env else "—", behaviour, _test(test)))
    return rows


def _test(test: str) -> str:
    return f"`{test}`" if test else "—"


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return lines


def _contracts(knob: knobs.Knob) -> str:
    if knob.contracts == knobs.CONTRACTS:
        return "all"
    return ", ".join(knobs.CONTRACT_TITLE[c] for c in knob.contracts)


def render() -> str:
    out = [
        "# Compatibility with the reference servicer (smg-grpc-servicer 0.14.1)",
        "",
        "<!-- Generated by `python -m enginelink.tools.compat_table --write` from tools/ref_flags.py, the",
        "     launchers' parsers and tools/knobs.py; tests/test_knobs.py fails when this file is stale. -->",
        "",
        "Every flag and `SMG_*` variable the reference documents, with what enginelink does with it and the",
        "test that checks that. The rows come from enginelink's own parsers and its one registry of names",
        "(`tools/knobs.py`), the same registry the start-up warnings come from.",
        "",
        "**Precedence**, one rule for every setting: the flag, then `ENGINELINK_*` (enginelink's own name, set",
        "only for enginelink: the deliberate choice), then the served engine's `SMG_<ENGINE>_SERVICER_*`,",
        "then `SMG_VLLM_SERVICER_*` (the spelling enginelink read for every engine before the engine-specific",
        "names were honoured), then the default. At start-up one line names every setting a flag or a",
        "variable decided, and which (`settings (flag > ENGINELINK_* > SMG_* > default): …`), beside the",
        "reference's own lines (`servicer implementation: enginelink (source=flag)`, `worker-side media",
        "processing: inprocess (source=flag)`).",
        "",
        "**Start-up refusals and warnings.** A flag asking for a feature enginelink does not have exits 2",
        "before anything starts, one line naming it and why. A variable that cannot apply (the reference's",
        "Rust-only machinery, a design with no such knob, another engine's name) gets one WARNING line naming",
        "it and why; a router's variable is listed here and not warned about; an `SMG_*` or `ENGINELINK_*`",
        "variable neither project defines gets a WARNING with the closest known name.",
        "",
        "## The servicer's flags",
        "",
        "The reference's plugins add these to the engines' launchers; enginelink's do the same, and",
        "`enginelink serve` takes them too. The last three are vLLM's own engine flags, which the worker's",
        "media fetcher reads.",
        "",
        *_table(("flag", "taken by", "variable", "enginelink", "test"), servicer_flags()),
        "",
        "## Other flags the reference's documentation names",
        "",
        *_table(("flag", "whose", "enginelink", "test"),
                [(", ".join(f"`{f}`" for f in flag.split(", ")), whose, what, _test(test))
                 for flag, whose, what, test in OTHER_FLAGS]),
        "",
    ]
    titles = {knobs.HONOURED: "Honoured", knobs.INAPPLICABLE: "Cannot apply: a WARNING at start-up when set",
              knobs.SELECTION: "Launcher selection", knobs.ROUTER: "The router's (not warned about)"}
    out += ["## The reference's `SMG_*` variables", ""]
    reference = [k for k in knobs.KNOBS if k.origin == "reference"]
    for status, title in titles.items():
        rows = [(f"`{k.name}`", _contracts(k), k.meaning,
                 (f"{k.behaviour}; under `--engine {', '.join(k.unless_engine)}`: a WARNING ({k.engine_why})"
                  if k.unless_engine else k.why if status == knobs.INAPPLICABLE else k.behaviour), _test(k.test))
                for k in knobs.of_status(status, reference)]
        out += [f"### {title}", "", *_table(("variable", "read for", "the reference's meaning",
                                             "enginelink" if status != knobs.INAPPLICABLE else "why not", "test"),
                                            rows), ""]
    own = [k for k in knobs.KNOBS if k.origin == "enginelink"]
    out += ["## enginelink's own names", "",
            "Known to the typo check; what each sets is in docs/running.md, \"Settings\".", "",
            *_table(("variable", "what"), [(f"`{k.name}`", k.meaning + (" (tooling)" if k.status == knobs.TOOLING
                                                                          else "")) for k in own]), ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    text = render()
    if args == ["--write"]:
        DOC.write_text(text)
        print(f"wrote {DOC}")
        return 0
    if args == ["--check"]:
        if DOC.read_text() != text:
            print(f"{DOC} is stale: python -m enginelink.tools.compat_table --write", file=sys.stderr)
            return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
