"""The mlx-lm API check, run by the MLX venv's python before the engine starts.

``python -m enginelink.tools.mlx_check`` prints one JSON object:
``{"mlx": VERSION, "mlx_lm": VERSION, "enginelink": CHECKOUT, "problems": [...]}``
and exits 0 when ``problems`` is empty, 1 otherwise. ``enginelink serve
--engine mlx`` runs it (``runtime/contracts/mlx/launch.py``) and refuses to launch, exit
2, naming each problem, as the vLLM launch compares struct layouts.

What is checked is what ``tools/mlx_engine.py`` calls, by signature, not by
version number: mlx-lm moved this API between minor releases (its
``SequenceStateMachine`` exists only in 0.31.2-0.31.3, reference/mlx.md §3.3).

Rules: imports only the standard library, mlx and mlx-lm, and enginelink's
wire (to say which checkout's codec this venv runs).
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

# The releases this build was written and tested against (tools/setup-mlx pins them).
MLX_PINNED = "0.32.4"
MLX_LM_PINNED = "0.31.3"

# name -> parameters that must exist on it
_NEEDED_PARAMS = {
    "BatchGenerator.__init__": ("model", "completion_batch_size", "prefill_batch_size", "prefill_step_size"),
    "BatchGenerator.insert": ("prompts", "max_tokens", "samplers", "logits_processors", "state_machines"),
    "SequenceStateMachine.__init__": ("transitions", "initial"),
    "make_logits_processors": ("logit_bias", "repetition_penalty"),
}
_NEEDED_METHODS = ("BatchGenerator.next", "BatchGenerator.remove", "BatchGenerator.close")


def _params(obj) -> set[str]:
    return set(inspect.signature(obj).parameters)


def check() -> dict:
    problems: list[str] = []
    report: dict = {"problems": problems}
    try:
        import mlx.core as mx

        report["mlx"] = getattr(mx, "__version__", "?")
        report["device"] = str(mx.default_device())
    except Exception as exc:  # noqa: BLE001 - any import failure is the report's content
        problems.append(f"import mlx.core failed: {exc} (install mlx[cpu]=={MLX_PINNED}: tools/setup-mlx)")
        return report
    try:
        import importlib

        import mlx_lm

        # By module path: ``mlx_lm.generate`` the attribute is the generate() function.
        generate = importlib.import_module("mlx_lm.generate")
        sample_utils = importlib.import_module("mlx_lm.sample_utils")

        report["mlx_lm"] = getattr(mlx_lm, "__version__", "?")
    except Exception as exc:  # noqa: BLE001
        problems.append(f"import mlx_lm failed: {exc} (install mlx-lm=={MLX_LM_PINNED}: tools/setup-mlx)")
        return report
    names = {
        "BatchGenerator": getattr(generate, "BatchGenerator", None),
        "SequenceStateMachine": getattr(generate, "SequenceStateMachine", None),
        "make_logits_processors": getattr(sample_utils, "make_logits_processors", None),
        "load": getattr(mlx_lm, "load", None),
    }
    for name, obj in names.items():
        if obj is None:
            problems.append(f"mlx_lm {report['mlx_lm']} has no {name} (built against mlx-lm {MLX_LM_PINNED})")
    for dotted, wanted in _NEEDED_PARAMS.items():
        owner, _, attr = dotted.partition(".")
        obj = names.get(owner)
        if obj is None:
            continue
        target = getattr(obj, attr) if attr else obj
        missing = [p for p in wanted if p not in _params(target)]
        if missing:
            problems.append(f"mlx_lm {report['mlx_lm']}: {dotted} lacks {', '.join(missing)} "
                            f"(built against mlx-lm {MLX_LM_PINNED})")
    for dotted in _NEEDED_METHODS:
        owner, _, attr = dotted.partition(".")
        if names.get(owner) is not None and not callable(getattr(names[owner], attr, None)):
            problems.append(f"mlx_lm {report['mlx_lm']}: no {dotted} (built against mlx-lm {MLX_LM_PINNED})")
    try:
        from enginelink.wire import vllm as wire

        report["enginelink"] = str(Path(wire.__file__).resolve().parent.parent)
    except Exception as exc:  # noqa: BLE001
        problems.append(f"enginelink's wire does not import here: {exc} (tools/setup-mlx installs it)")
    return report


def main() -> int:
    report = check()
    print(json.dumps(report), flush=True)
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
