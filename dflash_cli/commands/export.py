"""`dflash export vllm|sglang|llama.cpp NAME`: the command that serves a recipe with DFlash elsewhere.

For users who outgrow one machine: vLLM and SGLang run DFlash drafters natively, with batching and tensor
parallelism. llama.cpp's `llama-server` runs DFlash and DFlash2 drafters from GGUF files, on GPUs and CPUs with
quantized targets. The command is built as an argv list and shell-quoted once, so it pastes as is.
"""

from __future__ import annotations

import contextlib
import json
import shlex
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dflash_cli.errors import DflashError
from dflash_cli.setup.choices import gb
from dflash_cli.setup.hardware import MachineFacts, detect_machine
from dflash_cli.setup.recipes import PACKAGE_PREFIX, ModelRef, Recipe
from dflash_cli.wording import plural

if TYPE_CHECKING:
    from dflash_cli.engine.drafter.config import DrafterConfig

# Weights take at most 1/1.3 of the GPUs' memory: the rest holds the KV cache, activations and CUDA graphs
# (vLLM claims 90% of each GPU by default and sizes its KV cache from what the weights leave).
TP_HEADROOM = 1.3
# Sizing for a serving machine when this one has no CUDA GPU: one 80 GB GPU (H100 / A100 80GB).
ASSUMED_GPU_MEMORY = 80_000_000_000
GPUS_PER_NODE = 8
MAX_TENSOR_PARALLEL = 8 * GPUS_PER_NODE  # sized for when the GPU count is not known: eight nodes
FALLBACK_BLOCK_SIZE = 16  # the block size of most published drafters


@dataclass(frozen=True)
class ServingHardware:
    gpu_count: int | None  # None: no GPU here and no --gpus: as many as the weights need
    gpu_memory: int  # bytes per GPU
    assumed: bool = False  # True: not measured here (no CUDA GPU on this machine, or given by flags)


@dataclass
class ExportedCommand:
    argv: list[str]
    notes: list[str] = field(default_factory=list)  # printed as shell comments above the command
    setup: list[str] = field(default_factory=list)  # shell commands run once before it (llama.cpp's GGUF conversion)

    @property
    def shell(self) -> str:
        return shlex.join(self.argv)

    def text(self) -> str:
        """Notes, then the setup commands (indented under the last note, which introduces them), as comments: what
        pastes and runs is the command alone."""
        comments = [*(f"# {note}" for note in self.notes), *(f"#   {step}" for step in self.setup)]
        return "\n".join([*comments, self.shell])

    def to_dict(self) -> dict[str, Any]:
        return {"command": self.argv, "shell": self.shell, "notes": self.notes, "setup": self.setup}


def serving_hardware(
    facts: MachineFacts, gpus: int | None = None, gpu_memory_gb: float | None = None
) -> ServingHardware:
    """The GPUs to size for: this machine's CUDA GPUs unless `gpus` / `gpu_memory_gb` say otherwise."""
    if gpus is not None and gpus < 1:
        raise DflashError(f"--gpus {gpus}: need at least one GPU", fix="pass --gpus 1 or more")
    measured = facts.kind == "cuda" and facts.total_memory is not None
    count = gpus or (facts.gpu_count if measured else None)
    memory = int(gpu_memory_gb * 1e9) if gpu_memory_gb else (facts.total_memory if measured else ASSUMED_GPU_MEMORY)
    return ServingHardware(count, memory, assumed=not measured or gpus is not None or gpu_memory_gb is not None)


def tensor_parallel_size(weight_bytes: int | None, hardware: ServingHardware) -> tuple[int, str | None]:
    """The smallest power-of-two GPU count whose memory holds the weights with headroom (attention heads split
    evenly only over powers of two), capped at the GPUs there are (at MAX_TENSOR_PARALLEL where that is not known);
    and a note when that is not enough."""
    count = hardware.gpu_count or MAX_TENSOR_PARALLEL
    sizes = [2**i for i in range(count.bit_length())]
    if weight_bytes is None:
        return 1, "the recipe does not list its size: tensor parallel size 1 assumed"
    need = weight_bytes * TP_HEADROOM
    for size in sizes:
        if size * hardware.gpu_memory >= need:
            return size, None
    return sizes[-1], (
        f"warning: the weights ({gb(weight_bytes)}) plus headroom need ~{gb(need)}, more than "
        f"{sizes[-1]} x {gb(hardware.gpu_memory)}: use more or bigger GPUs"
    )


