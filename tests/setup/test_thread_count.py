"""CPU threads: never more than the cores other processes leave free."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dflash_cli.setup.thread_count import apply_threads, busy_elsewhere, cpu_count, plan_threads


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


def test_more_threads_than_cores_runs_with_a_note() -> None:
    """--threads 999 on 2 cores is kept (the flag wins) but said: the threads without a core stall the rest."""
    plan = plan_threads(999, cores=2, current=2, others_busy=None)
    assert plan.threads == 999 and plan.note is not None
    assert (
        plan.note.startswith("--threads 999 is more than the 2 cores here") and "slower than --threads 2" in plan.note
    )
    assert plan_threads(2, cores=2, current=2, others_busy=1.5).note is None  # all the cores: busy now, but possible
    assert plan_threads(None, cores=2, current=2, others_busy=0.0).note is None


def test_a_later_plan_starts_from_the_users_count_not_an_earlier_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    """`dflash train` plans twice (answering, then training). The first plan's count (here --threads 1, as a busy
    moment may choose) is dflash's own: the second measures from the user's count again, rather than keep 1 and say
    the user set it."""
    import torch

    from dflash_cli.setup import thread_count

    monkeypatch.setattr(thread_count, "_counts", {})  # (this process's counts, as a new process has them; restored)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)  # the user's (OMP_NUM_THREADS=3, say)
        assert apply_threads(1).threads == 1 == torch.get_num_threads()
        again = apply_threads(None)
        assert "cores free (other processes keep" in again.reason  # measured, from the user's 3:
        assert "instead of 3" in again.reason or "torch's count was 3" in again.reason, again.reason
        assert 1 <= again.threads <= min(3, cpu_count()) and torch.get_num_threads() == again.threads
    finally:
        torch.set_num_threads(before)


def test_one_thread_not_measured_says_where_it_came_from(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    plan = plan_threads(None, cores=2, current=1, others_busy=None)
    assert plan.threads == 1 and "torch's count was 1 (OMP_NUM_THREADS=1)" in plan.reason
    assert "cores free" not in plan.reason  # (nothing was measured: no "0.0 busy")
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    assert "OMP_NUM_THREADS" not in plan_threads(None, cores=2, current=1, others_busy=None).reason


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
