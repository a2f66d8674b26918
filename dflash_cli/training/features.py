"""The target's features of every training sequence, computed once and kept on disk.

A training step reads, for each sequence, the outputs of the drafter's target layers at every position; the target's
forward that makes them costs far more than the drafter's step, so it runs once per sequence (right-padded batches
of similar lengths) and its rows go to one flat bf16 file per set of layers, read memory-mapped: a run's data may
outgrow host memory, and a later run (another drafter shape reading the same layers, a resumed run) reads them
again for nothing. An index beside the file gives each sequence's first row and row count.

Where the target is served quantized on a CPU (the demo's int4), the training copy holds its weights dequantized,
whose bf16 products differ from the served int4/int8 kernels' by 2.8% a row on average: the features then come
from the engine's own prefill (`ServedFeatures`, in a store named for those numerics), which gave a traced decode's
features bit for bit (benchmarks/results/history.md), and 2.9x faster there than the bf16 forward (2 cores without
AMX).
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from rich.progress import Progress

try:
    import fcntl
except ImportError:  # (Windows)
    fcntl = None

from dflash_cli.engine.target import acquire_state, release_state
from dflash_cli.engine.target.base import capture_target_features
from dflash_cli.training.distill import Sample

BATCH_TOKENS = 4096  # tokens per forward while computing features (padding included)


class FeatureSource(Protocol):
    """What computes features: `rows(batch)` gives each sequence's features at its positions but the last, [len-1,
    n*H]; a batch holds at most `batch_tokens` tokens, padding included (one sequence when smaller)."""

    batch_tokens: int

    def rows(self, batch: Sequence[list[int]]) -> list[torch.Tensor]: ...


class ForwardFeatures:
    """The model's own forward over right-padded batches (the training target's numerics)."""

    batch_tokens = BATCH_TOKENS

    def __init__(self, model: Any, layer_ids: Sequence[int]) -> None:
        self.model, self.layer_ids = model, list(layer_ids)

    def rows(self, batch: Sequence[list[int]]) -> list[torch.Tensor]:
        longest = max(len(ids) for ids in batch)
        device = self.model.get_input_embeddings().weight.device
        # Right padding and causal attention: real positions never see the pads, so no mask is needed.
        padded = torch.tensor([ids + [0] * (longest - len(ids)) for ids in batch], device=device)
        with torch.inference_mode():
            _, features = capture_target_features(self.model, padded, self.layer_ids, use_cache=False, logits_to_keep=1)
        return [features[row, : len(ids) - 1] for row, ids in enumerate(batch)]


class ServedFeatures:
    """The engine's prefill of each sequence, as dflash serves the target (its plan's weights, kernels and stored
    steps): the features the drafter reads of a prompt when it drafts. Close it to release the target's state."""

    batch_tokens = 0  # one sequence a forward: a prefill runs one row

    def __init__(self, target: Any, layer_ids: Sequence[int]) -> None:
        self.state, self.layer_ids = acquire_state(target), tuple(layer_ids)
        self.device = target.get_input_embeddings().weight.device

    def rows(self, batch: Sequence[list[int]]) -> list[torch.Tensor]:
        out = []
        for ids in batch:
            self.state.reserve(len(ids), 1, self.layer_ids)
            with torch.inference_mode():
                self.state.prefill(torch.tensor([ids], device=self.device), 0, 0)
                out.append(self.state.features(len(ids) - 1, 0)[0].clone())  # (the state's buffer)
        return out

    def close(self) -> None:
        release_state(self.state)


class FeatureStore:
    """`directory/features-L{layers}[-{numerics}].bin` (rows of n*H bf16) and its `.json` index {key: [first row,
    rows]}; `numerics` names where the features came from when not the training target's forward (ServedFeatures:
    the served weights, e.g. "int4")."""

    def __init__(self, directory: Path, layer_ids: Sequence[int], width: int, numerics: str = "") -> None:
        name = "features-L" + "-".join(str(i) for i in layer_ids) + (f"-{numerics}" if numerics else "")
        self.data, self.index_path = directory / f"{name}.bin", directory / f"{name}.json"
        self.lock_path = directory / f"{name}.lock"
        self.layer_ids, self.width = list(layer_ids), width
        self._read()

    def _read(self) -> None:
        self.index: dict[str, list[int]] = json.loads(self.index_path.read_text()) if self.index_path.is_file() else {}
        self.rows = max((first + count for first, count in self.index.values()), default=0)

    def missing(self, samples: Sequence[Sample]) -> list[Sample]:
        """The samples without stored features (or with features of another answer to their prompt: its length)."""
        return [s for s in samples if self.index.get(s.key, (0, -1))[1] != len(s.ids) - 1]

    def add(self, source: FeatureSource, samples: Sequence[Sample], progress: Progress) -> None:
        """Compute and store the features of the samples the store lacks (a batch at a time, so a stopped run keeps
        what it wrote). One writer at a time: runs that share a store (several drafters trained side by side from
        one run's answers) would append their rows among each other's, each indexing its own as if alone; a later
        writer reads what the earlier one stored and computes only the rest."""
        if not self.missing(samples):  # (a complete store may be read-only, or shared)
            return
        with _locked(self.lock_path):
            self._read()
            # Rows past the index (a writer stopped between its rows and the index) are written over.
            if self.data.is_file() and self.data.stat().st_size > self.rows * 2 * self.width:
                with self.data.open("r+b") as file:
                    file.truncate(self.rows * 2 * self.width)
            self._append(source, samples, progress)

    def _append(self, source: FeatureSource, samples: Sequence[Sample], progress: Progress) -> None:
        todo = sorted({s.key: s for s in self.missing(samples)}.values(), key=lambda s: len(s.ids))
        if not todo:
            return
        task = progress.add_task("target features", total=len(todo), info="")
        start = 0
        with self.data.open("ab") as out:
            while start < len(todo):
                end = start + 1
                while end < len(todo) and (end - start + 1) * len(todo[end].ids) <= source.batch_tokens:
                    end += 1
                batch = todo[start:end]
                for sample, features in zip(batch, source.rows([s.ids for s in batch]), strict=True):
                    rows = features.to(torch.bfloat16).cpu().contiguous()
                    out.write(rows.view(torch.int16).numpy().tobytes())
                    self.index[sample.key] = [self.rows, len(rows)]
                    self.rows += len(rows)
                out.flush()
                self._save_index()
                progress.advance(task, len(batch))
                start = end

    def attach(self, samples: Sequence[Sample]) -> None:
        """Point each sample's `features` at its rows of the file (memory-mapped read-only: never written)."""
        if not self.rows:
            return
        # Read-only, not copy-on-write: Linux refuses a private writable mapping larger than its memory (a 27 GB
        # store on a 24 GB machine), a shared read-only one it pages in and out at will.
        mapped = np.memmap(self.data, dtype=np.int16, mode="r", shape=(self.rows, self.width))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            for sample in samples:
                first, count = self.index[sample.key]
                sample.features = torch.from_numpy(mapped[first : first + count]).view(torch.bfloat16)

    def _save_index(self) -> None:
        staging = self.index_path.with_suffix(".json.tmp")
        staging.write_text(json.dumps(self.index))
        os.replace(staging, self.index_path)  # the rows first, then the index that points at them


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (created) for the block, across processes (flock; nothing where there is none)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        try:
            if fcntl is not None:
                fcntl.flock(handle, fcntl.LOCK_EX)  # (released when the file closes)
        except OSError as error:  # (a file system without locks: NFS mounted nolock)
            warnings.warn(f"{path}: not locked ({error}); only one run may write this store", stacklevel=3)
        yield
