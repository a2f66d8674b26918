"""`dflash export`: the command that serves a recipe with DFlash on vLLM, SGLang or llama.cpp."""

from typing import Annotated

import typer

from dflash_cli.cli.flags import Drafter, GpuMemory, Gpus, JsonFlag, RecipeFile, RecipeName, Target, check_server
from dflash_cli.cli.output import emit, show_text
from dflash_cli.setup.recipes import resolve_recipe


def export(
    server: Annotated[str, typer.Argument(metavar="SERVER", callback=check_server, help="vllm, sglang or llama.cpp.")],
    name: RecipeName = None,
    target: Target = None,
    drafter: Drafter = None,
    recipe_file: RecipeFile = None,
    gpus: Gpus = None,
    gpu_memory: GpuMemory = None,
    json_output: JsonFlag = False,
) -> None:
    """Print the command that serves a recipe with DFlash on vLLM (`vllm serve ... --speculative-config`), SGLang (`python -m sglang.launch_server ... --speculative-algorithm DFLASH`) or llama.cpp (`llama-server -m TARGET.gguf -md DRAFTER.gguf --spec-type draft-dflash`, with the GGUF conversion steps)."""
    from dflash_cli.commands.export import export_command

    command = export_command(server, resolve_recipe(name, recipe_file, target, drafter), gpus, gpu_memory)
    emit(command.to_dict(), json_output, lambda: show_text(command.text()))
