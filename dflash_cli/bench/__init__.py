"""`dflash bench` and the benchmarks behind `scripts/`: `prompts` (the built-in sets and prompt files), `measure`
(timing one generation per mode, the rounds), `report` (comparison with the baseline, summaries, the report schema
and its rendering), `runner` (the whole run: pacing, progress), `roofline` (read bandwidth: the floor
of a step) and `gpu` (the GPU fast-path benchmark). The other benchmarks scripts/ wraps, each with a `main(argv)`:
`correctness` (the golden sets on a device), `floor` (the CPU's steps against the bandwidth floor), `batching`
(`dflash run` at several batch sizes), `hybrid_batch` and `rollback` (a hybrid target's batches and rollback),
`recipe_sizes` (recipes' sizes from the published architectures). The command's API, torch-free to import:"""

from dflash_cli.bench.prompts import PROMPT_SETS
from dflash_cli.bench.report import FULL_MAX_TOKENS, QUICK_MAX_TOKENS, BenchSettings, print_report, save_png, write_json
from dflash_cli.bench.runner import benchmark, parse_block_sizes

__all__ = [
    "FULL_MAX_TOKENS",
    "PROMPT_SETS",
    "QUICK_MAX_TOKENS",
    "BenchSettings",
    "benchmark",
    "parse_block_sizes",
    "print_report",
    "save_png",
    "write_json",
]
