"""Compiled CPU steps built ahead of time, so that no start waits for a compile.

`dflash pull NAME` builds them in the foreground. The first start of `chat`, `run` or `serve` that finds none stored
for its recipe starts a background build instead (the lowest priority, detached: it outlives a one-shot `chat
--prompt`), and decodes eagerly; the next start loads them in a second and decodes about 2.2x faster (the demo on 2
cores). One background build per recipe, machine, torch and dflash: a lock file while it runs (the builder's pid), a
marker with its error when it failed (not tried again until torch or dflash changes; `dflash pull NAME` shows the
error in full), its log beside them. `DFLASH_BACKGROUND_COMPILE=0` or `--compile off` never starts one.

    python -m dflash_cli.loading.compiled_steps REF.json   # the background builder (started by a session)
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rich.console import Console

from dflash_cli.engine.drafter import compiled_step as draft_step
from dflash_cli.engine.target import compiled_step, standard
from dflash_cli.errors import DflashError
from dflash_cli.progress import working

if TYPE_CHECKING:
    from dflash_cli.setup.recipes import Recipe

ENVIRONMENT = "DFLASH_BACKGROUND_COMPILE"  # "0": never build compiled steps in the background


@dataclass(frozen=True)
class BuiltStep:
    """One compiled step after a build: where it lies, or why there is none."""

    what: str  # "compiled step" (the target's) or "compiled draft step"
    paths: tuple[str, ...]
    why: str


def build_compiled_steps(recipe: Recipe, console: Console | None) -> list[BuiltStep]:
    """Build the compiled steps this machine's default plan of `recipe` runs (a CPU plan: the target's,
    engine.target.compiled_step, for a standard family; the drafter's, engine.drafter.compiled_step), as the first `--compile on`
    start would. Raises DflashError when a build fails."""
    from dflash_cli.loading.models import load_models
    from dflash_cli.setup.hardware import detect_machine
    from dflash_cli.setup.planning import make_plan

    plan = make_plan(detect_machine(), recipe)
    if plan.device != "cpu":
        why = f"{plan.device}: its steps are captured as CUDA graphs at each start (--compile auto)"
        return [BuiltStep("compiled step", (), why)]
    models = load_models(recipe, plan, with_drafter=recipe.drafter is not None, console=console)
    parts = [("compiled step", models.target, "target", standard.unsupported)]
    if models.drafter is not None:
        parts.append(("compiled draft step", models.drafter, "drafter", draft_step.unsupported))
    built = []
    for what, model, part, unsupported in parts:
        with warnings.catch_warnings():  # a failure is this build's error, not a warning beside it
            warnings.simplefilter("ignore")
            step, why = load_exported_step(model, build=True, console=console, part=part)
        if step is None and unsupported(model) is None:
            raise DflashError(why, fix="`dflash doctor` checks for a C++ compiler; chat and run still work, eager")
        built.append(BuiltStep(what, () if step is None else tuple(map(str, step.paths)), why))
    return built


def load_exported_step(
    model: Any, *, build: bool, console: Console | None, part: Literal["target", "drafter"] = "target"
) -> tuple[Any, str]:
    """Load the stored exported step of `model`, the target's (engine.target.compiled_step) or, with `part="drafter"`, the
    drafter's (engine.drafter.compiled_step), building it first when `build` (--compile on, pull --compile): the step (None:
    it runs without one) and why. A build or load that fails leaves the model as it was asked for (eager; with
    --compile on, torch.compile's steps), with a warning."""
    unsupported, stored = (
        (standard.unsupported, compiled_step.exported_step)
        if part == "target"
        else (draft_step.unsupported, draft_step.exported_draft_step)
    )
    why_not = unsupported(model)
    if why_not is not None:
        return None, f"no compiled CPU step for this {part}: {why_not}"
    notify = (lambda message: working(console, message)) if console is not None else None
    try:
        step = stored(model, build_missing=build, notify=notify)
    except Exception as error:  # torch.export and inductor raise many kinds; any of them leaves the step as asked
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        instead = "running it eagerly"
        if build:  # (--compile on; a hybrid target's session runs eager, its drafter too)
            instead = "torch.compile's steps instead" if part == "target" else "torch.compile's draft step or eager"
        warnings.warn(f"the {part}'s compiled step failed to build or load ({first}); {instead}", stacklevel=2)
        return None, f"compile: the {part}'s stored step failed ({first}); {instead}"
    if step is None:
        return None, (
            f"compile off: no compiled step stored for this {part} yet (`dflash pull NAME --compile` or --compile on "
            "builds it once, 1-3 minutes; every later start loads it in a second)"
        )
    return step, f"exported step: the {part}'s step runs compiled ahead of time ({', '.join(map(str, step.paths))})"


def _folder() -> Path:
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("dflash")) / "compile" / "background"


