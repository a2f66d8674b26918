"""The `dflash` command line: wiring only. Each command is a module of this package (cli/chat.py, cli/run.py, ...)
holding its typer signature: it parses its flags (shared ones from cli/flags.py), calls its `dflash_cli.commands`
module, and hands the result to cli/output.py, which prints it as JSON or for a person.

Startup stays fast: torch, transformers and the engine are imported inside the commands that need them, so
`dflash --help` and `dflash recipes list` never load them.
"""

import itertools
from typing import Annotated, Any

import typer
from typer.core import TyperGroup, TyperOption

from dflash_cli import __version__
from dflash_cli.cli import bench, chat, doctor, export, pull, recipes, run, serve, train
from dflash_cli.cli.output import JSON_ASKED, emit_error, print_error
from dflash_cli.errors import DflashError
from dflash_cli.setup.thread_count import start_load_window

_shown_type = getattr(TyperOption, "display_type_rich", None)  # (typer 0.29's; older versions print no such type)


def _flag_type(option: TyperOption, ctx: Any) -> str | None:
    """A flag takes no value, so --help shows no type beside it (typer 0.29 prints `<bool>` beside every flag)."""
    return None if option.is_flag and option.metavar is None else _shown_type(option, ctx)


if _shown_type is not None:
    TyperOption.display_type_rich = _flag_type  # type: ignore[method-assign]


JSON_ON_LINE = "dflash.json-on-line"  # ctx.meta: the command takes --json and its line holds it


def _takes_json(ctx: Any, command: Any, args: list[str]) -> bool:
    """Whether `command` (a group: the subcommand `args` name) has a --json flag."""
    while command is not None and hasattr(command, "get_command") and args:
        command, args = command.get_command(ctx, args[0]), args[1:]
    return command is not None and any("--json" in getattr(param, "opts", ()) for param in command.params)


# Commands of other tools (ollama, llama.cpp, vLLM) a user may type here, and what does that in dflash
_LISTING = "`dflash recipes list` lists the models it runs; `dflash doctor` says which fit this machine"
_IN_PROCESS = "dflash runs models in-process (no daemon holds them): "
HABITS = {
    "list": _LISTING,
    "ls": _LISTING,
    "show": "`dflash recipes show NAME` shows a recipe",
    "ps": _IN_PROCESS + "`dflash serve NAME` keeps one loaded",
    "generate": "`dflash chat NAME --prompt TEXT` answers one prompt; `dflash run NAME prompts.jsonl` many",
    "stop": _IN_PROCESS + "Ctrl-C stops `dflash serve`",
}


UsageError = typer.BadParameter.__base__  # click's, from the click this typer uses (its own copy, or the package)


class DflashGroup(TyperGroup):
    """Every DflashError raised below becomes `error:` / `fix:` lines and its exit code, never a traceback; with
    --json, a usage error or a DflashError is also written to stdout as JSON (output.emit_error). (Ctrl-C already
    exits with 130 in typer.) Another tool's command gets a pointer to dflash's (HABITS)."""

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        if args and args[0] in HABITS and self.get_command(ctx, args[0]) is None:
            ctx.fail(f"No such command '{args[0]}': {HABITS[args[0]]}.")  # (typer's click or click: its own error)
        name, command, rest = super().resolve_command(ctx, args)
        # A flag the command refuses stops its parsing before --json is read (output.remember_json): the line is
        # read for it then, where the command (or a group's subcommand) has one.
        ctx.meta[JSON_ON_LINE] = _takes_json(ctx, command, rest) and "--json" in itertools.takewhile(
            lambda arg: arg != "--", rest
        )
        return name, command, rest

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except DflashError as error:
            print_error(error)
            if ctx.meta.get(JSON_ASKED):
                emit_error(error.message, error.fix, error.exit_code)
            raise typer.Exit(error.exit_code) from None
        except UsageError as error:
            if ctx.meta.get(JSON_ASKED) or ctx.meta.get(JSON_ON_LINE):
                command = error.ctx.command_path if error.ctx is not None else "dflash"
                emit_error(error.format_message(), f"see `{command} --help`", error.exit_code)
            raise


app = typer.Typer(
    name="dflash",
    cls=DflashGroup,
    help="Fast self-hosted LLM inference in one command, with lossless DFlash speculative decoding.\n\n"
    "Start with `dflash doctor` to see what this machine can run, then `dflash chat demo` (any CPU) or a recipe it "
    "lists as fitting (`dflash chat qwen3-8b` on a GPU).",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,  # locals can hold tokens and whole tensors
    context_settings={"help_option_names": ["-h", "--help"]},
)
recipes_app = typer.Typer(help="List and inspect recipes (a target model + its DFlash drafter).", no_args_is_help=True)
app.add_typer(recipes_app, name="recipes", rich_help_panel="Models")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dflash {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    # Other processes' CPU load is measured from here on, so that the thread plan, made after torch and the model
    # are loaded, needs no wait of its own.
    start_load_window()


app.command(rich_help_panel="Run")(chat.chat)
app.command(rich_help_panel="Run")(run.run)
app.command(rich_help_panel="Run")(serve.serve)
app.command(rich_help_panel="Run")(bench.bench)
app.command(rich_help_panel="Models")(pull.pull)
app.command(rich_help_panel="Models")(train.train)
recipes_app.command("list")(recipes.recipes_list)
recipes_app.command("show")(recipes.recipes_show)
app.command(rich_help_panel="Machine")(doctor.doctor)
app.command(rich_help_panel="Scale out")(export.export)


def main() -> None:
    """Console-script entry point (`dflash`, `python -m dflash_cli`)."""
    app(prog_name="dflash")
