"""The vLLM plugin's parse-side work, on argparse parsers shaped like ``vllm serve``'s.

The real launcher (vLLM's ``vllm`` command, the handover, the engine, the
router) is tests/vllm/test_vllm_launcher_plugin.py; these need no vLLM.
"""

from __future__ import annotations

import argparse
import sys

import pytest

from enginelink.runtime.contracts.vllm.capture_cap import CAPTURE_CAP_ENV
from enginelink.tools import vllm_plugin
from enginelink.tools.vllm_grpc_launcher import LISTEN_HOST_DEFAULT, serve_namespace, split_engine_args

ENGINE_DESTS = {"model", "max_model_len", "enforce_eager", "served_model_name", "max_logprobs",
                "tensor_parallel_size", "enable_prefix_caching", "max_num_seqs", "compilation_config",
                "max_cudagraph_capture_size", "speculative_config", "cudagraph_capture_sizes",
                "max_num_batched_tokens"}


def serve_parser() -> argparse.ArgumentParser:
    """The shape of ``vllm serve``'s parser: front-end flags beside the engine's."""
    p = argparse.ArgumentParser()
    p.add_argument("model_tag", nargs="?")
    p.add_argument("--grpc", action="store_true")
    p.add_argument("--headless", action="store_true")
    p.add_argument("--host")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--uvicorn-log-level")
    p.add_argument("--api-key")
    p.add_argument("--max-model-len")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--max-cudagraph-capture-size", type=int)
    p.add_argument("--cudagraph-capture-sizes", nargs="+", type=int)
    p.add_argument("--compilation-config")
    p.add_argument("--speculative-config")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--served-model-name", nargs="+")
    p.add_argument("--max-logprobs", type=int)
    p.add_argument("--tensor-parallel-size", "-tp", type=int)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction)
    return p


def test_engine_arguments_are_kept_and_front_end_flags_named():
    parser = serve_parser()
    vllm_plugin.add_flags(parser)
    args = ["/models/m", "--grpc", "--servicer-impl", "enginelink", "--host", "127.0.0.1", "--port=5000",
            "--max-model-len", "1024", "--enforce-eager", "--served-model-name", "a", "b", "--max-logprobs", "-1",
            "-tp", "2", "--no-enable-prefix-caching", "--uvicorn-log-level", "warning", "--api-key=s3cret",
            "--metrics-port", "9000"]
    kept, unused = split_engine_args(parser, args, ENGINE_DESTS)
    assert kept == ["--max-model-len", "1024", "--enforce-eager", "--served-model-name", "a", "b",
                    "--max-logprobs", "-1", "-tp", "2", "--no-enable-prefix-caching"]
    assert unused == ["--uvicorn-log-level", "--api-key"]  # named, never their values


def test_the_servicer_gets_the_launchers_listener_and_metrics():
    parsed = argparse.Namespace(model="/models/m", host=None, port=5000, metrics_port=9000, metrics_host=None)
    ns = serve_namespace(parsed, ["--enforce-eager"])
    assert (ns.engine, str(ns.model), ns.host, ns.port, ns.metrics_port) == ("vllm", "/models/m",
                                                                            LISTEN_HOST_DEFAULT, 5000, 9000)
    assert LISTEN_HOST_DEFAULT == "0.0.0.0"  # vLLM's gRPC launcher binds every interface by default
    assert serve_namespace(argparse.Namespace(model="m", host="::1", port=1), []).host == "::1"


def test_flags_join_the_serve_parser_once_and_extend_the_references():
    parser = serve_parser()
    vllm_plugin.add_flags(parser)
    vllm_plugin.add_flags(parser)  # a second parse of the same parser
    parsed = parser.parse_args(["m", "--grpc", "--servicer-impl", "enginelink", "--metrics-port", "9000",
                                "--metrics-host", "0.0.0.0"])
    assert (parsed.servicer_impl, parsed.metrics_port, parsed.metrics_host) == ("enginelink", 9000, "0.0.0.0")
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--servicer-impl", "golang"])
    # The reference package's plugin came first: enginelink becomes one of its flag's choices.
    reference = serve_parser()
    reference.add_argument("--servicer-impl", choices=("python", "rust"))
    vllm_plugin.add_flags(reference)
    assert reference.parse_args(["m", "--servicer-impl", "enginelink"]).servicer_impl == "enginelink"


