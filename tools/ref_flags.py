"""The reference servicer's launcher flags, as enginelink's parsers take them.

The reference (smg-grpc-servicer 0.14.1) adds flags to the engines' own
launchers through its plugins: ``--servicer-impl``, ``--metrics-port`` and
``--metrics-host`` on vLLM's, SGLang's and TokenSpeed's; the ``--mm-*``
media flags on vLLM's gRPC parsers. A user who swaps the reference for
enginelink keeps the same command lines, so enginelink's launchers add the
same flags under the same names and destinations, and ``enginelink serve``
takes them too. This module is the one definition: the flags, their
variables (a flag falls back to its ``SMG_*`` variable, then its default:
the reference's precedence) and the registration the launchers share.

Standard library only, on purpose: the vLLM and SGLang plugins import it in
every engine process, and ``tools/tokenspeed_entry.py`` runs under the
TokenSpeed venv's interpreter, where enginelink's dependencies are absent.
What enginelink does with each value (honoured, refused, warned about) is
decided at start-up (``tools/ref_settings.py``), not here.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

SERVICER_IMPL_FLAG = "--servicer-impl"
IMPL = "enginelink"
# The reference's own values, kept as choices so the flag means the same with or without it.
REFERENCE_IMPLS = ("python", "rust")
METRICS_PORT_FLAG = "--metrics-port"
METRICS_HOST_FLAG = "--metrics-host"

# The processor modes the reference's flag takes; enginelink serves off, inprocess and redis.
MM_MODES = ("off", "inprocess", "redis", "smg")
TURBOJPEG_POLICIES = ("prefer", "require")


@dataclass(frozen=True)
class MmFlag:
    """One of the reference's ``--mm-*`` flags: ``MmSettings`` in its ``vllm/mm_processor.py``."""

    setting: str  # the reference's setting name; the namespace destination is ``mm_<setting>``
    flag: str
    env: str
    default: Any  # the reference's default (None: unset)
    kind: str  # "mode", "policy", "int" or "text"
    help: str

    @property
    def dest(self) -> str:
        return f"mm_{self.setting}"


MM_FLAGS: tuple[MmFlag, ...] = (
    MmFlag("processor", "--mm-processor", "SMG_VLLM_MM_PROCESSOR", "off", "mode",
           "worker-side media processing: off (the router preprocesses media), inprocess (this worker fetches "
           "media_refs and runs the model's own processor) or redis (a media sidecar beside a private Redis does, "
           "`enginelink media-sidecar`); smg is the reference's Rust pipeline and refused"),
    MmFlag("max_inflight", "--mm-max-inflight", "SMG_VLLM_MM_MAX_INFLIGHT", 64, "int",
           "requests this worker fetches media for at once (one more: UNAVAILABLE)"),
    MmFlag("max_item_bytes", "--mm-max-item-bytes", "SMG_VLLM_MM_MAX_ITEM_BYTES", 32 * 1024 * 1024, "int",
           "one media item, fetched or decoded (data:), in bytes"),
    MmFlag("max_items", "--mm-max-items", "SMG_VLLM_MM_MAX_ITEMS", None, "int",
           "items of one modality one request may carry, media refs and router tensors alike: tightens the "
           "engine's --limit-mm-per-prompt, never loosens it (unset: the engine's limits)"),
    MmFlag("redis_url", "--mm-redis-url", "SMG_VLLM_MM_REDIS_URL", "redis://127.0.0.1:6379/0", "text",
           "the media sidecar's Redis URL (--mm-processor redis)"),
    MmFlag("sidecar_timeout_ms", "--mm-sidecar-timeout-ms", "SMG_VLLM_MM_SIDECAR_TIMEOUT_MS", 30_000, "int",
           "the media sidecar's result wait, ms; it travels with each job as its deadline (--mm-processor redis)"),
    MmFlag("sidecar_max_queue", "--mm-sidecar-max-queue", "SMG_VLLM_MM_SIDECAR_MAX_QUEUE", 256, "int",
           "jobs waiting for the media sidecar past which a request is UNAVAILABLE at once (--mm-processor redis)"),
    MmFlag("sidecar_namespace", "--mm-sidecar-namespace", "SMG_VLLM_MM_SIDECAR_NAMESPACE", None, "text",
           "the media sidecar's Redis key namespace, instead of the one derived from the fingerprint "
           "(--mm-processor redis)"),
    MmFlag("turbojpeg", "--mm-turbojpeg", "SMG_VLLM_MM_TURBOJPEG", "prefer", "policy",
           "libjpeg-turbo policy of smg's own Rust media pipeline (--mm-processor smg): validated, not read by "
           "enginelink"),
    MmFlag("fetch_timeout_ms", "--mm-fetch-timeout-ms", "SMG_VLLM_MM_FETCH_TIMEOUT_MS", 10_000, "int",
           "one image/audio item's fetch, connect to last byte, ms"),
    MmFlag("video_fetch_timeout_ms", "--mm-video-fetch-timeout-ms", "SMG_VLLM_MM_VIDEO_FETCH_TIMEOUT_MS", 30_000,
           "int", "one video item's fetch, connect to last byte, ms"),
)
MM_BY_FLAG = {spec.flag: spec for spec in MM_FLAGS}

# vLLM's own engine flags for worker-side media, which enginelink's servicer reads as well
# (its fetcher is the worker's). vLLM's parser defines them; other launchers get enginelink's.
MEDIA_FLAGS = ("--allowed-local-media-path", "--allowed-media-domains", "--media-io-kwargs")


