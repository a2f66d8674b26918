"""The target forward the loop runs each step, eager or compiled (one graph per block size, full graph).

Compiling removes the per-op Python and dispatch cost of an eager transformers forward (tens of ops per
layer) but costs minutes on a small CPU, so it is used where it pays:

- CUDA: `mode="reduce-overhead"` (CUDA graphs), static shapes. The state hands attention its whole K/V
  buffer and keeps its length in a device tensor, so one graph serves every step of a block size.
- CPU: inductor with dynamic shapes, the state handing attention the committed prefix plus the block (the
  prefix length is symbolic, so it never recompiles as the context grows). Off by default: see
  docs/benchmarks.md for what it costs and saves on a 2-core CPU.

Compiled artifacts go to the dflash cache directory (inductor's FX graph cache), so a second start skips
code generation; tracing still runs in each new process.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch

def compile_cache_dir() -> Path:
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("dflash")) / "compile"


def use_compile_cache() -> Path:
    """Point inductor's caches at the dflash cache directory (unless the user chose one)."""
    directory = os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(compile_cache_dir()))
    return Path(directory)


def run_target(model: Any, token_ids: torch.Tensor, cache: Any, offset: int | torch.Tensor, logits_to_keep: int) -> torch.Tensor:
    """One target forward over `token_ids` [1, q] at positions offset .. offset+q-1; logits [q', vocab]."""
    positions = (torch.arange(token_ids.shape[1], device=token_ids.device) + offset)[None]
    out = model(
        input_ids=token_ids, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=logits_to_keep
    )
    return out.logits[0]


class CompiledStep:
    """`run_target` compiled for one device type; its graphs are per block size and shared by every state.

    The first call for a (model, block size) compiles; `notify` (a context manager factory taking a message)
    shows a progress line around it. If compiling fails, a warning says so and the step runs eagerly.
    """

    def __init__(self, device_type: str, backend: Any = "inductor") -> None:
        use_compile_cache()
        options: dict[str, Any] = {"fullgraph": True, "backend": backend}
        if device_type == "cuda":
            options.update(dynamic=False, **({"mode": "reduce-overhead"} if backend == "inductor" else {}))
        else:
            options.update(dynamic=True)
        self.fn = torch.compile(run_target, **options)
        self.compiled: set[tuple[int, int]] = set()
        self.broken: str | None = None  # why compiling failed: later calls run eagerly

    def __call__(
        self, model: Any, token_ids: torch.Tensor, cache: Any, offset: int | torch.Tensor, notify: Notify | None = None
    ) -> torch.Tensor:
        if self.broken is not None:
            return run_target(model, token_ids, cache, offset, 0)
        key = (id(model), token_ids.shape[1])
        if key in self.compiled or notify is None:
            return self._run(model, token_ids, cache, offset)
        with notify(
            f"compiling the target's {token_ids.shape[1]}-token step (first use; cached in {use_compile_cache()})"
        ):
            out = self._run(model, token_ids, cache, offset)
        self.compiled.add(key)
        return out

    def _run(self, model: Any, token_ids: torch.Tensor, cache: Any, offset: int | torch.Tensor) -> torch.Tensor:
        try:
            return self.fn(model, token_ids, cache, offset, 0)
        except torch._dynamo.exc.TorchDynamoException as error:  # nothing ran: the graph never executed
            self.broken = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            warnings.warn(f"compiling the target step failed ({self.broken}); decoding eagerly (--compile off)", stacklevel=2)
            return run_target(model, token_ids, cache, offset, 0)


Notify = Callable[[str], ContextManager[Any]]
_STEPS: dict[tuple[str, Any], CompiledStep] = {}


def compiled_step(device: torch.device, backend: Any = "inductor") -> CompiledStep:
    key = (device.type, backend)
    if key not in _STEPS:
        _STEPS[key] = CompiledStep(device.type, backend)
    return _STEPS[key]
