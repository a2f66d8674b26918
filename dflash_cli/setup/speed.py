"""The speed a plan can reach at most: plain decoding reads every weight once per token (a MoE token only the
experts it is routed to), so tokens/s <= weight bandwidth / bytes read per token. `dflash doctor` says it for each
recipe that fits."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_cli.setup.choices import Quant, gb
from dflash_cli.setup.planning import Plan, target_weight_bytes
from dflash_cli.setup.recipes import Recipe
from dflash_cli.setup.sizes import BYTES_PER_ELEMENT

# Verdicts by the bound: reading speed is about 5-8 tokens/s.
CHAT_SPEED = 8.0  # tok/s: below it a chat reply lags behind reading
SPEED_VERDICTS = (
    (30.0, "fast"),
    (CHAT_SPEED, "fine for chat"),
    (2.0, "slow: sluggish in chat, usable for `dflash run` batches"),
    (0.0, "too slow for chat"),
)


@dataclass(frozen=True)
class SpeedEstimate:
    """The most tokens per second plain decoding can reach here: the target's weights read once per token at the
    bandwidth measured on this device (hardware.weight_bandwidth). DFlash multiplies it by up to tau; the KV
    cache and per-step overheads take some of it back."""

    tokens_per_s: float
    bytes_per_token: int
    bandwidth: float  # bytes/s
    note: str = ""  # what makes the real speed lower still

    @property
    def verdict(self) -> str:
        return next(label for floor, label in SPEED_VERDICTS if self.tokens_per_s >= floor)

    def describe(self, where: str = "here") -> str:
        rate = f"{self.tokens_per_s:.1f}" if self.tokens_per_s < 10 else f"{self.tokens_per_s:.0f}"
        note = f"; {self.note}" if self.note else ""
        return (
            f"~{rate} tok/s at most {where} without drafting ({gb(self.bytes_per_token)} read per token at "
            f"{self.bandwidth / 1e9:.0f} GB/s): {self.verdict}{note}"
        )


def _bytes_read_per_token(recipe: Recipe, plan: Plan, weights: int) -> int:
    """A MoE token reads the dense part and only the experts it is routed to (`active_params_billion`)."""
    if not (recipe.expert_bytes and recipe.active_params_billion and recipe.params_billion):
        return weights
    expert_params = recipe.expert_bytes / 2e9  # billions (expert_bytes are bf16)
    dense_params = recipe.params_billion - expert_params
    share = min(max((recipe.active_params_billion - dense_params) / expert_params, 0.0), 1.0)
    # the experts' bytes as held: 4.25 bits a weight in MXFP4, 1 byte in FP8, the compute dtype otherwise (NF4 too)
    per_param = {"mxfp4": 4.25 / 8, "fp8": 1.0}.get(plan.weights, BYTES_PER_ELEMENT[plan.dtype])
    experts = expert_params * 1e9 * per_param
    return int(weights - experts * (1 - share))


def expected_speed(recipe: Recipe, plan: Plan, bandwidth: float) -> SpeedEstimate | None:
    """The speed bound of `recipe` run as `plan` at `bandwidth` bytes/s (measured in the plan's dtype on its
    device); None when the recipe does not list its size."""
    weights = target_weight_bytes(recipe, plan.dtype, plan.quant, plan.native_formats)
    if weights is None or bandwidth <= 0:
        return None
    weights = _bytes_read_per_token(recipe, plan, weights)
    note = ""
    if plan.quant is Quant.NF4 and plan.device.partition(":")[0] != "cuda":
        note = "NF4 off CUDA dequantizes every weight each step, several times slower than this"
    return SpeedEstimate(bandwidth / weights, weights, bandwidth, note)
