"""The reference's flags and ``SMG_*`` names at start-up (issue 32 items 3 and 5).

Resolution is pure (``tools/ref_settings.py`` over a namespace and a dict):
flag, then ``ENGINELINK_*``, then the served engine's ``SMG_*``, then
``SMG_VLLM_*``, then the default, each value with the source that decided.
A feature enginelink lacks is one refusal line each (``serve`` exits 2); a
name that cannot apply, or belongs to another engine, or that neither project
defines (a typo, with the closest known name) is one WARNING each. Last, a
real ``enginelink serve`` prints the start-up lines, and refuses before
anything starts.
"""

from __future__ import annotations

import argparse

import pytest

from enginelink.machines.warmup import WarmupLevel
from enginelink.runtime.kv.kv_config import kv_events_enabled
from enginelink.runtime.contracts.shared.media import media_settings_from
from enginelink.tools import knobs, ref_flags, ref_settings, serve
from tests.harness import Servicer, free_port
from tests.test_operator import refused_with_one_line
from tests.test_operator import serve as serve_process


def namespace(*argv: str) -> argparse.Namespace:
    """``enginelink serve``'s parse of ``argv``: the reference's flags as every launcher hands them over."""
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(list(argv))


def resolve(*argv: str, env: dict[str, str] | None = None, contract: str = "vllm", engine: str = "sim"):
    return ref_settings.resolve(namespace(*argv), env or {}, contract, engine)


def test_flag_then_variable_then_default_with_the_source():
    env = {"SMG_VLLM_MM_MAX_ITEMS": "5", "SMG_VLLM_MM_MAX_INFLIGHT": "7", "SMG_VLLM_MM_FETCH_TIMEOUT_MS": "2500"}
    ref = resolve("--mm-processor", "inprocess", "--mm-max-items", "3", "--mm-video-fetch-timeout-ms", "900",
                  env=env)
    assert (ref.get("mm_max_items"), ref.source("mm_max_items")) == (3, "flag")  # the flag over its variable
    assert (ref.get("mm_max_inflight"), ref.source("mm_max_inflight")) == ("7", "SMG_VLLM_MM_MAX_INFLIGHT")
    assert (ref.get("mm_max_item_bytes"), ref.source("mm_max_item_bytes")) == (32 << 20, "default")
    assert "mm_max_items=3 (--mm-max-items)" in ref.line()
    assert "mm_max_inflight=7 (SMG_VLLM_MM_MAX_INFLIGHT)" in ref.line()
    assert "mm_max_item_bytes" not in ref.line()
    assert ref.media_line() == "worker-side media processing: inprocess (source=flag)"
    # What the flags decided reaches the media settings the fetcher runs with; the variables stay theirs.
    settings = media_settings_from({**env, **ref.exports})
    assert (settings.processor, settings.items_max, settings.inflight_max) == ("inprocess", 3, 7)
    assert (settings.fetch_timeout_s, settings.video_fetch_timeout_s) == (2.5, 0.9)
    assert resolve(env={"SMG_VLLM_MM_PROCESSOR": "off"}).media_line() == \
        "worker-side media processing: off (source=env)"
    assert media_settings_from({"SMG_VLLM_MM_PROCESSOR": "off"}).processor == ""  # the reference's spelling of off
    assert resolve().line() == "settings (flag > ENGINELINK_* > SMG_* > default): all at their defaults"