def _choice(value: str) -> str:
    """A choice as the reference reads it: any case, blanks around it dropped."""
    return value.strip().lower()


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return parser._option_string_actions  # argparse's registry of option strings


def add_servicer_impl_argument(parser: argparse.ArgumentParser, *, env: str, help: str,
                               export: bool = False) -> None:
    """``--servicer-impl`` where missing, else ``enginelink`` added to the reference's own flag's choices
    (its plugin registered first): the flag then means the same with or without the reference installed.
    With ``export`` the value also goes to ``env``, for a launcher whose namespace drops it."""
    existing = _actions(parser).get(SERVICER_IMPL_FLAG)
    if existing is None:
        kwargs: dict[str, Any] = {"dest": "servicer_impl", "default": None, "type": _choice,
                                  "choices": (*REFERENCE_IMPLS, IMPL), "help": f"{help} (default: ${env})"}
        if export:
            kwargs.update(action=EnvStoreAction, env_name=env)
        parser.add_argument(SERVICER_IMPL_FLAG, **kwargs)
    elif existing.choices is not None and IMPL not in existing.choices:
        existing.choices = (*existing.choices, IMPL)


class EnvStoreAction(argparse._StoreAction):  # SGLang's --config merger takes store actions only
    """A store action that also exports the value under its variable: a launcher whose namespace keeps
    only the engine's own fields (SGLang's ``ServerArgs``) still hands the flag on, as the reference's does."""

    def __init__(self, *args: Any, env_name: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.env_name = env_name

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        super().__call__(parser, namespace, values, option_string)
        if values is not None:
            os.environ[self.env_name] = str(values)


def add_metrics_arguments(parser: argparse.ArgumentParser, *, port_env: str, host_env: str,
                          export: bool = False) -> bool:
    """``--metrics-port`` / ``--metrics-host`` (the servicer's Prometheus endpoint) where missing; with
    ``export`` their values also go to ``port_env`` / ``host_env``. Returns whether they were added."""
    if METRICS_PORT_FLAG in _actions(parser):
        return False

    def exported(env: str) -> dict[str, Any]:
        return {"action": EnvStoreAction, "env_name": env} if export else {}

    parser.add_argument(METRICS_PORT_FLAG, dest="metrics_port", type=int, default=None, **exported(port_env),
                        help=f"the servicer's Prometheus /metrics port (default: ${port_env}, else no endpoint)")
    if METRICS_HOST_FLAG not in _actions(parser):
        parser.add_argument(METRICS_HOST_FLAG, dest="metrics_host", default=None, **exported(host_env),
                            help=f"the metrics listener's host (default: ${host_env}, else the gRPC --host)")
    return True


def add_mm_arguments(parser: argparse.ArgumentParser) -> list[str]:
    """The reference's ``--mm-*`` flags where missing (a parser that has one keeps its own); the flags added.
    Each defaults to None: unset falls back to its ``SMG_VLLM_MM_*`` variable, then its default."""
    added = []
    for spec in MM_FLAGS:
        if spec.flag in _actions(parser):
            continue
        kwargs: dict[str, Any] = {"dest": spec.dest, "default": None, "help": f"{spec.help} (default: ${spec.env}, "
                                  f"else {spec.default if spec.default is not None else 'unset'})"}
        if spec.kind == "mode":
            kwargs.update(type=_choice, choices=MM_MODES)
        elif spec.kind == "policy":
            kwargs.update(type=_choice, choices=TURBOJPEG_POLICIES)
        elif spec.kind == "int":
            kwargs["type"] = int
        parser.add_argument(spec.flag, **kwargs)
        added.append(spec.flag)
    return added


def add_media_arguments(parser: argparse.ArgumentParser) -> list[str]:
    """vLLM's own media flags (``--allowed-local-media-path``, ``--allowed-media-domains``,
    ``--media-io-kwargs``) where missing, with vLLM's destinations; the flags added."""
    added = []
    actions = _actions(parser)
    if "--allowed-local-media-path" not in actions:
        parser.add_argument("--allowed-local-media-path", dest="allowed_local_media_path", default=None,
                            metavar="DIR", help="accept file: media refs under DIR (default: "
                                                "$ENGINELINK_ALLOWED_LOCAL_MEDIA_PATH, else none)")
        added.append("--allowed-local-media-path")
    if "--allowed-media-domains" not in actions:
        parser.add_argument("--allowed-media-domains", dest="allowed_media_domains", nargs="+", default=None,
                            metavar="DOMAIN", help="fetch media refs from these domains only (default: any)")
        added.append("--allowed-media-domains")
    if "--media-io-kwargs" not in actions:
        parser.add_argument("--media-io-kwargs", dest="media_io_kwargs", default=None, metavar="JSON",
                            help="vLLM's media loaders' options per modality, JSON (the vLLM engine's, and the "
                                 "media processor's with --mm-processor inprocess)")
        added.append("--media-io-kwargs")
    return added


def mm_values(namespace: Any) -> dict[str, Any]:
    """The ``--mm-*`` values a parsed namespace carries (absent or unset ones left out), by setting."""
    return {spec.setting: getattr(namespace, spec.dest) for spec in MM_FLAGS
            if getattr(namespace, spec.dest, None) is not None}


def mm_argv(values: dict[str, Any]) -> list[str]:
    """``--mm-*`` settings as command-line words (for a launcher that hands over by argv)."""
    words: list[str] = []
    for spec in MM_FLAGS:
        if values.get(spec.setting) is not None:
            words += [spec.flag, str(values[spec.setting])]
    return words
