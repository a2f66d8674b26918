"""`dflash bench`: `prompts` (the built-in sets and prompt files), `measure` (timing one generation per mode, the
rounds), `report` (comparison with the baseline, summaries, the report schema and its rendering), `runner` (the whole
run: pacing, progress) and `roofline` (read bandwidth: the floor of a step). The benchmarks only we run are outside
the package, in the checkout's benchmarks/. The command's API, torch-free to import:"""

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