def _unused_gpus_note(recipe: Recipe, hardware: ServingHardware, tp: int, fits: bool, data_parallel: str) -> str | None:
    """Why tensor parallel takes fewer GPUs than the serving machine has (the weights fit on fewer; a count that is
    not a power of two cannot split the heads evenly) and how to use the rest: copies of the model, data parallel."""
    count, weights = hardware.gpu_count, recipe.weight_bytes.get(recipe.checkpoint_precision)
    if count is None or tp >= count or weights is None:
        return None  # (a size unknown: tp's own note says it assumed 1, with nothing known to advise)
    reasons = []
    largest = 2 ** (count.bit_length() - 1)  # the largest tensor parallel size there is room for
    if fits and tp < largest:
        reasons.append(f"the weights ({gb(weights)}) fit on {plural(tp, 'GPU')} with headroom")
    if count != largest:
        heads = recipe.attention_heads
        reasons.append(
            f"{count} GPUs cannot split the model's {heads} attention heads evenly"
            if heads and heads % count
            else f"tensor parallel takes a power of two of GPUs (what splits attention and KV heads evenly), not {count}"
        )
    copies, rest = count // tp, count - tp
    if copies > 1:
        on = f" (on {copies * tp} of the {count})" if copies * tp < count else ""
        use = f"to use the rest, run {copies} copies of the model{on}, data parallel: {data_parallel} {copies}"
    else:
        use = "the other GPU stays idle" if rest == 1 else f"the other {rest} GPUs stay idle"
    return f"tensor parallel size {tp} of {count} GPUs: {'; '.join(reasons)}; {use}"


def _location(ref: ModelRef) -> str:
    """What the server loads: the repo id, or the absolute path of a local directory."""
    return str(ref.path) if ref.path is not None else ref.id


def _cached_drafter_config(drafter: ModelRef) -> DrafterConfig | None:
    """The drafter's config, when its config.json is local or already in the Hugging Face cache (a broken one is an
    error: the server would refuse it)."""
    config = drafter.local_file("config.json")
    if config is None:
        return None
    from dflash_cli.loading.checkpoint import read_drafter_config

    return read_drafter_config(config.parent)


