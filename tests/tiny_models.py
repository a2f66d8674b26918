"""Tiny real models and Hugging Face caches for tests.

Everything here builds real artifacts offline, in milliseconds:

- `make_tiny_qwen3(dir, seed)` / `make_tiny_llama(dir, seed)`: a random-init transformers model saved with
  `save_pretrained` (safetensors, float32) plus a real byte-level BPE tokenizer with a ChatML chat template.
- `make_hf_cache(hf_home, repo_id, src_dir)`: the files of `src_dir` laid out the way huggingface_hub stores a
  download (`hub/models--org--name/{blobs,refs/main,snapshots/<sha>}`), so the real hub calls find them.
- `tiny_tokenizer()`: the tokenizer alone.

Stable interface: other test files import these names; keep their signatures.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

# ChatML, the format of the Qwen chat templates; `enable_thinking` is accepted the way Qwen3's template does.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_VOCAB = 320  # 256 byte symbols + a few merges + the special tokens
MODEL_VOCAB = 384  # >= the tokenizer's vocabulary; a multiple of 64 like real models

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts a block of tokens and the target verifies them in one pass.",
    "def add(a, b):\n    return a + b\n",
    "What is 2 + 2? The answer is 4.",
    "Hello! How can I help you today?",
]


@functools.cache
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok.to_str()


def tiny_tokenizer() -> Any:
    """A fresh PreTrainedTokenizerFast: byte-level BPE (any text encodes), ChatML template, eos `<|im_end|>`."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def _save(
    config_class_name: str,
    model_dir: str | os.PathLike,
    seed: int,
    with_tokenizer: bool,
    max_shard_size: str | None,
    cfg: dict[str, Any],
) -> Path:
    import torch
    import transformers

    tok = tiny_tokenizer()
    fields = dict(
        vocab_size=MODEL_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    config = getattr(transformers, config_class_name)(**{**fields, **cfg})
    model_dir = Path(model_dir)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    # safetensors is the default; a small max_shard_size writes shards plus model.safetensors.index.json
    model.save_pretrained(model_dir, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    if with_tokenizer:
        tok.save_pretrained(model_dir)
    return model_dir


def make_tiny_qwen3(
    model_dir: str | os.PathLike,
    seed: int = 0,
    *,
    with_tokenizer: bool = True,
    max_shard_size: str | None = None,
    **cfg: Any,
) -> Path:
    """Save a random-init Qwen3ForCausalLM (2 layers, hidden 64, vocab 384, float32) to `model_dir`.

    `cfg` overrides Qwen3Config fields (e.g. `num_hidden_layers=4`); `max_shard_size="100KB"` saves a sharded
    checkpoint with an index. Returns `model_dir` as a Path.
    """
    return _save("Qwen3Config", model_dir, seed, with_tokenizer, max_shard_size, cfg)


def make_tiny_llama(
    model_dir: str | os.PathLike,
    seed: int = 0,
    *,
    with_tokenizer: bool = True,
    max_shard_size: str | None = None,
    **cfg: Any,
) -> Path:
    """Save a random-init LlamaForCausalLM (2 layers, hidden 64, vocab 384, float32) to `model_dir`; the
    arguments are those of `make_tiny_qwen3`."""
    return _save("LlamaConfig", model_dir, seed, with_tokenizer, max_shard_size, cfg)


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def make_hf_cache(
    hf_home: str | os.PathLike,
    repo_id: str,
    src_dir: str | os.PathLike,
    *,
    sha: str = "0123456789abcdef0123456789abcdef01234567",
    revision: str = "main",
) -> Path:
    """Lay out `src_dir`'s files as a huggingface_hub cache entry of `repo_id` under `hf_home/hub`.

    Blobs are named like the Hub's etags (sha256 for weights, git sha1 for the rest); snapshot files are
    relative symlinks to them; `refs/<revision>` holds `sha`. Returns the snapshot directory.
    Call it again with another `sha`/`revision` to add a second revision of the same repo.
    """
    storage = Path(hf_home) / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = storage / "snapshots" / sha
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    src_dir = Path(src_dir)
    for src in sorted(p for p in src_dir.rglob("*") if p.is_file()):
        data = src.read_bytes()
        etag = hashlib.sha256(data).hexdigest() if src.suffix == ".safetensors" else _git_blob_sha1(data)
        blob = storage / "blobs" / etag
        if not blob.exists():
            shutil.copyfile(src, blob)
        link = snapshot / src.relative_to(src_dir)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (storage / "refs" / revision).write_text(sha)
    return snapshot
