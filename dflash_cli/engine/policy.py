"""How many tokens each step verifies: a fixed block, or the block size that maximises expected tokens per second.

The loop asks once per step and reports once per step, after its one host sync:

    size = policy.choose(limit, rows)                    # 1 .. limit; 1 = a plain step, no drafting
    policy.observe(size, accepted, draft_s, verify_s)    # accepted drafts (one count, or one per batch row)

`FixedBlock` is `--block-size N` (and the stable API's default). `AdaptiveBlock` is the default of the CLI:

- Cost: seconds of draft + verify per block size of a small fixed set (1, 2, 4, 8, 16 up to the drafter's
  block), measured once per machine, model pair, dtype, threads and compile mode by running the real steps
  (`StepCosts.calibrate`: interleaved rounds of a few steps of one size in a row, as the loop runs them, medians)
  and cached as JSON in the dflash cache directory. Online, the time of every step run in a run of its shape
  over its predicted cost moves one load factor that scales every size alike (a busy machine slows them alike),
  and a shape's steps soon after one row's plain steps teach it a factor of its own against them: what the
  loop's steps of that size (and rows) cost beside the calibrated ones (the loop also samples, accepts and
  commits; on the demo's CPU, under load, its block-2 steps cost 1.8 plain steps where the calibration said 1.4,
  and the policy drafted at a loss). A step of several rows costs what one row's step of as many tokens costs
  (`StepCosts.cost`): its products run every row of every block, so on a CPU 4 rows' blocks of 2 cost about one
  row's block of 8, not one row's block of 2.
- Acceptance: the chance a_j that draft j stands given drafts 1..j-1 stood, per position, as a Beta posterior:
  a prior of strength PRIOR_WEIGHT whose mean is the drafter's pooled history (this process and earlier ones,
  kept in the same file; a position it has not seen accepts like the one before), updated by this
  generation's steps with exponential forgetting (code and prose accept differently, within one answer too).
- Rule: expected tokens of a step of B = 1 + sum_{k<B} prod_{j<=k} a_j; pick the B of the set (<= limit) that
  maximises expected tokens / cost(B). One row drafting that pays by less than CHECK_MARGIN, or only thanks to its
  shape's factor, takes CHECK_RUN plain steps every CHECK_EVERY timed steps, which keep the factors' reference
  measured (a factor learned too low once drafted on at a loss, unchecked). When B is 1 (drafting does not pay), plain steps run, and each banks
  PROBE_SHARE of its time; a probe (the best drafting size) runs once the bank covers the probe's expected loss
  (its cost minus the plain time of the tokens it is expected to commit), and its measured loss is paid from
  the bank: probing costs about PROBE_SHARE of plain decoding, whatever the drafter does. A probe also reads the
  context of the plain steps before it (the prompt's too): what probes cost beyond their calibrated steps is
  learned (`probe_extra_s`) and counted in the expected loss, and the bank is kept with the costs, not per
  generation (a bank per generation paid one such probe in every short answer: about 2% of the demo's 128-token
  answers on a CPU). A probe that costs far more than expected leaves a debt of at most one expected loss. A
  shape's first step in a process also loads its code (the demo: about 130 ms, a quarter of a 128-token answer):
  that is learned too (`cold_s`, kept with the costs) and counted in a first probe's loss, so a short-lived
  process whose drafter does not pay does not probe.

A policy instance belongs to one generation (or one batch of rows stepping together: `observe` pools the rows'
acceptance); the costs, the drafter's history and the probes' bank are shared, per (target, drafter, sizes,
compile mode), across generations. Policies sharing them step on one thread (the engine's worker).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import platform
import statistics
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from dflash_cli.cpu_load import busy_since, cpu_snapshot, fresh, measured_now
from dflash_cli.engine.drafter.compiled_step import loaded_draft_step
from dflash_cli.engine.kernels import native
from dflash_cli.engine.target.base import WHOLE_BUFFER, compute_dtype
from dflash_cli.engine.target.compiled_step import loaded_step

if TYPE_CHECKING:
    from dflash_cli.engine.drafter import DFlashDrafter
    from dflash_cli.engine.target.base import TargetState

SIZES = (1, 2, 4, 8, 16)  # few, so that compiled steps keep one graph per size
PRIOR_WEIGHT = 4.0  # pseudo-steps behind the prior mean of each position's acceptance
DEFAULT_ACCEPTANCE = 0.6  # a position's prior mean before the drafter has any history
FORGET = 0.95  # per observed step: this generation's counts reach back about 20 steps
HISTORY_FORGET = 0.999  # the drafter's pooled history: about 1000 steps
PROBE_SHARE = 0.005  # probes may cost about this share of the plain steps' time (about 100 steps apart here)
PROBE_EXTRA_RATE = 0.3  # how fast the learned extra cost of a probe follows measured probes
COLD_RATE = 0.5  # how fast the learned cost of a shape's first step in a process follows measured ones
COLD_BOUND = 4.0  # one first step moves that cost at most to this many times the estimate (or the step's cost)
LOAD_RATE = 0.1  # how fast the online load, and each shape's factor, follow measured steps
FACTOR_WINDOW = 16  # a shape's factor learns from its steps this close after one row's plain step
CHECK_EVERY = 64  # drafting steps near break-even (CHECK_MARGIN) before a short run of plain ones (CHECK_RUN)
CHECK_MARGIN = 1.5  # drafting expected to pay by less than this: a factor learned wrong could turn the decision
CHECK_RUN = 3  # plain steps in a check: the first, after drafting, is not timed
CALIBRATION_ROUNDS = 5  # interleaved rounds of every size; the first warms up and is dropped
CALIBRATION_RUN = 3  # steps of one size in a row per round; the first, after another size, is not kept
CALIBRATION_CONTEXT = 2  # new context rows per timed draft step (about what a step brings)
COSTS_SCHEMA = "dflash-block-costs/3"  # 3: runs of one size, factors per size (2: whole-buffer attention)


class BlockPolicy(Protocol):
    """What the decode loop asks of a block-size policy (see the module docstring)."""

    max_size: int

    def choose(self, limit: int, rows: int = 1) -> int:
        """The block for the next step of `rows` rows: 1 .. limit tokens (1: a plain step)."""

    def observe(
        self, size: int, accepted: int | Sequence[int], draft_s: float, verify_s: float, rows: int | None = None
    ) -> None:
        """What a step of `size` did: drafts accepted (per row in a batch that drafted `size`), its phase times, and
        the rows it ran (default: one per count)."""

    def padded(self, size: int) -> int:
        """The width a compiled step runs for a block of `size` tokens: one of the few shapes it has graphs for."""

    def prepare(self, state: TargetState, drafter: DFlashDrafter | None, prompt: torch.Tensor) -> None:
        """Before the generation's prefill (the state is reserved, not yet filled)."""

    def finish(self) -> None:
        """After the generation's last step (or when it is abandoned)."""