def test_each_contract_reads_its_own_reference_names(monkeypatch):
    for name in [n for n in __import__("os").environ if n.startswith(knobs.PREFIXES)]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("SMG_SGLANG_SERVICER_DRAIN_SECS", "7")
    monkeypatch.setenv("SMG_VLLM_SERVICER_DRAIN_SECS", "9")
    monkeypatch.setenv("SMG_TOKENSPEED_SERVICER_STARTUP_CEILING_SECS", "11")
    monkeypatch.setenv("SMG_SGLANG_SERVICER_SILENCE_TIMEOUT_SECS", "12")
    monkeypatch.setenv("SMG_TOKENSPEED_SERVICER_PREFILL_TOKENS_PER_SEC", "13")
    monkeypatch.setenv("SMG_SGLANG_SERVICER_STARTUP_TIMEOUT_SECS", "14")
    monkeypatch.setenv("SMG_TOKENSPEED_SERVICER_WARMUP", "off")
    monkeypatch.setenv("SMG_SGLANG_SERVICER_WARMUP", "fast:30")
    assert serve._seconds("drain_s", "sglang", 5.0) == 7.0  # the engine's own name
    assert serve._seconds("drain_s", "tokenspeed", 5.0) == 9.0  # no TokenSpeed name set: the vLLM one
    assert serve._seconds("drain_s", "vllm", 5.0) == 9.0
    assert serve._seconds("startup_ceiling_s", "tokenspeed", 14400.0) == 11.0
    assert serve._seconds("startup_ceiling_s", "sglang", 14400.0) == 14400.0  # another engine's: not read
    assert serve._seconds("silence_timeout_s", "sglang", 300.0, positive=True) == 12.0
    assert serve._seconds("prefill_tokens_per_s", "tokenspeed", 2000.0, positive=True) == 13.0
    assert serve._seconds("startup_timeout_s", "sglang", 1800.0) == 14.0
    assert serve._warmup("tokenspeed").level == WarmupLevel.OFF
    assert serve._warmup("sglang").level == "fast" and serve._warmup("sglang").budget_s == 30.0
    assert serve._warmup("vllm").level == "full"  # SMG_VLLM_SERVICER_WARMUP unset: the default
    monkeypatch.setenv("ENGINELINK_DRAIN_SECS", "3")  # enginelink's own name wins over every SMG_* one
    assert serve._seconds("drain_s", "sglang", 5.0) == 3.0
    env = {"SMG_SGLANG_SERVICER_KV_EVENTS": "0", "SMG_VLLM_SERVICER_KV_EVENTS": "1"}
    assert kv_events_enabled(env, knobs.names("kv_events", "sglang")) is False
    assert kv_events_enabled(env, knobs.names("kv_events", "vllm")) is True
    assert kv_events_enabled({**env, "ENGINELINK_KV_EVENTS": "on"}, knobs.names("kv_events", "sglang")) is True
    # Served VllmEngine, an SGLang name is named as not read.
    [line] = ref_settings.resolve(namespace(), {"SMG_SGLANG_SERVICER_DRAIN_SECS": "7"}, "vllm", "vllm").warnings
    assert line == ("SMG_SGLANG_SERVICER_DRAIN_SECS is read for the SglangScheduler contract; this servicer "
                    "serves VllmEngine: ignored")


def test_metrics_flag_then_the_contracts_name_then_the_vllm_name():
    env = {"SMG_SGLANG_SERVICER_METRICS_PORT": "9001", "SMG_VLLM_SERVICER_METRICS_PORT": "9002",
           "SMG_TOKENSPEED_SERVICER_METRICS_HOST": "127.0.0.3"}
    sglang = resolve(env=env, contract="sglang")
    assert (sglang.get("metrics_port"), sglang.source("metrics_port")) == ("9001", "SMG_SGLANG_SERVICER_METRICS_PORT")
    assert resolve(env=env, contract="vllm").get("metrics_port") == "9002"
    tokenspeed = resolve(env=env, contract="tokenspeed")
    assert tokenspeed.get("metrics_port") == "9002" and tokenspeed.get("metrics_host") == "127.0.0.3"
    flagged = resolve("--metrics-port", "9003", "--metrics-host", "::1", env=env, contract="sglang")
    assert (flagged.get("metrics_port"), flagged.source("metrics_port")) == (9003, "flag")
    assert "metrics_port=9003 (--metrics-port), metrics_host=::1 (--metrics-host)" in flagged.line()
    assert serve._metrics_port(namespace("--port", "50051"), sglang) == 9001
    with pytest.raises(serve.ConfigError, match="SMG_SGLANG_SERVICER_METRICS_PORT='x': expected a port number"):
        serve._metrics_port(namespace(), resolve(env={"SMG_SGLANG_SERVICER_METRICS_PORT": "x"}, contract="sglang"))


