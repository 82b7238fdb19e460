"""Where the servicer's fetcher gets ``--allowed-media-domains``: enginelink's flag, vLLM's among the engine
arguments (``vllm serve ... --allowed-media-domains``), or ``ENGINELINK_ALLOWED_MEDIA_DOMAINS``; a list that
cannot be one is refused at start (exit 2). The enforcement itself: tests/adversarial/test_adv_media*.py."""

from __future__ import annotations

import argparse
import os

import pytest

from enginelink.runtime.contracts.shared.media import ALLOWED_DOMAINS_ENV, media_settings_from
from enginelink.tools import serve
from tests.test_operator import refused_with_one_line
from tests.test_operator import serve as serve_process


def _domains(monkeypatch, ours=None, engine_args=()) -> tuple[str, ...]:
    monkeypatch.delenv(ALLOWED_DOMAINS_ENV, raising=False)
    serve._allowed_media_domains(argparse.Namespace(allowed_media_domains=ours, engine_args=list(engine_args)))
    return media_settings_from(os.environ).allowed_domains


def test_vllms_own_flag_among_the_engine_arguments_reaches_the_fetcher(monkeypatch):
    args = ["--max-model-len", "1024", "--allowed-media-domains", "a.example", "B.example", "--enforce-eager"]
    assert _domains(monkeypatch, engine_args=args) == ("a.example", "b.example")
    assert _domains(monkeypatch, engine_args=["--allowed-media-domains=a.example"]) == ("a.example",)


def test_enginelinks_flag_and_the_same_engine_flag_agree_or_are_refused(monkeypatch):
    assert _domains(monkeypatch, ["a.example"], ["--allowed-media-domains", "A.example."]) == ("a.example",)
    with pytest.raises(serve.ConfigError, match="differ; give one list"):
        _domains(monkeypatch, ["a.example"], ["--allowed-media-domains", "b.example"])


def test_the_variable_stands_when_no_flag_is_given(monkeypatch):
    monkeypatch.setenv(ALLOWED_DOMAINS_ENV, "c.example")
    serve._allowed_media_domains(argparse.Namespace(allowed_media_domains=None, engine_args=[]))
    assert media_settings_from(os.environ).allowed_domains == ("c.example",)


@pytest.mark.process
@pytest.mark.parametrize("value", ["https://example.com", "example.com:8443", "example.com/images"])
def test_a_url_for_a_domain_is_refused_at_start(tmp_path, value):
    line = refused_with_one_line(serve_process(tmp_path, "--mm-processor", "inprocess", "--allowed-media-domains",
                                               value))
    assert repr(value) in line and "not a host name" in line