def _key(ref: dict[str, str | None]) -> str:
    """One background build per recipe reference, machine, torch and dflash."""
    import torch

    from dflash_cli import __version__
    from dflash_cli.engine.kernels.native import cpu_flag_line

    facts = {"ref": ref, "torch": torch.__version__, "dflash": __version__, "cpu": cpu_flag_line()}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:24]


def _running(lock: Path) -> bool:
    """Whether the builder whose pid the lock holds is alive (a lock left by a killed builder is not; nor one whose
    pid a later process took, where /proc tells)."""
    try:
        pid = int(lock.read_text().strip() or 0)
        os.kill(pid, 0)
    except (OSError, ValueError):
        return False
    command = Path(f"/proc/{pid}/cmdline")
    return not command.exists() or __name__.encode() in command.read_bytes()


def _lowest_priority(pid: int) -> None:
    """The builder's scheduling group's priority (its nice value is set as it starts): the session decoding now
    comes first. Where Linux groups processes by session for scheduling (autogroups), a nice value ranks a process
    only within its own group, and the builder's new session is a group of its own that would get half the CPU
    beside the decoding session (whose threads then wait on each other at every product: 1 tok/s instead of 50
    measured), so the group's nice value is set too. Linux refuses such writes 100 ms apart (EAGAIN): tried again."""
    group = Path(f"/proc/{pid}/autogroup")
    for _ in range(5):
        try:
            group.write_text("19")
            return
        except BlockingIOError:
            time.sleep(0.1)
        except OSError:  # no autogroups (other kernels, other systems): the process's nice value is the priority
            return


def build_in_background(ref: dict[str, str | None]) -> str:
    """Start the background build of a recipe's compiled steps unless one runs or failed already; the line that
    tells the user. `ref`: the recipe as the command named it (name, recipe_file, target, drafter)."""
    folder = _folder()
    key = _key(ref)
    lock, failed, log = folder / f"{key}.lock", folder / f"{key}.failed", folder / f"{key}.log"
    how = f"`dflash pull {ref.get('name') or '...'} --compile`"
    if failed.is_file():
        return (
            f"compiled steps: the background build failed ({failed.read_text().strip()}); decoding eagerly ({how} "
            "shows why)"
        )
    off = f"--compile off or {ENVIRONMENT}=0 skips it"
    started = _started(lock)
    if started is not None and _running(lock):
        since = time.strftime("%H:%M", time.localtime(started))
        return (
            f"compiled steps: still building in the background since {since} (at the lowest priority: longer while "
            f"other work runs; log {log}); the next start after it decodes faster ({off})"
        )
    folder.mkdir(parents=True, exist_ok=True)
    request = folder / f"{key}.json"
    request.write_text(json.dumps(ref))
    with log.open("w") as out:
        child = subprocess.Popen(
            [sys.executable, "-m", "dflash_cli.loading.compiled_steps", str(request)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # not ended by the terminal's Ctrl-C, nor by this process's exit
            preexec_fn=lambda: os.nice(19),  # the lowest priority: the session decoding now comes first
            env={**os.environ, ENVIRONMENT: "0"},
        )
    _lowest_priority(child.pid)
    lock.write_text(str(child.pid))
    return (
        "compiled steps: building them in the background (once, at the lowest priority: 1-3 minutes on an idle "
        f"machine; log {log}); the next start "
        f"decodes with them, about 2.2x faster ({off})"
    )


def background_builds() -> list[tuple[Path, float]]:
    """The background builds running now: each one's log and when it started (`dflash doctor`)."""
    locks = sorted(_folder().glob("*.lock")) if _folder().is_dir() else []
    return [(lock.with_suffix(".log"), started) for lock in locks if (started := _started(lock)) and _running(lock)]


def _started(lock: Path) -> float | None:
    """When the build whose lock this is started; None once it is gone (a build may end at any moment)."""
    try:
        return lock.stat().st_mtime
    except OSError:
        return None


def main(argv: list[str] | None = None) -> int:
    """The background builder: build the steps of the recipe `argv[0]` (a JSON file) names, saying what it built
    in its log (its standard output); on failure leave a marker with the error's first line; the lock goes either
    way."""
    from dflash_cli.setup.recipes import resolve_recipe

    request = Path((sys.argv[1:] if argv is None else argv)[0])
    lock, failed = request.with_suffix(".lock"), request.with_suffix(".failed")
    started = time.monotonic()
    try:
        ref = json.loads(request.read_text())
        print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} building the compiled steps of {ref}", flush=True)
        recipe = resolve_recipe(ref["name"], ref["recipe_file"], ref["target"], ref["drafter"])
        for step in build_compiled_steps(recipe, None):
            print(f"{step.what}: {step.why}", flush=True)
        print(f"done in {time.monotonic() - started:.0f} s", flush=True)
    except Exception as error:  # any failure: said once at the next start, not tried again at every start
        failed.write_text(str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__)
        raise
    finally:
        lock.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
