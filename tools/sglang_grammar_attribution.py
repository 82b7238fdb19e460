"""Naming a grammar's aborts inside SGLang's scheduler ranks (``SMG_SGLANG_ATTRIBUTE_GRAMMAR_ABORTS``).

SGLang 0.5.23 ends a request whose grammar refuses the token the model
sampled with an abort that says nothing of the grammar on the wire: its
result processor (``_accept_grammar_tokens``, ``_apply_prefill_grammar``) and
a PD decode side's first step (``process_prebuilt``) set
``FINISH_ABORT(..., 500, "InternalServerError")``, the same shape as any
internal fault. Only code inside the rank sees the cause, so these hooks
(registered through SGLang's plugin hook registry by ``tools/sglang_plugin.py``
when the variable is set, as ``runtime/contracts/sglang/launch.py`` sets it for the
ranks) stamp ``err_type = "GrammarRejectedToken"`` on a finish that appears
during a grammar advance. The servicer answers that name, and only that name,
with FAILED_PRECONDITION + ``smg-constraint-failed: engine``
(``wire/sglang.py`` ``abort_outcome``), as the reference's plugin and servicer do.

A finish already there before the advance is not the grammar's; a release
without one of the hooked paths keeps that path's aborts unnamed (logged).
Standard library only at import: this module runs in SGLang's processes, and
a test loads it by path in the SGLang venv.
"""

from __future__ import annotations

import logging
import pkgutil

GRAMMAR_ATTRIBUTION_ENV = "SMG_SGLANG_ATTRIBUTE_GRAMMAR_ABORTS"
GRAMMAR_REJECTED_ERR_TYPE = "GrammarRejectedToken"  # wire/sglang.py GRAMMAR_ERR_TYPE reads this name
GRAMMAR_REJECTED_MESSAGE = "the grammar rejected a sampled token"
_BARE_ABORT_MESSAGE = "Aborted"  # FINISH_ABORT()'s message when none was given

_RESULTS = "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"
_DECODE = "sglang.srt.disaggregation.decode_schedule_batch_mixin.ScheduleBatchDisaggregationDecodeMixin"

logger = logging.getLogger(__name__)


def enabled(environ) -> bool:
    return environ.get(GRAMMAR_ATTRIBUTION_ENV, "").strip() not in ("", "0")


def _stamp(req, before) -> None:
    """The finish ``req`` gained during a grammar advance is the grammar's rejection: name it."""
    finish = getattr(req, "to_finish", None)
    if finish is None or finish is before or not hasattr(finish, "err_type"):
        return
    finish.err_type = GRAMMAR_REJECTED_ERR_TYPE
    if getattr(finish, "message", None) in (None, _BARE_ABORT_MESSAGE):
        finish.message = GRAMMAR_REJECTED_MESSAGE


def around_grammar_advance(original, processor, *args, **kwargs):
    """AROUND ``_accept_grammar_tokens(req, tokens)`` / ``_apply_prefill_grammar(*, req, ...)``."""
    req = kwargs.get("req", args[0] if args else None)
    before = getattr(req, "to_finish", None)
    result = original(processor, *args, **kwargs)
    if req is not None:
        _stamp(req, before)
    return result


def around_prebuilt(original, batch, *args, **kwargs):
    """AROUND ``process_prebuilt``: it advances every grammar of the batch over the last prefilled token."""
    watched = [(req, getattr(req, "to_finish", None)) for req in (getattr(batch, "reqs", None) or ())
               if getattr(req, "grammar", None) is not None]
    result = original(batch, *args, **kwargs)
    for req, before in watched:
        _stamp(req, before)
    return result


HOOKS = ((f"{_RESULTS}._accept_grammar_tokens", around_grammar_advance),
         (f"{_RESULTS}._apply_prefill_grammar", around_grammar_advance),
         (f"{_DECODE}.process_prebuilt", around_prebuilt))


def _exists(target: str) -> bool:
    owner, _, name = target.rpartition(".")
    try:
        return callable(getattr(pkgutil.resolve_name(owner), name, None))
    except Exception:  # noqa: BLE001 - a module this release lacks, or one that cannot import here
        return False


def register() -> list[str]:
    """Register the hooks with SGLang's hook registry (applied by SGLang before its engine starts);
    the targets registered."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    registered = []
    for target, hook in HOOKS:
        if not _exists(target):
            logger.info("enginelink: %s is not in this SGLang release; its grammar aborts stay unnamed", target)
            continue
        HookRegistry.register(target, hook, HookType.AROUND)
        registered.append(target)
    return registered