@pytest.mark.parametrize("argv, env, words", [
    (["--mm-processor", "smg"], {}, "smg's own media pipeline runs only inside the reference's Rust servicer"),
    ([], {"SMG_VLLM_MM_PROCESSOR": "SMG"}, "SMG_VLLM_MM_PROCESSOR=smg: smg's own media pipeline"),
])  # fmt: skip
def test_a_feature_enginelink_lacks_is_refused_naming_it(argv, env, words):
    [refusal] = resolve(*argv, env=env).refusals
    assert words in refusal
    # Without worker-side fetching, the engine's own media flags ask nothing of the servicer.
    assert not resolve("--allowed-media-domains", "example.com", "--media-io-kwargs", "{}").refusals
    # The servicer's fetcher enforces the allow-list (machines/media_policy.py), so with it on it is taken.
    ref = resolve("--mm-processor", "inprocess", "--allowed-media-domains", "example.com", "cdn.example")
    assert not ref.refusals and ref.get("allowed_media_domains") == "example.com,cdn.example"
    # vLLM's media-loader options are the media processor's too (the engine's arguments carry them to it).
    ref = resolve("--mm-processor", "inprocess", "--media-io-kwargs", '{"video": {"num_frames": 4}}')
    assert not ref.refusals and ref.get("media_io_kwargs") == '{"video": {"num_frames": 4}}'
    # A Rust-pipeline-only flag is a warning, not a refusal.
    ref = resolve("--mm-turbojpeg", "REQUIRE")
    assert not ref.refusals and ref.get("mm_turbojpeg") == "require"
    assert ref.warnings == ["--mm-turbojpeg is read only by smg's own Rust media pipeline (--mm-processor smg), "
                            "which enginelink does not run: ignored"]


def test_the_redis_sidecar_settings_are_taken_and_handed_on():
    ref = resolve("--mm-processor", "REDIS", "--mm-redis-url", "unix:///run/r.sock", "--mm-sidecar-timeout-ms",
                  "2500", "--mm-sidecar-max-queue", "9", "--mm-sidecar-namespace", "fleet-a",
                  env={"SMG_VLLM_MM_SIDECAR_MAX_QUEUE": "100"})
    assert not ref.refusals and ref.warnings == []
    assert ref.media_line() == "worker-side media processing: redis (source=flag)"
    assert "mm_sidecar_max_queue=9 (--mm-sidecar-max-queue)" in ref.line()
    settings = media_settings_from({"SMG_VLLM_MM_SIDECAR_MAX_QUEUE": "100", **ref.exports}, "flag")
    assert (settings.processor, settings.processor_source, settings.redis_url) == ("redis", "flag",
                                                                                  "unix:///run/r.sock")
    assert (settings.sidecar_timeout_s, settings.sidecar_queue_max, settings.sidecar_namespace) == (2.5, 9, "fleet-a")
    # The variables alone, as the reference reads them when no flag is given.
    settings = media_settings_from({"SMG_VLLM_MM_PROCESSOR": "redis", "SMG_VLLM_MM_SIDECAR_NAMESPACE": " ns "})
    assert (settings.processor_source, settings.sidecar_namespace, settings.sidecar_timeout_s) == ("env", "ns", 30.0)
    assert media_settings_from({}).redis_url == "redis://127.0.0.1:6379/0"  # the reference's default


@pytest.mark.process
def test_serve_exits_2_before_anything_starts_with_one_line_per_refusal(tmp_path):
    line = refused_with_one_line(serve_process(tmp_path, "--mm-processor", "smg", "--port", free_port()))
    assert line.startswith("enginelink serve: --mm-processor=smg: smg's own media pipeline")
    line = refused_with_one_line(serve_process(tmp_path, "--mm-sidecar-timeout-ms", "0", "--port", free_port()))
    assert line == ("enginelink serve: --mm-sidecar-timeout-ms (SMG_VLLM_MM_SIDECAR_TIMEOUT_MS)='0': must be at "
                    "least 1")
    done = serve_process(tmp_path, "--port", free_port(), env={"SMG_VLLM_MM_PROCESSOR": "smg"})
    assert "SMG_VLLM_MM_PROCESSOR=smg: smg's own media pipeline" in refused_with_one_line(done)
    assert not (tmp_path / "state").exists(), "refused before the test model or a journal was made"


INAPPLICABLE = knobs.of_status(knobs.INAPPLICABLE)


@pytest.mark.parametrize("knob", INAPPLICABLE, ids=[k.name for k in INAPPLICABLE])
def test_inapplicable_names_get_one_warning_each_naming_why(knob):
    contract = knob.contracts[0]
    [line] = knobs.environment_warnings({knob.name: "1"}, contract, "sim")
    assert line == f"{knob.name} cannot apply to enginelink: {knob.why}; ignored"
    # TokenSpeed's KV events are relayed from a real engine too (issue 33 item 5): no warning under either.
    for engine in ("tokenspeed", "sim"):
        assert knobs.environment_warnings({"SMG_TOKENSPEED_SERVICER_KV_EVENTS": "1"}, "tokenspeed", engine) == []