class FixedBlock:
    """Every step verifies `size` tokens (fewer at the very end)."""

    def __init__(self, size: int) -> None:
        self.max_size = size

    def choose(self, limit: int, rows: int = 1) -> int:
        return min(self.max_size, limit)

    def observe(
        self, size: int, accepted: int | Sequence[int], draft_s: float, verify_s: float, rows: int | None = None
    ) -> None:
        pass

    def padded(self, size: int) -> int:
        return self.max_size

    def prepare(self, state: TargetState, drafter: DFlashDrafter | None, prompt: torch.Tensor) -> None:
        pass

    def finish(self) -> None:
        pass


def sizes_up_to(max_size: int) -> tuple[int, ...]:
    """The sizes an adaptive policy picks from: the fixed set up to `max_size`, and `max_size` itself."""
    return tuple(sorted({*(s for s in SIZES if s <= max_size), max_size}))


def _tokens_cost(seconds: dict[int, float], tokens: int) -> float:
    """A calibrated table's seconds at `tokens`: its own figure, else linear between the calibrated sizes around it,
    or from the last two past the largest (a step's products cost in proportion to their rows there)."""
    if tokens in seconds or len(seconds) == 1:
        return seconds.get(tokens, next(iter(seconds.values())))
    sizes = sorted(seconds)
    above = [size for size in sizes if size > tokens]
    low, high = (max(s for s in sizes if s < tokens), above[0]) if above else (sizes[-2], sizes[-1])
    return seconds[low] + (tokens - low) * (seconds[high] - seconds[low]) / (high - low)


