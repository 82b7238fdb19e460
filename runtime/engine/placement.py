"""Where the engine and the servicer run: the engine's priority, the servicer's policy, CPU placement.

The engine runs below the servicer's CPU priority only where asked
(``lower_priority``: see it for why), the servicer's threads may run
``SCHED_BATCH`` (``run_threads_as_batch``), and the front end may be kept off
the CPUs the engine binds (``place_front_end``). Each returns what it did, for
the journal; none may fail a start-up.
"""

from __future__ import annotations

import os

from enginelink.runtime.engine.engine_processes import engine_members

# Nice levels between the servicer and its engine (ENGINELINK_ENGINE_NICE). Opt-in, 0 by default: a
# reniced engine yields to every process on the host, not only to its servicer. In undisturbed pairs
# on 2 cores +10 bought nothing measurable, and with other load on the machine the reniced engine lost
# the most (issue 23; docs/benchmarks-history.md, "Defaults for production").
ENGINE_NICE_DEFAULT = 0
# The servicer's own scheduling policy once its engine runs (ENGINELINK_SERVICER_SCHED). Opt-in
# `batch`, `normal` (SCHED_OTHER) by default, for the same measurements.
SERVICER_SCHED_CHOICES = ("batch", "normal")
SERVICER_SCHED_DEFAULT = "normal"
# Where the servicer and the engine's unbound threads run once the engine is up (ENGINELINK_PLACEMENT).
PLACEMENT_CHOICES = ("auto", "off")
PLACEMENT_DEFAULT = "off"  # opt-in: no throughput change measured on 2 cores (docs/benchmarks-history.md)
NICE_MAX = 19


def lower_priority(launcher: int, levels: int) -> dict:
    """Run the engine's launcher (and so its EngineCore and Worker) ``levels`` nice steps below this process.

    Why: vLLM's EngineCore and Worker busy-poll (``sched_yield`` loops) while
    a step runs, so with few cores they are always runnable, and the servicer
    (and the router) wait for a core every time they wake. The front end uses
    little CPU, so letting it go first costs the engine almost nothing
    (docs/benchmarks-history.md). The launcher's nice value is inherited by
    EngineCore and the Worker (they start seconds later): call it right after
    the launch. The engine shares the servicer's session, and so under the
    kernel's autogroups its scheduling group, inside which nice values rank
    tasks: the group's own weight is left alone (it is the servicer's too).
    Returns what it set, for the journal; nothing here may fail a launch.

    The engine also gets the normal scheduling policy explicitly: a servicer
    that already runs ``SCHED_BATCH`` (``run_threads_as_batch``; or started
    under ``chrt -b``, or from a process that did) would hand it down, and
    the engine's step must not wait for others to yield.
    """
    applied: dict = {"levels": levels}
    try:
        os.sched_setscheduler(launcher, os.SCHED_OTHER, os.sched_param(0))
    except OSError as error:
        applied["policy_error"] = str(error)
    if levels <= 0:
        return applied
    try:
        nice = min(NICE_MAX, os.getpriority(os.PRIO_PROCESS, 0) + levels)
        os.setpriority(os.PRIO_PROCESS, launcher, nice)
        applied["nice"] = nice
    except OSError as error:
        applied["nice_error"] = str(error)
    return applied


def run_threads_as_batch() -> dict:
    """Put every thread of this process in ``SCHED_BATCH``. Returns what it did, for the journal.

    Why: with the engine filling the cores, the servicer wakes at every
    engine step (the step's outputs arrive) and, at normal policy and a
    higher priority than the engine (``lower_priority``), preempts whatever
    engine task holds the core, often EngineCore in the middle of its part
    of the step. A ``SCHED_BATCH`` task does not preempt on wake-up: it runs
    when the engine's busy-poll yields (``sched_yield``), i.e. while the
    engine waits anyway. Measured on 2 cores with a real vLLM engine at
    concurrency 128, side by side: +7% to +11% engine tokens/s
    (docs/benchmarks-history.md). Where cores are free it changes nothing: a waking
    task on an idle core runs at once.

    Call it after the engine is launched (``lower_priority`` gives the
    engine the normal policy explicitly, whatever this process runs as);
    threads started later inherit it from the thread that starts them.
    Nothing here may fail a start-up: an error is reported, not raised.
    """
    applied: dict = {"policy": "batch", "threads": 0}
    for tid in own_threads():
        try:
            os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
            applied["threads"] += 1
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        except OSError as error:
            applied["error"] = str(error)
            break
    return applied