@pytest.mark.parametrize("flag, env, selected", [
    ("enginelink", {}, "enginelink"),
    (None, {"SMG_VLLM_SERVICER_IMPL": "enginelink"}, "enginelink"),
    (None, {"SMG_VLLM_SERVICER_IMPL": " EngineLink "}, "enginelink"),
    ("python", {"SMG_VLLM_SERVICER_IMPL": "enginelink"}, "python"),  # the flag wins
    (None, {}, None),
])
def test_selection_flag_then_environment(flag, env, selected):
    assert vllm_plugin.selected_impl(argparse.Namespace(servicer_impl=flag), env) == selected


def test_only_a_grpc_parse_that_selects_enginelink_hands_over(monkeypatch):
    monkeypatch.setattr(vllm_plugin, "_handover", None)
    monkeypatch.setattr(vllm_plugin, "take_over_launcher", lambda: None)
    monkeypatch.delenv("SMG_VLLM_SERVICER_IMPL", raising=False)
    parser = serve_parser()
    vllm_plugin.add_flags(parser)
    for args in (["m"], ["m", "--grpc"], ["m", "--servicer-impl", "enginelink"]):
        vllm_plugin.after_parse(parser, args, parser.parse_args(args))
        assert vllm_plugin.handover() is None, args
    args = ["m", "--grpc", "--servicer-impl", "enginelink", "--enforce-eager"]
    vllm_plugin.after_parse(parser, args, parser.parse_args(args))
    assert vllm_plugin.handover().args == args and vllm_plugin.handover().parser is parser


def test_a_headless_worker_parse_gets_the_capture_cap(monkeypatch):
    monkeypatch.delenv(CAPTURE_CAP_ENV, raising=False)
    parser = serve_parser()
    vllm_plugin.add_flags(parser)
    parsed = parser.parse_args(["m", "--headless", "--max-num-seqs", "32"])
    vllm_plugin.after_parse(parser, None, parsed)
    assert parsed.max_cudagraph_capture_size == 512
    parsed = parser.parse_args(["m", "--headless", "--max-num-seqs", "32", "--enforce-eager"])
    vllm_plugin.after_parse(parser, None, parsed)
    assert parsed.max_cudagraph_capture_size is None
    parsed = parser.parse_args(["m", "--max-num-seqs", "32"])  # an HTTP vllm serve: the engine's own default
    vllm_plugin.after_parse(parser, None, parsed)
    assert parsed.max_cudagraph_capture_size is None


def test_a_bad_knob_on_a_headless_parse_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setenv(CAPTURE_CAP_ENV, "lots")
    parser = serve_parser()
    parsed = parser.parse_args(["m", "--headless", "--max-num-seqs", "32"])
    with pytest.raises(SystemExit) as exit_:
        vllm_plugin.after_parse(parser, None, parsed)
    assert exit_.value.code == 2 and CAPTURE_CAP_ENV in capsys.readouterr().err


# -- the reference's flags (issue 32 item 3) ---------------------------------------------------


def test_the_references_flags_join_a_grpc_parser_and_reach_the_servicer():
    from enginelink.tools import ref_flags, ref_settings

    parser = serve_parser()
    ref_flags.add_media_arguments(parser)  # vLLM's own engine flags, as its parser defines them
    vllm_plugin.add_flags(parser)
    args = ["/models/m", "--grpc", "--servicer-impl", "enginelink", "--mm-processor", "InProcess",
            "--mm-max-items", "3", "--mm-max-item-bytes", "1000", "--mm-fetch-timeout-ms", "500",
            "--allowed-local-media-path", "/media", "--allowed-media-domains", "a.example", "b.example",
            "--metrics-port", "9000", "--metrics-host", "127.0.0.2", "--max-model-len", "1024"]
    parsed = parser.parse_args(args)
    parsed.model = parsed.model_tag  # as vllm serve's subcommand sets it
    kept, unused = split_engine_args(parser, args, ENGINE_DESTS | {"allowed_local_media_path",
                                                                  "allowed_media_domains"})
    # The servicer's flags are not the engine's; vLLM's media flags are both.
    assert kept == ["--allowed-local-media-path", "/media", "--allowed-media-domains", "a.example", "b.example",
                    "--max-model-len", "1024"]
    assert unused == []
    ns = serve_namespace(parsed, kept, selected_by="flag")
    assert (ns.mm_processor, ns.mm_max_items, ns.allowed_media_domains) == ("inprocess", 3, ["a.example",
                                                                                          "b.example"])
    assert ns.servicer_impl_source == "flag"
    ref = ref_settings.resolve(ns, {"SMG_VLLM_MM_MAX_ITEMS": "9", "SMG_VLLM_MM_MAX_INFLIGHT": "4"}, "vllm", "vllm")
    assert {k: ref.source(k) for k in ("mm_processor", "mm_max_items", "mm_max_inflight", "mm_max_item_bytes",
                                       "metrics_port", "metrics_host")} == {
        "mm_processor": "flag", "mm_max_items": "flag", "mm_max_inflight": "SMG_VLLM_MM_MAX_INFLIGHT",
        "mm_max_item_bytes": "flag", "metrics_port": "flag", "metrics_host": "flag"}
    assert ref.exports["ENGINELINK_ALLOWED_LOCAL_MEDIA_PATH"] == "/media"


