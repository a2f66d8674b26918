"""How busy other processes keep this machine's CPU, torch-free (the CLI reads it before torch is imported, and the
engine while it measures): all busy CPU time over a window minus this process's own. A measurement a run keeps
(decode threads, step costs) is kept only when taken quiet, and stands for MAX_AGE_DAYS (`fresh`)."""

from __future__ import annotations

import calendar
import time

QUIET_CORES = 0.25  # other processes' load (cores busy) up to which a measurement is kept
MAX_AGE_DAYS = 30

Snapshot = tuple[float, float, float]  # (wall clock, CPU seconds all processes were busy, this process's CPU seconds)


def cpu_snapshot() -> Snapshot:
    import psutil  # an accelerate dependency

    total, own = psutil.cpu_times(), psutil.Process().cpu_times()
    busy = sum(total) - total.idle - getattr(total, "iowait", 0.0)
    return time.perf_counter(), busy, own.user + own.system


def busy_since(start: Snapshot) -> float:
    """Cores other processes kept busy since `start`."""
    end = cpu_snapshot()
    return max(0.0, (end[1] - start[1]) - (end[2] - start[2])) / max(end[0] - start[0], 1e-9)


def measured_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def fresh(measured_at: str | None, others_busy: float | None) -> bool:
    """Whether a kept measurement still stands: taken quiet, and under MAX_AGE_DAYS ago."""
    if measured_at is None or others_busy is None or others_busy > QUIET_CORES:
        return False
    try:
        age = time.time() - calendar.timegm(time.strptime(measured_at, "%Y-%m-%dT%H:%M:%SZ"))
    except ValueError:
        return False
    return age < MAX_AGE_DAYS * 86400