def _plan_export(
    recipe: Recipe, hardware: ServingHardware, tensor_parallel: bool = True, data_parallel: str = "--data-parallel-size"
) -> tuple[ModelRef, int, int, list[str]]:
    if recipe.drafter is None:
        raise DflashError(
            f"recipe {recipe.name} has no drafter, so there is nothing to export for speculative decoding",
            fix="pass --drafter REPO_OR_PATH with --target",
        )
    notes: list[str] = []
    config = None
    # (with the recipe's block size, the config is only read for the draft vocabulary's note)
    with contextlib.suppress(DflashError) if recipe.block_size else contextlib.nullcontext():
        config = _cached_drafter_config(recipe.drafter)
    block_size = recipe.block_size or (config.block_size if config else None)
    if config is not None and config.draft_vocab_size is not None:
        notes.append(
            f"dflash lets this drafter propose only the {config.draft_vocab_size} tokens it was trained on "
            "(draft_vocab.json); this engine reads the same weights and proposes from the whole vocabulary: the "
            "output is the same, its acceptance may be lower"
        )
    if block_size is None:
        block_size = FALLBACK_BLOCK_SIZE
        why = (
            f"{recipe.drafter.path} has no config.json"
            if recipe.drafter.path is not None
            else f"its config is not cached yet (`dflash pull {recipe.name}` fetches it)"
        )
        notes.append(f"block size {FALLBACK_BLOCK_SIZE} assumed: the recipe leaves it to the drafter config, and {why}")
    tp, tp_note = tensor_parallel_size(recipe.weight_bytes.get(recipe.checkpoint_precision), hardware)
    if not tensor_parallel:
        tp, tp_note = 1, None
    elif hardware.assumed:
        count, memory = hardware.gpu_count, gb(hardware.gpu_memory)
        gpus = f"{memory} GPUs, as many as the weights need" if count is None else f"{count} x {memory} GPU"
        notes.append(f"tensor parallel size for {gpus}, not measured here; change with --gpus N --gpu-memory GB")
    if tp_note:
        notes.append(tp_note)
    unused = _unused_gpus_note(recipe, hardware, tp, tp_note is None, data_parallel) if tensor_parallel else None
    if unused:
        notes.append(unused)
    if tp > GPUS_PER_NODE:
        nodes = tp // GPUS_PER_NODE
        notes.append(
            f"{tp} GPUs is more than one node of {GPUS_PER_NODE}: a multi-node setup (vLLM over Ray, often "
            f"--tensor-parallel-size {GPUS_PER_NODE} --pipeline-parallel-size {nodes}; SGLang --nnodes {nodes})"
        )
    if recipe.gated:
        notes.append(f"{recipe.target.id} is gated: accept its license on huggingface.co and set HF_TOKEN first")
    for what, ref in (("target", recipe.target), ("drafter", recipe.drafter)):
        if ref.path is not None:
            where = (
                "ships inside the dflash package on this machine"
                if ref.id.startswith(PACKAGE_PREFIX)
                else "is a local directory"
            )
            notes.append(
                f"the {what} {where}: copy {ref.path} to the serving machine and keep (or edit) that path in the command"
            )
    return recipe.drafter, block_size, tp, notes


def _template_options(recipe: Recipe, flag: str | None, value: str = "") -> tuple[list[str], list[str]]:
    """The recipe's chat template options (Qwen3's `enable_thinking: false`) as the server's default, `flag VALUE`,
    so clients that cannot send them with each request (Open WebUI) get them too; where the server has no such
    flag (`flag` None), a note saying to send them. Returns (argv to add, notes)."""
    if not recipe.chat_template_kwargs:
        return [], []
    options = json.dumps(recipe.chat_template_kwargs)
    trained = "the drafter was trained with these chat template options"
    if flag is None:
        return [], [
            f'{trained}; send them with each request: "chat_template_kwargs": {options} (sglang.launch_server '
            "documents no server-wide default for them: a client that cannot send them, such as Open WebUI, gets the "
            "template's own)"
        ]
    return [flag, value or options], [
        f"{trained}: {options}, set below as the server's default ({flag}) for clients that send none (Open WebUI)"
    ]


def vllm_command(recipe: Recipe, hardware: ServingHardware) -> ExportedCommand:
    """`vllm serve TARGET --speculative-config {...}`: vLLM counts speculative tokens, the block minus the
    position that carries the last committed token."""
    drafter, block_size, tp, notes = _plan_export(recipe, hardware)
    spec = {"method": "dflash", "model": _location(drafter), "num_speculative_tokens": block_size - 1}
    if drafter.revision:
        spec["revision"] = drafter.revision
    argv = ["vllm", "serve", _location(recipe.target)]
    if recipe.target.revision:
        argv += ["--revision", recipe.target.revision]
    argv += ["--speculative-config", json.dumps(spec), "--tensor-parallel-size", str(tp)]
    options, said = _template_options(recipe, "--default-chat-template-kwargs")
    return ExportedCommand(argv + options, notes + said)


