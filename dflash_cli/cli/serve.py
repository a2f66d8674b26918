"""`dflash serve`: the OpenAI- and Anthropic-compatible HTTP server."""

import dataclasses
import re
from typing import Annotated

import typer

from dflash_cli.cli.flags import SERVER, BatchSize, CacheRam, NoPrefixCache, with_run_flags
from dflash_cli.cli.output import err_console
from dflash_cli.setup.options import RunOptions

DEFAULT_PORTS = {"http": ":80", "https": ":443"}  # left out of an Origin header by browsers


def origins(value: str | None) -> tuple[str, ...]:
    """--allowed-origins as a browser sends an Origin header (the server compares them as strings): scheme://host
    in lower case, the scheme's default port left out, no path (a trailing / is dropped: a page's address copied
    whole)."""
    read = []
    for part in (value or "").split(","):
        origin = part.strip().removesuffix("/").lower()
        port = DEFAULT_PORTS.get(origin.partition("://")[0])
        if origin:
            read.append(origin.removesuffix(port) if port else origin)
    return tuple(read)


def check_origins(value: str | None) -> str | None:
    for origin in origins(value):
        if origin != "*" and not re.fullmatch(r"[a-z][a-z0-9+.-]*://[^/?#\s]+", origin):
            raise typer.BadParameter(
                f"{origin!r} is not an origin: give scheme://host[:port], such as https://a.example"
            )
    return value


@with_run_flags
def serve(
    options: RunOptions,
    ctx: typer.Context,
    host: Annotated[
        str,
        typer.Option(
            help="Address to listen on (0.0.0.0: every interface; then set --api-key).", rich_help_panel=SERVER
        ),
    ] = "127.0.0.1",
    port: Annotated[
        int, typer.Option(min=0, max=65535, help="Port to listen on (0: any free one).", rich_help_panel=SERVER)
    ] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            envvar="DFLASH_API_KEY",
            show_default=False,
            help="Require `Authorization: Bearer KEY` on /v1 routes (default: $DFLASH_API_KEY, else open).",
            rich_help_panel=SERVER,
        ),
    ] = None,
    max_queue: Annotated[
        int,
        typer.Option(
            min=0,
            help="Requests that may wait while the batch is full; more get HTTP 429 at once.",
            rich_help_panel=SERVER,
        ),
    ] = 64,
    allowed_origins: Annotated[
        str | None,
        typer.Option(
            "--allowed-origins",
            metavar="ORIGINS",
            callback=check_origins,
            show_default=False,
            help="Web pages that may call the API from a browser (CORS), comma-separated, e.g. "
            "https://chat.example.com; * for any. Pages served from localhost (127.0.0.1, [::1]) always may.",
            rich_help_panel=SERVER,
        ),
    ] = None,
    batch_size: BatchSize = None,
    no_prefix_cache: NoPrefixCache = False,
    cache_ram: CacheRam = None,
) -> None:
    """Serve a model over OpenAI- and Anthropic-compatible HTTP APIs, for Open WebUI, editors, agents (Claude Code, Codex CLI) and the `openai` and `anthropic` clients.

    POST /v1/chat/completions, /v1/completions and /v1/responses (OpenAI; streaming with "stream": true), /v1/messages and /v1/messages/count_tokens (Anthropic), GET /v1/models, /health, /metrics (Prometheus). The model loads once and one engine thread decodes the queued requests, up to --batch-size at once (continuous batching); a client that disconnects stops its generation. Request fields override the sampling flags, which are the defaults (greedy unless --temperature); replies carry usage plus a "dflash" object (tau, acceptance histogram, decode tok/s).

    Example: `dflash serve demo`, then `curl http://127.0.0.1:8000/v1/chat/completions -H "Content-Type: application/json" -d '{"messages": [{"role": "user", "content": "Hi"}]}'`. Claude Code: `ANTHROPIC_BASE_URL=http://127.0.0.1:8000 ANTHROPIC_MODEL=demo claude`; Codex CLI: a model provider with base_url http://127.0.0.1:8000/v1 and wire_api "responses" (docs/serve.md)
    """
    options = dataclasses.replace(
        options.overriding(batch_size=batch_size, cache_ram_mib=cache_ram), prefix_cache=not no_prefix_cache
    )
    options.resolve_recipe()  # input mistakes fail here, before torch is imported
    from dflash_cli.commands.serve.launch import run_server

    # The operator's --max-tokens caps a Responses reply asked without max_output_tokens; none given, it may fill
    # the context window (Codex sends none and takes a reply cut short for an error)
    capped = getattr(ctx.get_parameter_source("max_tokens"), "name", "DEFAULT") != "DEFAULT"
    run_server(
        options, host=host, port=port, api_key=api_key, max_queue=max_queue, fill_window=not capped,
        console=err_console, allowed_origins=origins(allowed_origins),
    )  # fmt: skip
