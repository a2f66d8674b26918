"""CPU threads for torch: no more than the cores other processes leave free.

Every op of a decode step is an OpenMP parallel region whose threads meet at a barrier. With more threads
than free cores, one of them waits for a time slice on every op: on a 2-core machine with one other busy
process, `dflash run` measured 10.7 tok/s with 1 thread and 0.4 tok/s with torch's default of 2.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

from dflash_cli.cpu_load import busy_since, cpu_snapshot
from dflash_cli.wording import plural

SAMPLE_SECONDS = 0.2  # long enough to see a busy process, short next to loading a model


@dataclass(frozen=True)
class ThreadPlan:
    threads: int
    reason: str
    note: str | None = None  # a count that runs, but badly (more threads than cores): said without --explain too

    def label(self) -> str:
        return plural(self.threads, "thread")


def cpu_count() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


_window: list[tuple[float, float, float]] = []  # when the command started measuring (start_load_window)


def start_load_window() -> None:
    """Start measuring the other processes' CPU load now. The CLI calls it first thing, so that by the time the
    plan is made the window already spans the imports of torch and transformers and no sleep is needed."""
    _window[:] = [cpu_snapshot()]


def busy_elsewhere(seconds: float = SAMPLE_SECONDS, max_age: float = 30.0) -> float:
    """Cores kept busy by other processes: all busy CPU time minus this process's own, over at least `seconds`.

    The window starts where `start_load_window` started it if that was under `max_age` seconds ago (a command
    that just started), else now (a long-running process, or a caller that started none)."""
    recent = [start for start in _window if time.perf_counter() - start[0] <= max_age]
    start = recent[0] if recent else cpu_snapshot()
    wait = seconds - (time.perf_counter() - start[0])
    if wait > 0:
        time.sleep(wait)
    return busy_since(start)


def plan_threads(requested: int | None, *, cores: int, current: int, others_busy: float | None) -> ThreadPlan:
    """How many threads to decode with. `current` is torch's count as the user left it (its default, or
    OMP_NUM_THREADS): a count the user already lowered is kept; a core counts as free when others leave three
    quarters of it. `others_busy` None: not measured (one thread cannot go lower)."""
    if requested is not None:  # the user's count, kept: a note says when it cannot run well
        note = None
        if requested > cores:
            note = (
                f"--threads {requested} is more than the {plural(cores, 'core')} here: the threads without a core "
                f"stall the others at every op, so it runs slower than --threads {cores}"
            )
        return ThreadPlan(requested, f"{plural(requested, 'thread')}: --threads", note)
    if others_busy is None:
        why = f"torch's count was {current} ({limit_source()})"
        return ThreadPlan(current, f"{plural(current, 'thread')}: {why}; --threads N overrides")
    free = max(0.0, cores - others_busy)
    threads = max(1, min(current, math.floor(free + 0.25)))
    why = f"{free:.1f} of {cores} cores free (other processes keep {others_busy:.1f} busy)"
    if threads < current:
        why += f"; more threads than free cores stall on each other at every op, so {threads} instead of {current}"
    elif current < cores and threads == current:
        why += f"; torch's count was {current} ({limit_source()})"
    return ThreadPlan(threads, f"{plural(threads, 'thread')}: {why}; --threads N overrides")


def limit_source() -> str:
    """Where torch's thread count below the cores came from, as far as this process can tell."""
    named = [f"{name}={os.environ[name]}" for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if os.environ.get(name)]
    return named[0] if named else "torch's default here, or torch.set_num_threads before dflash planned"


# torch's count before dflash first set it ("user": its default, OMP_NUM_THREADS, or the embedding program's), and
# the count dflash set last ("set"). `dflash train` plans twice (answering, then training): the second plan starts
# from the user's count, not from the one the first chose for a busier moment (which it would read as the user's,
# skip its measurement and say "torch was set to 1").
_counts: dict[str, int] = {}


def users_threads(current: int) -> int:
    """torch's thread count as the user left it: `current`, unless that is the count an earlier plan here set."""
    if _counts.get("set") != current:
        _counts["user"] = current
    return _counts["user"]


def apply_threads(requested: int | None) -> ThreadPlan:
    """Measure the free cores, set torch's thread count, and say why."""
    import torch

    current = users_threads(torch.get_num_threads())
    # One thread cannot go lower: skip the sample.
    others = busy_elsewhere() if requested is None and current > 1 else None
    plan = plan_threads(requested, cores=cpu_count(), current=current, others_busy=others)
    torch.set_num_threads(plan.threads)
    _counts["set"] = plan.threads
    return plan
