"""The step functions the loop runs, eager or compiled: the target's forward over a block (one graph per block
size) and the drafter's forward (full graph, dynamic shapes).

Compiling removes the per-op Python and dispatch cost of an eager forward (tens of ops per layer) but costs
minutes on a small CPU, so it is used where it pays (`--compile auto`: CUDA only):

- Target, CUDA: `mode="reduce-overhead"` (CUDA graphs), static shapes. The state hands attention its whole K/V
  buffer with an explicit mask and keeps its length in a device tensor, so one graph serves every step of a block
  size. The drafter's features leave a compiled step as outputs, copied into their buffer after it: a graph that
  writes into an input other than a static buffer is not captured (inductor runs it without CUDA graphs).
- Target, CPU: inductor with dynamic shapes, the state handing attention the committed prefix plus the block
  (the prefix length is symbolic, so it never recompiles as the context grows). The weights are frozen into
  the graph (`CPU_INDUCTOR_OPTIONS`): inductor packs each one once, at compile time, into the blocked layout of
  its own GEMM micro-kernels, which read float32 weights for 1-8 rows near the machine's bandwidth where MKL's
  kernels over row-major weights do not (docs/benchmarks.md: the demo's plain step from 2.1x the floor to
  1.36x). See benchmarks/results/history.md for what compiling costs and saves on a 2-core CPU.
- Drafter: inductor with dynamic shapes on every device (the new context rows and the attended prefix change
  each step, which CUDA graphs would re-record); its first call, over the whole prompt, runs eagerly like the
  target's prefill. The proposal (argmax, DFlash2's selector chain) stays outside the graph.

Frozen weights are constants of the graph: the packed copies live beside the module's own parameters (which the
eager prefill, the drafter's shared embedding and head, and any eager fallback still read), so a compiled CPU
target holds its weights twice; and a module whose weights change after compiling keeps running the old ones
(nothing here trains a module it has compiled).

Compiled artifacts go to the dflash cache directory (inductor's caches), so a second start skips code
generation; tracing still runs in each new process. Frozen CPU graphs hold MKL-packed constants that inductor's
graph cache cannot pickle, so there a second start keeps only the autotuning choices and the compiled C++
kernels, and lowers the graph again (minutes).
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import transformers
from packaging.version import Version
from torch._dynamo.utils import counters
from torch.fx.experimental import _config as fx_config

# The keyword a transformers model's forward takes its cache by: transformers 5.24 renamed `past_key_values` to
# `cache` (the old name warns on every forward until it goes, in 5.40). A constant, so a compiled step sees no branch.
CACHE_ARGUMENT = "cache" if Version(transformers.__version__) >= Version("5.24") else "past_key_values"


def compile_cache_dir() -> Path:
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("dflash")) / "compile"


def use_compile_cache() -> Path:
    """Point inductor's caches at the dflash cache directory (unless the user chose one)."""
    directory = os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(compile_cache_dir()))
    return Path(directory)


def run_target(
    model: Any,
    token_ids: torch.Tensor,
    cache: Any,
    offset: int | torch.Tensor,
    logits_to_keep: int = 0,
    masks_for: Callable[[torch.Tensor], Any] | None = None,
) -> torch.Tensor:
    """One target forward over `token_ids` [1, q] at positions offset .. offset+q-1; logits [q', vocab].
    `masks_for(positions)`: the 4-D mask (or transformers' mapping of them by layer kind) where the model must not
    build its own (whole-buffer attention: see attention.AttentionState.full_view); made here, so a compiled step
    builds it inside its graph."""
    positions = (torch.arange(token_ids.shape[1], device=token_ids.device) + offset)[None]
    out = model(
        input_ids=token_ids,
        position_ids=positions,
        attention_mask=None if masks_for is None else masks_for(positions),
        use_cache=True,
        **{CACHE_ARGUMENT: cache},
        logits_to_keep=logits_to_keep,
    )
    return out.logits[0]


def run_drafter(
    drafter: Any, block_ids: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, cache: Any
) -> torch.Tensor:
    """One drafter forward over `rows` = [fused new context ; block embeddings] [1, c+q, H] at `positions`
    -> hidden of every block slot [1, q, H] (slot 0 included: a slice here would make the compiler
    specialize on a 2-token block). One input for context and block: c is often 1, and a size-1 input (or
    any tensor of the context's own size) would be specialized by the compiler, while c+q never is."""
    return drafter.forward(rows, block_ids.shape[1], positions, cache)


Notify = Callable[[str], AbstractContextManager[Any]]

# Inductor on a CPU: weights frozen and packed for inductor's C++ GEMM templates, each product timed against
# MKL's once per shape and row count (the choice is kept in the inductor cache) so that the faster one runs;
# the timing tables inductor prints for each choice are not for our users.
CPU_INDUCTOR_OPTIONS = {
    "freezing": True,
    "max_autotune_gemm": True,
    "max_autotune_gemm_backends": "CPP,ATEN",
    "autotune_num_choices_displayed": 0,
    "max_autotune_report_choices_stats": False,
}