def test_an_honoured_name_that_cannot_apply_to_one_engine_says_so_under_that_engine_only(monkeypatch):
    import dataclasses

    kv = knobs.BY_NAME["SMG_TOKENSPEED_SERVICER_KV_EVENTS"]
    limited = dataclasses.replace(kv, unless_engine=("tokenspeed",), engine_why="not there")
    monkeypatch.setitem(knobs.BY_NAME, kv.name, limited)
    [line] = knobs.environment_warnings({kv.name: "1"}, "tokenspeed", "tokenspeed")
    assert line == f"{kv.name} cannot apply to --engine tokenspeed: not there; ignored"
    assert knobs.environment_warnings({kv.name: "1"}, "tokenspeed", "sim") == []


def test_router_names_are_listed_not_warned():
    router = {k.name: "1" for k in knobs.of_status(knobs.ROUTER)}
    assert {"SMG_MM_PROCESSING", "SMG_IMAGE_MAX_INPUT_BYTES", "SMG_VIDEO_MAX_INPUT_BYTES",
            "SMG_AUDIO_MAX_INPUT_BYTES"} <= set(router)
    selection = {k.name: "enginelink" for k in knobs.of_status(knobs.SELECTION)}
    honoured = {k.name: "1" for k in knobs.KNOBS if k.status == knobs.HONOURED and "vllm" in k.contracts}
    for contract in knobs.CONTRACTS:
        assert knobs.environment_warnings({**router, **selection}, contract, "sim") == []
    assert knobs.environment_warnings(honoured, "vllm", "vllm") == []


@pytest.mark.parametrize("typo, hint", [
    ("ENGINELINK_DRAN_SECS", "; did you mean ENGINELINK_DRAIN_SECS?"),
    ("SMG_VLLM_SERVICER_WARMPU", "; did you mean SMG_VLLM_SERVICER_WARMUP?"),
    ("SMG_SGLANG_SERVICER_SILENCE_TIMEOUT", "; did you mean SMG_SGLANG_SERVICER_SILENCE_TIMEOUT_SECS?"),
    ("ENGINELINK_QQQ", ""),
])  # fmt: skip
def test_a_typo_gets_the_closest_known_name(typo, hint):
    [line] = knobs.environment_warnings({typo: "1", "VLLM_SOMETHING": "1", "PATH": "/bin"}, "vllm", "sim")
    assert line == f"{typo} is not a variable enginelink or the reference servicer defines: ignored{hint}"


@pytest.mark.process
def test_the_start_up_lines_say_which_decided(tmp_path, test_model_dir):
    metrics = free_port()
    env = {"SMG_VLLM_SERVICER_DRAIN_SECS": "1", "SMG_SERVICER_WORKER_THREADS": "4", "ENGINELINK_DRAN_SECS": "1",
           "SMG_MM_PROCESSING": "worker", "SMG_VLLM_MM_MAX_ITEMS": "4"}
    servicer = Servicer(tmp_path, model_dir=test_model_dir, env=env,
                        extra=["--servicer-impl-source", "flag", "--mm-processor", "inprocess",
                               "--metrics-port", str(metrics)])
    with servicer:
        log = servicer.log()
    assert "INFO enginelink: servicer implementation: enginelink (source=flag)" in log
    assert "INFO enginelink: worker-side media processing: inprocess (source=flag)" in log
    assert ("INFO enginelink: settings (flag > ENGINELINK_* > SMG_* > default): mm_processor=inprocess "
            f"(--mm-processor), mm_max_items=4 (SMG_VLLM_MM_MAX_ITEMS), metrics_port={metrics} (--metrics-port), "
            "drain_s=1 (SMG_VLLM_SERVICER_DRAIN_SECS)") in log
    assert ("WARNING enginelink: SMG_SERVICER_WORKER_THREADS cannot apply to enginelink: it sizes the Rust "
            "servicer's tokio runtime") in log
    assert ("WARNING enginelink: ENGINELINK_DRAN_SECS is not a variable enginelink or the reference servicer "
            "defines: ignored; did you mean ENGINELINK_DRAIN_SECS?") in log
    assert "SMG_MM_PROCESSING" not in log


def test_the_reference_flags_are_one_definition():
    """Every launcher takes the same flags from ref_flags: the serve parser holds each, with its destination."""
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    actions = parser._option_string_actions
    for spec in ref_flags.MM_FLAGS:
        assert actions[spec.flag].dest == spec.dest
    for flag in ref_flags.MEDIA_FLAGS:
        assert flag in actions