def _near(measured: float, estimate: float) -> float:
    """`measured` kept within 4x of `estimate` either way: what one step may pull an estimate toward."""
    return min(max(measured, estimate / 4), estimate * 4)


def expected_tokens(acceptance: Sequence[float], size: int) -> float:
    """Tokens a step of `size` commits on average: 1 + sum_{k<size} prod_{j<=k} a_j (bonus token included)."""
    total, run = 1.0, 1.0
    for a in acceptance[: size - 1]:
        run *= a
        total += run
    return total


# ---------------------------------------------------------------------------------------------------------------
# Costs


MEASUREMENTS = {"decode threads": "decode-threads", "step costs": "block-costs"}  # what is kept -> its folder


def cost_cache_dir(what: str = "block-costs") -> Path:
    """Where measured costs are kept: `what` names the measurement (engine.decode_threads keeps its own)."""
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("dflash")) / what


class StepCosts:
    """Seconds of draft and verify per block size for one (target, drafter) here, and the drafter's history.

    `draft_s[size]`, `verify_s[size]`: calibrated (None until measured); `load`: measured / predicted over recent
    steps, `plain_load` over one row's plain steps; `factors[(size, rows)]`: what the loop's steps of that shape
    cost beside the calibration (1 for one row's plain step, the reference); `banked`, `probe_extra_s`: the
    probes' allowance and extra cost (AdaptiveBlock); `cold_s`: what a drafting shape's first step in a process
    costs more (loading its code: calibrated, then learned from first probes, kept), `warm`: the shapes stepped in
    this process. `successes[j]`, `failures[j]`: the drafter's pooled outcomes at draft position j+1.
    """

    def __init__(self, key: dict[str, Any], sizes: Sequence[int]) -> None:
        self.key = key
        self.sizes = tuple(sizes)
        self.draft_s: dict[int, float] = {}
        self.verify_s: dict[int, float] = {}
        self.load = 1.0
        self.plain_load = 1.0  # the load one row's plain steps alone measure: what the factors are learned against
        self.since_plain = FACTOR_WINDOW + 1  # timed steps of other shapes since one row's plain step (any generation)
        self.factors: dict[tuple[int, int], float] = {}
        self.banked = 0.0  # seconds of plain steps' time set aside for probes, less what probes lost (this process)
        self.probe_extra_s = 0.0  # what a probe costs beyond its calibrated step (the context it reads), learned
        self.cold_s = 0.0  # what a drafting shape's first step in a process costs beyond a warm one, learned; kept
        self.warm: set[tuple[int, int]] = set()  # the drafting shapes (size, rows) stepped in this process
        self.measured_at: str | None = None  # when the costs were calibrated
        self.others_busy: float | None = None  # cores other processes kept busy meanwhile (over QUIET_CORES: not kept)
        self.stale: str | None = None  # why costs saved here before do not stand (measured busy, or long ago)
        self.successes = [0.0] * (max(self.sizes) - 1)
        self.failures = [0.0] * (max(self.sizes) - 1)
        self.path = (
            cost_cache_dir() / f"{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]}.json"
        )
        self._read()

    @property
    def calibrated(self) -> bool:
        return all(size in self.verify_s for size in self.sizes)

    def cost(self, size: int, rows: int = 1) -> float:
        """Seconds of a step of `rows` rows drafting and verifying blocks of `size`: one row's calibrated step of
        size x rows tokens (interpolated between the calibrated sizes, extrapolated past the largest), a plain step
        drafting nothing; times its shape's factor and the load."""
        return self._calibrated(size, rows) * self.factors.get((size, rows), 1.0) * self.load

    def _calibrated(self, size: int, rows: int) -> float:
        draft = 0.0 if size == 1 else _tokens_cost(self.draft_s, size * rows)
        return draft + _tokens_cost(self.verify_s, size * rows)

    def observe_time(self, size: int, seconds: float, rows: int = 1) -> None:
        """A step the loop ran in a run of steps of its shape (a step after another shape costs more): the load
        follows its time over the prediction; one row's plain step also measures the plain load, against which a
        shape run soon after (FACTOR_WINDOW steps) teaches its own factor. Without plain steps (a GPU drafting
        throughout) the factors stand and the load alone follows the machine."""
        if size not in self.verify_s or seconds <= 0:
            return
        calibrated, factor = self._calibrated(size, rows) or seconds, self.factors.get((size, rows), 1.0)
        ratio = _near(seconds / (calibrated * factor), self.load)  # (one stalled step moves it little)
        self.load += LOAD_RATE * (ratio - self.load)
        if (size, rows) == (1, 1):
            self.plain_load += LOAD_RATE * (_near(ratio, self.plain_load) - self.plain_load)
            self.since_plain = 0
            return
        self.since_plain += 1
        if self.since_plain <= FACTOR_WINDOW:
            own = _near(seconds / (calibrated * self.plain_load), factor)
            self.factors[(size, rows)] = factor + LOAD_RATE * (own - factor)

    def observe_acceptance(self, size: int, accepted: int) -> None:
        for j in range(len(self.successes)):
            self.successes[j] *= HISTORY_FORGET
            self.failures[j] *= HISTORY_FORGET
        for j in range(min(accepted, size - 1)):
            self.successes[j] += 1
        if accepted < size - 1:
            self.failures[accepted] += 1

    def calibrate(self, state: TargetState, drafter: DFlashDrafter, prompt: torch.Tensor, notify: Any = None) -> None:
        """Time the real steps at every size over `prompt` (the generation's own, prefilled here and again by
        the loop after): interleaved rounds, first round dropped, medians. Leaves the state to be refilled."""
        from dflash_cli.engine.stats import PhaseClock

        before = cpu_snapshot()
        device = prompt.device
        clock = PhaseClock(device)
        top = max(self.sizes)
        state.prefill(prompt)
        length = state.lengths[0]
        features = state.features(length)
        steps = CALIBRATION_ROUNDS * len(self.sizes) * CALIBRATION_RUN
        cache = drafter.new_cache(length + top + steps * CALIBRATION_CONTEXT, top)
        if self.key.get("compile"):
            from dflash_cli.engine.compiled.jit import compiled_draft_step

            cache.step, cache.notify = compiled_draft_step(device), notify
        block = prompt.new_full((1, top), drafter.mask_token_id)
        block[0, 0] = prompt[0, -1]
        drafter.propose(
            [features], block, [length], cache
        )  # the prompt's context, once (the loop's first draft, untimed)
        context = features[:, -CALIBRATION_CONTEXT:].clone()
        drafts: dict[int, list[float]] = {size: [] for size in self.sizes}
        verifies: dict[int, list[float]] = {size: [] for size in self.sizes}
        first: dict[int, float] = {}  # each size's first step in this process (loading its code)
        for round_ in range(CALIBRATION_ROUNDS):
            order = self.sizes if round_ % 2 == 0 else self.sizes[::-1]
            # (a step right after another size's costs more: the loop runs steps of one size in a row)
            for size, run in itertools.product(order, range(CALIBRATION_RUN)):
                start = cache.length + CALIBRATION_CONTEXT
                t0 = clock.mark()
                if size > 1:
                    block[0, 1:size] = drafter.propose([context], own_block(block, size), [start], cache)[0]
                else:  # a plain step drafts nothing, and its context waits for the next draft
                    cache.length += CALIBRATION_CONTEXT
                t1 = clock.mark()
                # verify + the step's host sync; nothing is committed (the loop's prefill starts the state over)
                torch.argmax(state.verify(own_block(block, size)), dim=-1).tolist()
                t2 = clock.mark()
                if round_ > 0 and run > 0:
                    drafts[size].append(clock.seconds(t0, t1))
                    verifies[size].append(clock.seconds(t1, t2))
                elif round_ == 0 and run == 0:
                    first[size] = clock.seconds(t0, t2)
        self.draft_s = {size: statistics.median(drafts[size]) if size > 1 else 0.0 for size in self.sizes}
        self.verify_s = {size: statistics.median(verifies[size]) for size in self.sizes}
        colds = [first[size] - self.draft_s[size] - self.verify_s[size] for size in self.sizes if size > 1]
        self.cold_s = max(0.0, statistics.median(colds)) if colds else 0.0
        self.load, self.plain_load, self.factors = 1.0, 1.0, {}
        self.measured_at, self.others_busy = measured_now(), busy_since(before)
        self.warm |= {(size, 1) for size in self.sizes if size > 1}

    def _read(self) -> None:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return
        if data.get("schema") != COSTS_SCHEMA or data.get("key") != self.key:
            return
        try:
            draft = {int(k): float(v) for k, v in data["draft_s"].items()}
            verify = {int(k): float(v) for k, v in data["verify_s"].items()}
            factors = {}
            for shape, value in data.get("factors", {}).items():
                size, rows = shape.split("x")
                factors[int(size), int(rows)] = float(value)
            successes = [float(v) for v in data["successes"]]
            failures = [float(v) for v in data["failures"]]
        except (KeyError, TypeError, ValueError, AttributeError):
            return
        cold = data.get("cold_s")  # (a file saved before it was kept has none)
        self.cold_s = max(0.0, float(cold)) if isinstance(cold, (int, float)) and math.isfinite(cold) else 0.0
        measured_at, others_busy = data.get("measured_at"), data.get("others_busy")
        if all(size in verify for size in self.sizes) and fresh(measured_at, others_busy):
            self.draft_s, self.verify_s, self.factors = draft, verify, factors
            self.measured_at, self.others_busy = measured_at, others_busy
        elif measured_at is None:  # (`save` keeps no costs measured while the CPU was busy)
            self.stale = "other processes kept the CPU busy when they were last measured"
        elif not fresh(measured_at, others_busy):
            self.stale = f"the last ones are from {measured_at[:10]}"
        n = min(len(successes), len(failures), len(self.successes))
        self.successes[:n], self.failures[:n] = successes[:n], failures[:n]

    def save(self) -> None:
        """Write the costs and the history (best effort: a read-only cache only loses the saving). Costs calibrated
        while other processes kept the CPU busy are left out: a later start calibrates them again."""
        quiet = fresh(self.measured_at, self.others_busy)
        data = {
            "schema": COSTS_SCHEMA,
            "key": self.key,
            "saved": measured_now(),
            "measured_at": self.measured_at if quiet else None,
            "others_busy": self.others_busy if quiet else None,
            "draft_s": self.draft_s if quiet else {},
            "verify_s": self.verify_s if quiet else {},
            "factors": {f"{size}x{rows}": round(v, 4) for (size, rows), v in self.factors.items()} if quiet else {},
            "successes": [round(v, 3) for v in self.successes],
            "failures": [round(v, 3) for v in self.failures],
            "cold_s": round(self.cold_s, 5),
        }
        save_measurement(self.path, data)