RECOMPILE_LIMIT = 64  # graphs of one compiled step function a process may make (see CompiledStep)


class CompiledStep:
    """A step function (`run_target` or `run_drafter`) compiled for one device type, shared by every state.

    `fn(module, block_ids, ...)`. The first call for a (module, block size) may compile; `notify` (a context
    manager factory taking a message) shows a progress line around it. If compiling fails, a warning says so
    and the step runs eagerly from then on. `cuda_graphs`: on CUDA, static shapes and CUDA graphs (the
    target's step, whose shapes are fixed per block size); otherwise dynamic shapes. `fixed_shapes` overrides
    where static shapes apply (tests take the CUDA path's shapes on a CPU with it); the target's state reads it.
    """

    def __init__(
        self,
        fn: Callable[..., torch.Tensor],
        what: str,
        device_type: str,
        *,
        backend: Any = "inductor",
        cuda_graphs: bool = False,
        fixed_shapes: bool | None = None,
    ) -> None:
        use_compile_cache()
        # Dynamo keeps one graph per guard set of a function: for the target's step, one per block size (fixed
        # shapes) and drafter or none (features captured or not), per target loaded. Its default limit, 8, is
        # passed by a server's adaptive block sizes (1 to 16, drafted and plain), and past it the step would run
        # eagerly for the rest of the process.
        name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"  # (<2.7)
        setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), RECOMPILE_LIMIT))
        self.fixed_shapes = device_type == "cuda" and cuda_graphs if fixed_shapes is None else fixed_shapes
        options: dict[str, Any] = {"fullgraph": True, "backend": backend, "dynamic": not self.fixed_shapes}
        if self.fixed_shapes and device_type == "cuda" and backend == "inductor":
            options["mode"] = "reduce-overhead"
        # inductor's settings for every call (any call may compile): freezing is not applied when given as
        # torch.compile's `options`
        self.config = CPU_INDUCTOR_OPTIONS if device_type == "cpu" and backend == "inductor" else {}
        if self.config:  # inductor's own deprecated call while it packs the weights: not our users' business
            warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning)
        # Dynamic graphs: no "duck sizing" (dims of equal size at the first compile taken for one symbol), which
        # ties a block's width to an unrelated buffer dim that happens to match and recompiles (minutes on a
        # CPU) when they part.
        self.dynamic = bool(options["dynamic"])
        self.eager, self.what = fn, what
        self.fn = torch.compile(fn, **options)
        self.compiled: set[tuple[int, int]] = set()
        self.broken: str | None = None  # why compiling failed: later calls run eagerly

    def __call__(self, *args: Any, notify: Notify | None = None) -> torch.Tensor:
        if self.broken is not None:
            return self.eager(*args)
        key = (id(args[0]), args[1].shape[1])
        if key in self.compiled or notify is None:
            return self._run(*args)
        message = (
            f"compiling the {self.what} for blocks of {args[1].shape[1]} (first use; cached in {use_compile_cache()})"
        )
        with notify(message):
            out = self._run(*args)
        self.compiled.add(key)
        return out

    def _run(self, *args: Any) -> torch.Tensor:
        graphs, started = counters["stats"]["unique_graphs"], time.perf_counter()
        try:
            with contextlib.ExitStack() as settings:  # about 50 us with both, against tens of ms for a CPU step
                if self.config:
                    settings.enter_context(torch._inductor.config.patch(self.config))
                if self.dynamic:
                    settings.enter_context(fx_config.patch(use_duck_shape=False))
                return self.fn(*args)
        except torch._dynamo.exc.TorchDynamoException as error:  # nothing ran: the graph never executed
            self.broken = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            warnings.warn(
                f"compiling the {self.what} failed ({self.broken}); running it eagerly (--compile off)", stacklevel=3
            )
            return self.eager(*args)
        finally:
            if counters["stats"]["unique_graphs"] != graphs:  # this call compiled a graph
                _compiling_s[0] += time.perf_counter() - started


_STEPS: dict[tuple[str, str, Any], CompiledStep] = {}
_compiling_s = [0.0]


def compiling_seconds() -> float:
    """Seconds this process spent in calls of a compiled step that compiled a graph (the compiling, and that one
    step's run). The loop keeps them out of a generation's decode time."""
    return _compiling_s[0]


def compiled_step(device: torch.device, backend: Any = "inductor") -> CompiledStep:
    """The target's compiled step for `device` (one per process)."""
    key = ("target", device.type, backend)
    if key not in _STEPS:
        _STEPS[key] = CompiledStep(run_target, "target step", device.type, backend=backend, cuda_graphs=True)
    return _STEPS[key]


def compiled_draft_step(device: torch.device, backend: Any = "inductor") -> CompiledStep:
    """The drafter's compiled step for `device` (one per process). Dynamic shapes everywhere: each step brings
    a different number of new context rows, and attention reads a prefix that grows."""
    key = ("drafter", device.type, backend)
    if key not in _STEPS:
        _STEPS[key] = CompiledStep(run_drafter, "draft step", device.type, backend=backend)
    return _STEPS[key]
