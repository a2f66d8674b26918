"""What a training run is asked to do, where it keeps its files, and what it reports."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# Layout of --output: drafter/ (the result, z-lab format), checkpoint/ (drafter/ + optimizer state), distill/ (the
# target's answers and its features), metrics.json.
DRAFTER_DIR, CHECKPOINT_DIR, DISTILL_DIR = "drafter", "checkpoint", "distill"
WALKED_FILE = "walked_answers.json"  # the keys of the training answers walked beside the held-out ones


@dataclass
class TrainOptions:
    """Everything a training run depends on; saved with every checkpoint."""

    target: str
    prompts: str
    output: str
    layers: int | None = None  # drafter layers (None: 1 for a new drafter, --init-from's own for a started one)
    feature_layers: int = 5
    block_size: int = 8
    draft_vocab: int = 32768  # tokens the drafter may propose (objective.draft_vocabulary; 0: the whole vocabulary)
    steps: int = 2000
    batch_size: int = 8
    lr: float = 6e-4
    warmup_steps: int | None = None  # None: a tenth of the run, 1 to 100 (objective.warmup_steps)
    anchors_per_sequence: int = 16
    gamma: float | None = None
    max_new_tokens: int = 128
    distill_batch_size: int | None = None  # rows the engine answers at once while distilling (None: the plan's)
    follow_ups: int = (
        0  # follow-up turns distilled per prompt (distill.FOLLOW_UPS): multi-turn data, more answers per prompt
    )
    train_minutes: float | None = None  # stop training (checkpoint, then measure) after this long
    eval_prompts: int = 32
    eval_every: int = 0  # measure held-out tau every N steps into the history (0: only at the end)
    eval_prompts_file: str | None = None
    checkpoint_every: int = 200
    resume: bool = False
    init_from: str | None = None  # a new run starts from this drafter's weights and shape (a recipe, dir or repo id)
    mask_token_id: int | None = None
    seed: int = 0
    device: str = "cpu"
    # The target's dtype while it writes answers (the plan's for --dtype), computes features and measures tau. None:
    # the dtype dflash serves it in on `device` (bf16 on GPUs, on CPUs with AVX512-BF16/AMX and on AVX2 CPUs, where
    # dflash's kernels run it 2-5x faster; fp32 on other CPUs, where bf16 is emulated and several times slower).
    dtype: str | None = None
    threads: int | None = None  # torch's CPU threads (None: the cores other processes leave free)

    @property
    def loss_gamma(self) -> float:
        return self.gamma if self.gamma is not None else published_gamma(self.block_size)


def published_gamma(block_size: int) -> float:
    """The published schedule: gamma about 7 for B=16, 4 for B=8, i.e. roughly B/2."""
    return {16: 7.0, 8: 4.0}.get(block_size, block_size / 2)


@dataclass
class TrainResult:
    output: str
    steps: int
    train_seconds: float
    final_loss: float
    train_tau: float
    eval_tau: float | None
    eval_prompts: int
    history: list[dict[str, float]] = field(default_factory=list)
    seen_tau: float | None = None  # the same walk on as many training answers

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