def sglang_command(recipe: Recipe, hardware: ServingHardware) -> ExportedCommand:
    """`python -m sglang.launch_server ... --speculative-algorithm DFLASH`: SGLang counts draft tokens as the
    whole block."""
    drafter, block_size, tp, notes = _plan_export(recipe, hardware, data_parallel="--dp-size")
    argv = ["python", "-m", "sglang.launch_server", "--model-path", _location(recipe.target)]
    if recipe.target.revision:
        argv += ["--revision", recipe.target.revision]
    argv += ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", _location(drafter)]
    if drafter.revision:
        argv += ["--speculative-draft-model-revision", drafter.revision]
    argv += ["--speculative-num-draft-tokens", str(block_size), "--tp-size", str(tp)]
    return ExportedCommand(argv, notes + _template_options(recipe, None)[1])


def _gguf_file(ref: ModelRef, precision: str) -> str:
    """The GGUF file name a conversion writes: the model's name and its precision."""
    name = ref.path.name if ref.path is not None else ref.id.rsplit("/", 1)[-1]
    return f"{name}-{precision}.gguf"


def _download_dir(ref: ModelRef) -> str:
    """A shell word for the model's local directory: the path itself, or `$(hf download REPO)`."""
    if ref.path is not None:
        return shlex.quote(str(ref.path))
    revision = f" --revision {shlex.quote(ref.revision)}" if ref.revision else ""
    return f"$(hf download {shlex.quote(ref.id)}{revision})"


def llama_cpp_command(recipe: Recipe, hardware: ServingHardware) -> ExportedCommand:
    """`llama-server -m TARGET.gguf -md DRAFTER.gguf --spec-type draft-dflash`: llama.cpp counts the drafted
    tokens (block size minus one) like vLLM. Both checkpoints are converted to GGUF once; the notes say how."""
    drafter, block_size, _, notes = _plan_export(recipe, hardware, tensor_parallel=False)
    # pre-quantized targets (gpt-oss's MXFP4) convert to their own GGUF type; plain ones to bf16
    target_type = recipe.checkpoint_precision if recipe.checkpoint_precision != "bf16" else "bf16"
    target_gguf, drafter_gguf = _gguf_file(recipe.target, target_type), _gguf_file(drafter, "bf16")
    outtype = "" if recipe.checkpoint_precision != "bf16" else " --outtype bf16"
    setup = [
        f"python convert_hf_to_gguf.py {_download_dir(recipe.target)}{outtype} --outfile {target_gguf}",
        f"python convert_hf_to_gguf.py {_download_dir(drafter)} --outtype bf16 --outfile {drafter_gguf}",
    ]
    argv = ["llama-server", "-m", target_gguf, "-md", drafter_gguf, "--spec-type", "draft-dflash"]
    argv += ["--draft-max", str(block_size - 1), "-ngl", "99", "-ngld", "99"]
    # llama-server reads the options as one JSON object, written compactly as its help shows it
    options, said = _template_options(
        recipe, "--chat-template-kwargs", json.dumps(recipe.chat_template_kwargs, separators=(",", ":"))
    )
    notes += said
    if recipe.checkpoint_precision == "bf16":
        smaller = target_gguf.replace("-bf16.", "-Q4_K_M.")
        notes.append(
            f"a smaller GPU: after the conversion, llama-quantize {target_gguf} {smaller} Q4_K_M and serve that with "
            "-m (the target only; the drafter stays bf16)"
        )
    notes.append(
        "llama.cpp reads GGUF: convert both checkpoints once with llama.cpp's converter (DFlash and DFlash2 drafters "
        "convert as their own architecture):"
    )
    return ExportedCommand(argv + options, notes, setup)


EXPORTERS = {"vllm": vllm_command, "sglang": sglang_command, "llama.cpp": llama_cpp_command}
SERVER_ALIASES = {"llamacpp": "llama.cpp", "llama-cpp": "llama.cpp", "llama-server": "llama.cpp"}


def export_command(
    server: str, recipe: Recipe, gpus: int | None = None, gpu_memory_gb: float | None = None
) -> ExportedCommand:
    """The command that serves `recipe` on `server` (an EXPORTERS key), sized for this machine's GPUs unless
    `gpus` / `gpu_memory_gb` describe the serving machine."""
    return EXPORTERS[server](recipe, serving_hardware(detect_machine(), gpus, gpu_memory_gb))
