"""RunOptions: the flags `dflash chat`, `run`, `serve` and `bench` share, as one value the frontends receive."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dflash_cli.protocol.params import SamplingParams
from dflash_cli.setup.planning import PlanOverrides
from dflash_cli.setup.recipes import Recipe, resolve_recipe

COMPILE_SETTINGS = ("auto", "on", "off")


@dataclass(frozen=True)
class RunOptions:
    recipe_name: str | None = None  # positional NAME: a recipe name, alias, or path to a .toml
    target: str | None = None
    drafter: str | None = None
    recipe_file: str | None = None
    sampling: SamplingParams = SamplingParams()  # the sampling flags, named like the request fields (params.FIELDS)
    overrides: PlanOverrides = PlanOverrides()  # what the user forced on the plan: --device, --dtype, --quant, ...
    no_spec: bool = False  # baseline: the same loop without the drafter
    explain: bool = False  # print the plan and why each choice was made
    threads: int | None = None  # CPU threads; None: the cores other processes leave free
    compile: str = "auto"  # compile the target's steps: auto (on CUDA only), on, off
    prefix_cache: bool = True  # chat, run, serve: continue from what a slot holds of a prompt (engine.prefix)

    def resolve_recipe(self) -> Recipe:
        return resolve_recipe(self.recipe_name, self.recipe_file, self.target, self.drafter)

    def compile_on(self, device: str) -> tuple[bool, str]:
        """Whether to compile the target's steps on `device`, and why (for --explain)."""
        if self.compile != "auto":
            return self.compile == "on", f"compile {self.compile}: --compile {self.compile}"
        if device.startswith("cuda"):
            return True, "compile on: CUDA graphs remove the launch overhead of an eager step (--compile off to skip)"
        return False, (
            "compile off: on a CPU compiling takes minutes at every start and pays only after several thousand "
            "tokens (benchmarks/results/history.md, compile on CPU; --compile on for a long run or serve)"
        )

    def overriding(self, **changes: Any) -> RunOptions:
        """These options with `changes` to the plan's overrides (PlanOverrides fields: a command's own flags)."""
        return dataclasses.replace(self, overrides=dataclasses.replace(self.overrides, **changes))

    def sampling_params(self, **changes: Any) -> SamplingParams:
        """The sampling of one request: the flags' values with `changes` (SamplingParams attributes: a request's
        own fields, stop tokens / strings)."""
        return dataclasses.replace(self.sampling, **changes)
