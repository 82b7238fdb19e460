"""The grammar labels SGLang and TokenSpeed workers advertise in ``GetServerInfo.server_args``.

The router reads three keys there (``reference/sglang-contract.md`` §4,
``tokenspeed.md`` §4): ``grammar_backend`` (the backend the scheduler runs, so
a constraint it cannot enforce is refused ahead of it), ``engine_reasoning_parser``
and ``constrained_decoding_start`` (where the scheduler starts a request's
grammar on a thinking prompt, so a forced tool call is shaped to fit). Each is
derived from the engine's *resolved* arguments, never assumed:

- SGLang (from the scheduler's own resolution, which the launch script
  reports as ``server_args`` in the ready report): no backend at all under
  ``--skip-tokenizer-init`` (its grammar manager builds none), else
  ``--grammar-backend`` as resolved, ``xgrammar`` when unset (SGLang's
  default); with a reasoning parser the scheduler defers the grammar past
  the thought (``after_reasoning``), else ``first_token``; an unresolved
  ``auto`` says nothing;
- TokenSpeed 0.1.1 (from its arguments; its ``ServerArgs`` resolves neither
  flag further): ``--grammar-backend`` (``none`` when unset, its default),
  always ``first_token`` (its grammar manager takes no reasoning flag), and
  the ``constrained_decoding`` policy only when the arguments declare one.

Pure functions over plain dicts and argv lists; no engine import.
"""

from __future__ import annotations

from typing import Any, Sequence

GRAMMAR_BACKEND_KEY = "grammar_backend"
ENGINE_REASONING_PARSER_KEY = "engine_reasoning_parser"
CONSTRAINED_DECODING_START_KEY = "constrained_decoding_start"
AFTER_REASONING = "after_reasoning"
FIRST_TOKEN = "first_token"
NO_BACKEND = "none"
SGLANG_DEFAULT_BACKEND = "xgrammar"
TOKENSPEED_DEFAULT_BACKEND = "none"  # tokenspeed 0.1.1 ServerArgs.grammar_backend
CONSTRAINED_DECODING_POLICIES = ("requested", "always")


def sglang_grammar_backend(server_args: dict[str, Any]) -> str:
    """The backend SGLang's scheduler builds (``constrained/grammar_manager.py``): none without its tokenizer."""
    if server_args.get("skip_tokenizer_init"):
        return NO_BACKEND
    return str(server_args.get("grammar_backend") or SGLANG_DEFAULT_BACKEND)


def _parser(value: Any) -> str:
    """A resolved reasoning parser's name; "" for none, and for an ``auto`` the engine has not resolved."""
    return "" if value in (None, "", "auto") else str(value)


def sglang_labels(server_args: dict[str, Any]) -> dict[str, str]:
    """The three keys for an SGLang scheduler, from its resolved ``server_args``."""
    labels = {GRAMMAR_BACKEND_KEY: sglang_grammar_backend(server_args)}
    raw = server_args.get("reasoning_parser")
    parser = _parser(raw)
    if parser:
        labels[ENGINE_REASONING_PARSER_KEY] = parser
        labels[CONSTRAINED_DECODING_START_KEY] = AFTER_REASONING
    elif raw != "auto":
        labels[CONSTRAINED_DECODING_START_KEY] = FIRST_TOKEN
    return labels


def _flag(argv: Sequence[str], flag: str) -> str | None:
    value = None
    for index, arg in enumerate(argv):
        if arg == flag and index + 1 < len(argv):
            value = argv[index + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def tokenspeed_labels(engine_args: Sequence[str]) -> tuple[dict[str, str], str]:
    """(the ``server_args`` keys, the ``constrained_decoding`` policy or "") for a TokenSpeed engine's argv."""
    labels = {GRAMMAR_BACKEND_KEY: _flag(engine_args, "--grammar-backend") or TOKENSPEED_DEFAULT_BACKEND}
    parser = _parser(_flag(engine_args, "--reasoning-parser"))
    if parser:
        labels[ENGINE_REASONING_PARSER_KEY] = parser
    labels[CONSTRAINED_DECODING_START_KEY] = FIRST_TOKEN
    policy = (_flag(engine_args, "--constrained-decoding") or "").strip().lower()
    return labels, policy if policy in CONSTRAINED_DECODING_POLICIES else ""