def test_the_stock_launchers_own_parser_serves_grpc_when_it_runs_as_main(monkeypatch):
    """``python -m vllm.entrypoints.launchers.grpc_server``: no --grpc, its --port, run as __main__; with the
    reference installed its module is the running one, and selecting enginelink rebinds its serve_grpc."""
    import types

    stock = argparse.ArgumentParser()
    stock.add_argument("--port", type=int, default=50051)
    stock.add_argument("--model")
    assert not vllm_plugin.serves_grpc(stock)  # any other program's parser is left alone
    main = types.ModuleType("__main__")
    main.__spec__ = types.SimpleNamespace(name="vllm.entrypoints.launchers.grpc_server")
    main.serve_grpc = "the stock one"
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(vllm_plugin, "_handover", None)
    monkeypatch.setenv("SMG_VLLM_SERVICER_IMPL", "enginelink")
    assert vllm_plugin.serves_grpc(stock)
    vllm_plugin.add_flags(stock)
    parsed = stock.parse_args(["--model", "/m", "--mm-processor", "inprocess"])
    vllm_plugin.after_parse(stock, ["--model", "/m", "--mm-processor", "inprocess"], parsed)
    assert vllm_plugin.handover().source == "env"
    from enginelink.tools import vllm_grpc_launcher
    assert main.serve_grpc is vllm_grpc_launcher.serve_grpc


@pytest.mark.parametrize("argv, env, taken", [
    (["python", "-m", "vllm.entrypoints.launchers.grpc_server", "--servicer-impl", "enginelink"], {}, True),
    (["python", "-X", "dev", "-m", "vllm.entrypoints.grpc_server", "--model", "m"],
     {"SMG_VLLM_SERVICER_IMPL": "enginelink"}, True),
    (["python", "-mvllm.entrypoints.grpc_server", "--servicer-impl=enginelink"], {}, True),
    (["python", "-m", "vllm.entrypoints.launchers.grpc_server", "--servicer-impl", "python"],
     {"SMG_VLLM_SERVICER_IMPL": "enginelink"}, False),  # the flag wins
    (["python", "-m", "vllm.entrypoints.launchers.grpc_server"], {}, False),  # not selected
    (["python", "-m", "vllm.entrypoints.launchers.grpc_server", "--servicer-impl", "enginelink"],
     {"VLLM_PLUGINS": "someone-else"}, False),  # VLLM_PLUGINS leaves enginelink out
    (["python", "-m", "vllm.entrypoints.cli.main", "--servicer-impl", "enginelink"], {}, False),
    (["python", "-c", "-m vllm.entrypoints.grpc_server", "--servicer-impl", "enginelink"], {}, False),
    (["python", "script.py", "-m", "vllm.entrypoints.grpc_server"], {"SMG_VLLM_SERVICER_IMPL": "enginelink"}, False),
])  # fmt: skip
def test_the_start_up_hook_takes_only_a_selected_python_m_launcher(argv, env, taken, monkeypatch):
    from enginelink.tools import vllm_launch_hook

    before = list(sys.meta_path)
    try:
        assert vllm_launch_hook.install(argv, env) is taken
        assert (sys.meta_path != before) is taken
        if taken:
            spec = sys.meta_path[0].find_spec(vllm_launch_hook.TARGET)
            assert spec.origin == str(vllm_launch_hook.SUBSTITUTE) and spec.loader.get_code(spec.name)
    finally:
        sys.meta_path[:] = before
