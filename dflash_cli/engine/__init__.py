"""The engine: one decode loop every frontend uses (the baseline is the same loop with a block of 1).

Modules, one job each: `loop` (a batch's steps: draft, verify, accept; and the generator of steps), `scheduler`
(which row decodes where), `row` (a row, and its generation's limits, stop conditions, stats and RNG), `target` (the
target's static state: prefill, verify, commit), `drafter` (the DFlash drafter models and their context cache),
`compiled` (compiled steps), `kernels` (how a CPU step's products and attention run), `policy` (each step's block
size), `sampling` (choosing tokens and the acceptance rule), `text` (streamed detokenization), `stats` (counts and
clocks), `decode_threads` (the CPU thread count of decode steps).
"""

from dflash_cli.engine.loop import Batch, collect, generate, speculative_generate
from dflash_cli.engine.policy import AdaptiveBlock, BlockPolicy, FixedBlock, adaptive_policy
from dflash_cli.engine.prefix import PrefixStore
from dflash_cli.engine.row import Generation, GenerationResult, Row, Step
from dflash_cli.engine.sampling import SamplingParams, accepted_drafts, sample_tokens
from dflash_cli.engine.stats import GenerationStats, PhaseClock
from dflash_cli.engine.target import forget_prefixes
from dflash_cli.engine.target.attention import AttentionState
from dflash_cli.engine.target.base import TargetState, context_window
from dflash_cli.engine.text import TextStream

__all__ = [
    "AdaptiveBlock",
    "AttentionState",
    "Batch",
    "BlockPolicy",
    "FixedBlock",
    "GenerationResult",
    "GenerationStats",
    "PhaseClock",
    "PrefixStore",
    "Generation",
    "Row",
    "SamplingParams",
    "Step",
    "TargetState",
    "TextStream",
    "accepted_drafts",
    "adaptive_policy",
    "collect",
    "context_window",
    "forget_prefixes",
    "generate",
    "sample_tokens",
    "speculative_generate",
]