def kept_measurements() -> list[dict[str, Any]]:
    """What this machine keeps measured, for `dflash doctor`: per file what (decode threads, step costs), of which
    target, when, under how much load, and the figures; one entry per unreadable file too."""
    kept = []
    for what, folder in ((what, cost_cache_dir(name)) for what, name in MEASUREMENTS.items()):
        for path in sorted(folder.glob("*.json")):
            try:
                data = json.loads(path.read_text())
                key = data["key"]
            except (OSError, ValueError, KeyError, TypeError):
                kept.append({"what": what, "path": str(path), "unreadable": True})
                continue
            figures = data.get("seconds") or data.get("verify_s") or {}
            kept.append(
                {
                    "what": what,
                    "path": str(path),
                    "target": key.get("target", "?"),
                    "threads": key.get("threads"),
                    "measured_at": data.get("measured_at"),
                    "others_busy": data.get("others_busy"),
                    "stands": fresh(data.get("measured_at"), data.get("others_busy")),
                    "figures": {str(k): v for k, v in figures.items()},
                }
            )
    return kept


def save_measurement(path: Path, data: dict[str, Any]) -> None:
    """Write a measurement's JSON whole or not at all (a reader never sees half a file); best effort: a read-only
    cache only loses the saving."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(data, indent=1) + "\n")
        partial.replace(path)
    except OSError:
        pass


def fingerprint(config: Any) -> str:
    return hashlib.sha256(
        config.encode() if isinstance(config, str) else json.dumps(config, sort_keys=True, default=str).encode()
    ).hexdigest()[:16]


def cost_key(target: Any, drafter: DFlashDrafter, compile: bool) -> dict[str, Any]:
    """What step costs depend on: the target's steps here (`target_key`), the drafter and its exported step."""
    return {
        **target_key(target, compile),
        "drafter_config": fingerprint(drafter.config.to_dict()),
        "drafter_exported": loaded_draft_step(drafter) is not None,
    }


