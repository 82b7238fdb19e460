"""``enginelink bench --plot FILE.svg``: a run's figures drawn, per arm and concurrency.

Two panels side by side, one group of bars per concurrency and one bar per arm
(the median of its repetitions, each repetition a dot on it): tokens/s, and the
servicer's CPU per output token (µs; its process only, as the report counts it).
The raw drivers have no servicer, so they have no CPU bar; neither does the
reference MLX servicer, whose process runs mlx-lm too (its CPU is the engine's).

matplotlib is an optional extra (``pip install 'enginelink[bench]'``), imported
here only, inside the functions: the servicer never loads it
(``pyproject.toml``'s import-linter contract "plot").
"""

from __future__ import annotations

import statistics
from pathlib import Path

INSTALL_HINT = "pip install 'enginelink[bench]' (matplotlib)"
# Arms whose CPU figure is not a servicer's alone, so it is not drawn beside the servicers'.
NO_SERVICER_CPU = {"raw"}


class PlotError(Exception):
    """``--plot`` cannot work: no matplotlib, or nowhere to write (exit status 2, before the run)."""


def check(path: Path) -> None:
    """Fail before a long run rather than after it."""
    if path.suffix.lower() != ".svg":
        raise PlotError(f"--plot {path}: the plot is an SVG file (FILE.svg)")
    if not path.resolve().parent.is_dir():
        raise PlotError(f"--plot {path}: no directory {path.resolve().parent}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotError(f"--plot needs matplotlib: {INSTALL_HINT}") from None


def series(report: dict) -> dict[str, dict[int, dict]]:
    """``{arm: {concurrency: {"tokens_per_s": [...], "us_per_token": [...]}}}`` from any bench report.

    A plain run's report (one arm, ``enginelink``) or a side-by-side one (``results``, each with
    ``runs`` per arm: ``--against``, ``--engine vllm``, ``--engine mlx``).
    """
    out: dict[str, dict[int, dict]] = {}

    def add(arm: str, concurrency: int, tokens_per_s: float, us: float | None) -> None:
        slot = out.setdefault(arm, {}).setdefault(concurrency, {"tokens_per_s": [], "us_per_token": []})
        slot["tokens_per_s"].append(tokens_per_s)
        if us is not None:
            slot["us_per_token"].append(us)

    if "results" not in report:
        add("enginelink", report["config"]["concurrency"], report["tokens_per_s"],
            report.get("servicer_cpu_us_per_token"))
        return out
    mlx = report.get("engine") == "mlx"
    for result in report["results"]:
        for arm, runs in result["runs"].items():
            for run in runs:
                us = None
                if run.get("servicer_cpu_s") and run.get("tokens") and not arm.startswith("raw") \
                        and not (mlx and arm == "reference"):
                    us = run["servicer_cpu_s"] / run["tokens"] * 1e6
                add(arm, result["concurrency"], run["tokens_per_s"], us)
    return out


def write(report: dict, path: Path, title: str) -> None:
    """Draw ``report`` into ``path`` (SVG, text kept as text so the arms' names are searchable)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = series(report)
    arms = list(data)
    concurrencies = sorted({c for per in data.values() for c in per})
    width = 0.8 / max(len(arms), 1)
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "enginelink-bench"}):
        figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2), constrained_layout=True)
        for i, arm in enumerate(arms):
            colour = f"C{i}"
            for axis, key in ((left, "tokens_per_s"), (right, "us_per_token")):
                xs, heights = [], []
                for j, c in enumerate(concurrencies):
                    values = data[arm].get(c, {}).get(key, [])
                    if not values:
                        continue
                    x = j + (i - (len(arms) - 1) / 2) * width
                    xs.append(x)
                    heights.append(statistics.median(values))
                    axis.plot([x] * len(values), values, "o", color="black", markersize=2.5, zorder=3)
                if xs:
                    axis.bar(xs, heights, width * 0.9, color=colour, label=arm)
        for axis, label in ((left, "output tokens/s"), (right, "servicer CPU, µs per output token")):
            axis.set_xticks(range(len(concurrencies)), [str(c) for c in concurrencies])
            axis.set_xlabel("concurrency")
            axis.set_ylabel(label)
            axis.grid(axis="y", alpha=0.3)
        left.legend(fontsize="small")
        figure.suptitle(title, fontsize="medium")
        # No date in the file: the same run draws the same bytes.
        figure.savefig(path, format="svg", metadata={"Date": None})
        plt.close(figure)


def title_of(report: dict, command: str) -> str:
    machine = report.get("machine", {})
    return (f"{command}  ({machine.get('nproc', '?')} cpu, {machine.get('cpu_model', '?')}; "
            f"bars: median, dots: repetitions)")


def describe(args) -> str:
    """The run's command, from its options (a title that says what was measured)."""
    parts = ["enginelink bench"]
    engine = getattr(args, "engine", "sim")
    if engine != "sim":
        parts.append(f"--engine {engine}")
    if getattr(args, "wire", "vllm") != "vllm":
        parts.append(f"--wire {args.wire}")
    if getattr(args, "against", None):
        parts.append("--against " + ",".join(args.against))
    concurrency = args.concurrency if isinstance(args.concurrency, list) else [args.concurrency]
    parts.append("--concurrency " + " ".join(str(c) for c in concurrency))
    if getattr(args, "requests", None):
        parts.append(f"--requests {args.requests}")
    elif getattr(args, "duration_s", None):
        parts.append(f"--duration-s {args.duration_s:g}")
    parts.append(f"--max-tokens {args.max_tokens}")
    if getattr(args, "engine_args_text", ""):
        parts.append(f"--engine-args='{args.engine_args_text}'")
    return " ".join(parts)


def maybe_write(args, report: dict) -> None:
    """``--plot``: draw the report; one line on stderr says where."""
    import sys

    path = getattr(args, "plot", None)
    if path is None:
        return
    write(report, Path(path), title_of(report, describe(args)))
    print(f"enginelink bench: plot written to {path}", file=sys.stderr)