def describe_priority(applied: dict) -> str:
    """What ``lower_priority`` (and ``run_threads_as_batch``, under "servicer") did, in words.

    For the start-up log and ``enginelink inspect``, from the journal's
    ``engine.handshake`` ``priority`` step.
    """
    if applied.get("levels", 0) <= 0:
        text = "at the servicer's priority (ENGINELINK_ENGINE_NICE=0)"
    else:
        nice = f"nice {applied['nice']}" if "nice" in applied else f"nice unchanged ({applied.get('nice_error')})"
        text = f"{applied['levels']} levels below the servicer: {nice}"
    if "policy_error" in applied:
        text += f"; engine's scheduling policy unchanged ({applied['policy_error']})"
    servicer = applied.get("servicer")
    if servicer is not None:
        if "error" in servicer:
            text += f"; servicer threads not SCHED_BATCH ({servicer['error']})"
        else:
            text += f"; the servicer's {servicer['threads']} threads run SCHED_BATCH, so they wait for the engine to yield"
    return text


def place_front_end(group: int) -> dict:
    """Keep the servicer and the engine's unbound threads off the CPUs the engine binds its compute to.

    Why: vLLM's CPU backend binds its Worker's OpenMP threads one per CPU and
    leaves the rest "for the front end", but nothing else is bound: EngineCore,
    the servicer and the router float. With the engine ``lower_priority``,
    whatever the kernel's balancer moves onto a bound CPU preempts the Worker
    mid-step: on 2 cores (/proc schedstat) the Worker waited for its own core
    up to 18% of a load behind enginelink; placed, 2–6%. But on 2 cores the
    front end then shares the one other core with EngineCore, which waits
    instead, and tokens/s did not change in side-by-side runs. So it is
    opt-in (``ENGINELINK_PLACEMENT=auto``), for machines with cores to spare
    (docs/benchmarks-history.md).

    Bound CPUs are those of the engine's threads whose affinity is narrower
    than the servicer's (the engine inherited the servicer's at launch). The
    engine's threads that still have the servicer's affinity, and every
    servicer thread, are moved to the others. Nothing changes when the engine
    binds nothing (a GPU engine, the sim engine) or when it binds every CPU.
    Call it once the handshake is done (vLLM binds while it loads); threads
    started later inherit from their creator. Returns what it did, for the
    journal; nothing here may fail a start-up.
    """
    allowed = os.sched_getaffinity(0)
    engine_threads: dict[int, set[int]] = {}
    for pid in engine_members(group):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue  # the process ended meanwhile
        for name in tids:
            try:
                engine_threads[int(name)] = os.sched_getaffinity(int(name))
            except OSError:
                continue
    bound = set().union(*(cpus for cpus in engine_threads.values() if cpus < allowed))
    applied: dict = {"bound_cpus": sorted(bound), "servicer_cpus": sorted(allowed)}
    front_end = allowed - bound
    if not bound:
        applied["skipped"] = "the engine binds no thread to particular CPUs"
        return applied
    if not front_end:
        applied["skipped"] = "the engine binds every CPU the servicer may use"
        return applied
    applied["front_end_cpus"] = sorted(front_end)
    for key, tids in (("engine", [tid for tid, cpus in engine_threads.items() if cpus == allowed]),
                      ("servicer", own_threads())):
        applied[f"{key}_threads"], error = set_affinity(tids, front_end)
        if error is not None:
            applied[f"{key}_error"] = error
    return applied


def own_threads() -> list[int]:
    """This process's thread ids."""
    return [int(name) for name in os.listdir("/proc/self/task")]


def set_affinity(tids, cpus: set[int]) -> tuple[int, str | None]:
    """Give each thread ``cpus``; returns how many moved and the last error, if any.
    A thread that ended meanwhile is skipped."""
    done, error = 0, None
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
            done += 1
        except ProcessLookupError:
            continue
        except OSError as exc:
            error = str(exc)
    return done, error


def cpu_list(cpus) -> str:
    """``[0, 1, 2, 5]`` as ``CPUs 0-2,5`` (the kernel's list format), ``[1]`` as ``CPU 1``."""
    ranges: list[list[int]] = []
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    listed = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)
    return f"CPU {listed}" if len(cpus) == 1 else f"CPUs {listed}"


def describe_placement(applied: dict, front_end: str = "the servicer") -> str:
    """What ``place_front_end`` did, in words (the start-up log and ``enginelink inspect``).

    ``front_end``: who called it (the bench's raw driver places itself as the servicer would).
    """
    if "skipped" in applied:
        return f"unchanged: {applied['skipped']}"
    text = (f"the engine binds {cpu_list(applied['bound_cpus'])}; {front_end}'s {applied['servicer_threads']} "
            f"threads and the engine's {applied['engine_threads']} unbound threads run on "
            f"{cpu_list(applied['front_end_cpus'])}")
    for key, whose in (("engine_error", "the engine's"), ("servicer_error", f"{front_end}'s")):
        if key in applied:
            text += f"; some of {whose} threads did not move ({applied[key]})"
    return text
