"""CPU threads: never more than the cores other processes leave free."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dflash_cli.setup.thread_count import busy_elsewhere, plan_threads


@pytest.mark.parametrize(
    ("cores", "current", "others", "threads"),
    [
        (2, 2, 0.0, 2),  # an idle machine: torch's default
        (2, 2, 0.1, 2),  # a little background noise does not cost a core
        (2, 2, 0.9, 1),  # one busy process: one thread, not a stalled pair
        (2, 2, 2.5, 1),  # never fewer than one
        (8, 8, 3.0, 5),
        (8, 4, 0.0, 4),  # OMP_NUM_THREADS=4 (or torch.set_num_threads) is kept, not raised
    ],
)
def test_threads_follow_the_free_cores(cores: int, current: int, others: float, threads: int) -> None:
    plan = plan_threads(None, cores=cores, current=current, others_busy=others)
    assert plan.threads == threads
    assert f"{cores - others:.1f} of {cores} cores free" in plan.reason or others > cores
    assert "--threads" in plan.reason


def test_the_flag_wins() -> None:
    plan = plan_threads(3, cores=2, current=2, others_busy=1.5)
    assert plan.threads == 3 and plan.label() == "3 threads" and "--threads" in plan.reason


@pytest.mark.slow
def test_a_busy_process_is_seen_and_this_one_is_not() -> None:
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert busy_elsewhere(0.5, max_age=0) >= 0.5  # the spinner (plus whatever else runs here)
    finally:
        spinner.kill()
        spinner.wait()


def test_the_plan_line_shows_the_threads(tiny_qwen3_dir) -> None:
    import io

    from rich.console import Console

    from dflash_cli.loading.session import open_session
    from dflash_cli.setup.options import RunOptions
    from dflash_cli.setup.planning import PlanOverrides

    out = io.StringIO()
    session = open_session(
        RunOptions(target=str(tiny_qwen3_dir), threads=1, explain=True, overrides=PlanOverrides(device="cpu")),
        Console(file=out, width=300),
    )
    printed = out.getvalue()
    assert session.plan_line().endswith(", 1 thread") and session.plan_line() in printed
    assert "1 thread: --threads" in printed