def target_key(target: Any, compile: bool) -> dict[str, Any]:
    """What a target's step costs depend on: this machine and device, the model, the dtype, the kinds of layer that
    hold its weights (a CPU int4 target has the config and dtype of its bf16 self, and other costs), its attention,
    threads and compile mode (or its exported step), and on a CPU whether dflash's kernels run its products."""
    device = target.get_input_embeddings().weight.device
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = platform.processor() or platform.machine()
    return {
        "host": platform.node(),
        "device": f"{device.type}: {where}",
        "target": getattr(target.config, "_name_or_path", "") or type(target).__name__,
        "target_config": fingerprint(target.config.to_json_string(use_diff=False)),
        "dtype": str(compute_dtype(target)).removeprefix("torch."),
        "weights": sorted({kind for m in target.modules() if (kind := _weight_kind(m)) is not None}),
        # (whole-buffer attention is SDPA's: a whole-buffer state switches to it after the first request's costs
        # were keyed)
        "attention": "sdpa"
        if target.config._attn_implementation == WHOLE_BUFFER
        else target.config._attn_implementation,
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "compile": compile,
        "exported": loaded_step(target) is not None,
        # (the build names the kernels' source: a kernel that changed costs rows differently)
        "cpu_kernels": [native.loaded_tier(), native.build_id()] if device.type == "cpu" else None,
        "torch": torch.__version__,
    }


def _weight_kind(module: torch.nn.Module) -> str | None:
    """How a linear layer holds its weight: engine.kernels.quantized's layer, else the weight's class (a plain Parameter
    whatever product the layer asks for, bitsandbytes' Params4bit); None for other modules."""
    if hasattr(module, "weight_buffers"):
        return type(module).__name__
    return type(module.weight).__name__ if isinstance(module, torch.nn.Linear) else None


_COSTS: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], StepCosts]] = weakref.WeakKeyDictionary()


def shared_costs(target: Any, drafter: DFlashDrafter, max_size: int, compile: bool) -> StepCosts:
    """The process's StepCosts for this (target, drafter, sizes, compile mode): read from the cache once."""
    per_drafter = _COSTS.setdefault(drafter, {})
    key = cost_key(target, drafter, compile)
    sizes = sizes_up_to(max_size)
    slot = (id(target), json.dumps(key, sort_keys=True), sizes)
    if slot not in per_drafter:
        per_drafter[slot] = StepCosts(key, sizes)
    return per_drafter[slot]


# ---------------------------------------------------------------------------------------------------------------
# The adaptive policy


class AdaptiveBlock:
    """Per step, the block size of the set that maximises expected tokens per second (module docstring)."""

    def __init__(self, costs: StepCosts, notify: Any = None) -> None:
        self.costs = costs
        self.sizes = costs.sizes
        self.max_size = max(self.sizes)
        self.notify = notify  # context manager factory: a progress line while calibrating
        positions = self.max_size - 1
        self.successes = [0.0] * positions  # this generation's, forgotten at FORGET per step
        self.failures = [0.0] * positions
        self.probing = False  # the size last chosen is a probe (drafting did not pay)
        self.checking = 0  # plain steps left in a check (drafting pays by little: is it so?)
        self.probe_loss = 0.0  # its expected loss
        self.last_shape: tuple[int, int] | None = None  # the last step's (size, rows): a step of another costs more

    def acceptance(self) -> list[float]:
        """The posterior mean acceptance a_j of each draft position: this generation's counts over a prior from
        the drafter's history, whose own prior is the position before's estimate (DEFAULT_ACCEPTANCE for the
        first): a position seldom reached is taken to accept like the one before it."""
        estimates, base = [], DEFAULT_ACCEPTANCE
        history = zip(self.costs.successes, self.costs.failures, self.successes, self.failures)
        for pooled_s, pooled_f, s, f in history:
            prior = (pooled_s + PRIOR_WEIGHT * base) / (pooled_s + pooled_f + PRIOR_WEIGHT)
            base = (PRIOR_WEIGHT * prior + s) / (PRIOR_WEIGHT + s + f)
            estimates.append(base)
        return estimates

    def choose(self, limit: int, rows: int = 1) -> int:
        if limit <= 1 or not self.costs.calibrated:
            return 1
        acceptance = self.acceptance()
        cost = {size: self.costs.cost(size, rows) for size in self.sizes if size <= limit}
        # expected tokens per second of each size <= limit (each row commits alike: the rows' count cancels)
        rates = {size: expected_tokens(acceptance, size) / cost[size] for size in cost}
        best = max(rates, key=rates.__getitem__)
        self.probing = False
        if best > 1:
            # Drafting by a small margin, or only by its shape's factor, for long: a few plain steps measure the
            # plain load the factors are learned against (a factor learned too low in a busy spell drafted on at a
            # loss, never checked).
            factored = expected_tokens(acceptance, best) / (cost[best] / self.costs.factors.get((best, rows), 1.0))
            doubtful = rates[best] < CHECK_MARGIN * rates[1] or factored < rates[1]
            if rows == 1 and doubtful and self.costs.since_plain >= CHECK_EVERY and not self.checking:
                self.checking = CHECK_RUN
            if self.checking:
                self.checking -= 1
                return 1
            return best
        self.checking = 0
        drafting = {size: rate for size, rate in rates.items() if size > 1}
        if not drafting:
            return 1
        probe = max(drafting, key=drafting.__getitem__)
        # The probe's expected loss against plain steps: its cost and the context it reads, less the plain time its
        # tokens would take.
        cold = 0.0 if (probe, rows) in self.costs.warm else self.costs.cold_s  # (a fresh process's first probe)
        loss = cost[probe] + self.costs.probe_extra_s + cold - expected_tokens(acceptance, probe) * cost[1]
        self.probing, self.probe_loss = self.costs.banked >= loss, loss
        return probe if self.probing else 1

    def observe(
        self, size: int, accepted: int | Sequence[int], draft_s: float, verify_s: float, rows: int | None = None
    ) -> None:
        counts = [accepted] if isinstance(accepted, int) else list(accepted)
        shape = (size, rows or len(counts))
        if size == 1 and not self.costs.calibrated:  # (it never drafts: nothing to time or bank)
            return
        # Only a step in a run of its shape is timed: one after another shape costs more (and the first draft after
        # plain steps also reads their context), which a probe's extra cost counts instead.
        in_run, self.last_shape = self.last_shape == shape, shape
        if in_run:
            self.costs.observe_time(size, draft_s + verify_s, shape[1])
        if size == 1:
            self.costs.banked += PROBE_SHARE * self.costs.cost(1, shape[1])
            return
        cold, step = shape not in self.costs.warm, self.costs.cost(*shape)
        self.costs.warm.add(shape)
        if self.probing:  # what it really lost against plain steps for its tokens, and what it cost beyond its step
            tokens = 1 + sum(min(row, size - 1) for row in counts) / len(counts)
            extra = max(0.0, draft_s + verify_s - step)
            if cold:  # its first step here also loaded its code: what that costs beyond the context it read
                seen = min(max(0.0, extra - self.costs.probe_extra_s), COLD_BOUND * max(self.costs.cold_s, step))
                self.costs.cold_s += COLD_RATE * (seen - self.costs.cold_s)
            else:  # (one probe over a far longer context than usual moves it at most twice as far as a usual one)
                extra = min(extra, 2 * (self.costs.probe_extra_s + step))
                self.costs.probe_extra_s += PROBE_EXTRA_RATE * (extra - self.costs.probe_extra_s)
            lost = draft_s + verify_s - tokens * self.costs.cost(1, shape[1])
            self.costs.banked = max(self.costs.banked - lost, -self.probe_loss)
        else:
            self.costs.banked = 0.0
        for j in range(self.max_size - 1):
            self.successes[j] *= FORGET
            self.failures[j] *= FORGET
        for row in counts:
            for j in range(min(row, size - 1)):
                self.successes[j] += 1 / len(counts)
            if row < size - 1:
                self.failures[row] += 1 / len(counts)
            self.costs.observe_acceptance(size, row)

    def padded(self, size: int) -> int:
        return size

    def prepare(self, state: TargetState, drafter: DFlashDrafter | None, prompt: torch.Tensor) -> None:
        """Calibrate the step costs if nothing here has measured them yet (once per machine and model pair)."""
        if self.costs.calibrated or drafter is None or self.max_size == 1:  # (a block of 1 never drafts)
            return
        import contextlib

        sizes = ", ".join(map(str, self.sizes))
        if self.costs.stale:  # (a busy CPU: each start measures again until one finds it quiet)
            why = f"again: {self.costs.stale}"
        else:
            why = f"once; kept in {self.costs.path.parent}"
        message = f"measuring step costs for block sizes {sizes} ({why})"
        # (compiling, the steps show their own progress lines: one live line at a time)
        compiling = bool(self.costs.key.get("compile"))
        with self.notify(message) if self.notify is not None and not compiling else contextlib.nullcontext():
            self.costs.calibrate(state, drafter, prompt, self.notify if compiling else None)
        self.costs.save()

    def finish(self) -> None:
        """At the end of the generation: keep the drafter's history for later ones."""
        self.costs.save()


def own_block(block: torch.Tensor, size: int) -> torch.Tensor:
    """The first `size` tokens of `block` as a tensor of its own, strided as the loop's blocks are: a compiled
    step's graph guards on its input's strides, and a plain `clone` of the slice keeps the parent's row stride."""
    return block[:, :size].clone(memory_format=torch.contiguous_format)


def adaptive_policy(
    target: Any, drafter: DFlashDrafter, max_size: int, *, compile: bool = False, notify: Any = None
) -> AdaptiveBlock:
    """A fresh adaptive policy for one generation, over the process's shared costs for this model pair."""
    return AdaptiveBlock(shared_costs(target, drafter, max_size, compile), notify)


__all__ = [
    "AdaptiveBlock",
    "BlockPolicy",
    "FixedBlock",
    "SIZES",
    "StepCosts",
    "adaptive_policy",
    "expected_tokens",
    "sizes_up_to",
]
