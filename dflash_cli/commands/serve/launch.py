"""Running `dflash serve`: the socket bound before the model loads (a taken port fails in a second), the engine
thread and the worker, the HTTP app (http.py) on uvicorn until Ctrl-C, and one log line per generation."""

from __future__ import annotations

import copy
import ipaddress
import socket
from collections.abc import Callable
from typing import Any

import uvicorn
from rich.console import Console
from rich.markup import escape

from dflash_cli.commands.serve.http import Server
from dflash_cli.commands.serve.metrics import ServerMetrics
from dflash_cli.commands.serve.worker import EngineThread, Job, Update, Worker
from dflash_cli.errors import DflashError
from dflash_cli.protocol.anthropic import COUNT_TOKENS_URL, MESSAGES_URL
from dflash_cli.protocol.openai_responses import RESPONSES_URL
from dflash_cli.protocol.requests import CHAT_URL, COMPLETIONS_URL
from dflash_cli.setup.options import RunOptions


class _Uvicorn(uvicorn.Server):
    """uvicorn, plus: the first Ctrl-C (SIGINT/SIGTERM) also cancels the engine's work, so open streams end
    at their next step instead of holding the shutdown; and a clean shutdown returns (exit code 0, as ollama
    and llama-server) instead of re-raising the signal once done, as uvicorn does on its own."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.on_exit()
        super().handle_exit(sig, frame)
        if not self.force_exit:  # a second Ctrl-C forces the exit and keeps uvicorn's behaviour
            getattr(self, "_captured_signals", []).clear()


def _log_config() -> dict[str, Any]:
    """uvicorn's logging, minus its startup chatter (we print our own): access lines and warnings stay."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["loggers"]["uvicorn.error"]["level"] = "WARNING"
    return config


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads so a taken port fails in a second, not after a minute."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, UnicodeError) as error:
        raise DflashError(
            f"cannot listen on {host}: {error}", fix="pass an address of this machine: --host 127.0.0.1"
        ) from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as error:
        sock.close()
        fix = f"pick another --port, or stop the program using {port}" if port else "check --host"
        raise DflashError(f"cannot listen on {host}:{port}: {error.strerror}", fix=fix) from None
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def run_server(
    options: RunOptions,
    *,
    host: str,
    port: int,
    api_key: str | None,
    max_queue: int,
    console: Console,
    fill_window: bool = True,
    allowed_origins: tuple[str, ...] = (),
) -> None:
    """Bind, load the model once, serve until Ctrl-C. `fill_window`: a Responses request without
    max_output_tokens may generate until the context window is full (else: to --max-tokens). `allowed_origins`:
    browser origins that may call it besides this machine's (http.LOCAL_ORIGINS)."""
    from dflash_cli.loading.session import open_session

    sock = bind(host, port)
    engine = EngineThread()  # loads and decodes: the model's one thread (worker.EngineThread says why)
    try:
        session = engine.run(lambda: open_session(options, console, batching=True, build_later=True))
        speculative = not options.no_spec and session.can_speculate
        worker = Worker(session, engine, speculative=speculative, max_queue=max_queue)
        metrics = ServerMetrics(
            model=session.served_name,
            speculative=speculative,
            block_size=session.block_size if speculative else 1,
            batch_size=worker.rows,
            waiting=lambda: worker.waiting,
            running=lambda: worker.running,
        )
        worker.on_finish = _reporter(metrics, console)
        worker.on_step = metrics.batch_rows.observe
        server = Server(
            session, options, worker, metrics, api_key, fill_window=fill_window, allowed_origins=allowed_origins
        )
        config = uvicorn.Config(server.app(), lifespan="off", log_config=_log_config(), timeout_graceful_shutdown=10)
        uvicorn_server = _Uvicorn(config, on_exit=worker.stop)
        worker.start()
        url = url_of(sock)
        adaptive = "adaptive up to " if session.plan.adaptive_block else ""
        mode = (
            f"DFlash block {adaptive}{session.block_size}" if speculative else "baseline (no drafter)"
        ) + f", batch {worker.rows}"
        console.print(f"dflash serve: {escape(server.model)} ({mode}) at {url}/v1", soft_wrap=True)
        console.print(
            f"[dim]OpenAI-compatible: {CHAT_URL}, {COMPLETIONS_URL}, {RESPONSES_URL}, /v1/models; Anthropic: "
            f"{MESSAGES_URL}, {COUNT_TOKENS_URL}; /health, /metrics · "
            f"{'API key required' if api_key else 'no API key'} · Ctrl+C to stop[/]",
            soft_wrap=True,
        )
        if not api_key and not _is_loopback(host):
            console.print(
                f"[yellow]warning:[/] listening on {escape(host)} without --api-key: anyone who can "
                "reach this machine can use the model",
                soft_wrap=True,
            )
        uvicorn_server.run(sockets=[sock])  # returns after Ctrl-C, once open responses have ended
        worker.stop()
        worker.join(timeout=30)
        console.print(("\n" if console.is_terminal else "") + "dflash serve: stopped", soft_wrap=True)
    finally:
        engine.close()
        sock.close()


def _reporter(metrics: ServerMetrics, console: Console) -> Callable[[Job, Update, float], None]:
    """One log line and the metrics for each generation that ends."""

    def report(job: Job, update: Update, waited: float) -> None:
        metrics.generation_ended(update.finish_reason or "cancelled", update.stats, waited)
        stats = update.stats
        if stats is None:
            console.print(f"[dim]{job.id} {update.finish_reason} before it started[/]", soft_wrap=True)
            return
        tau = f", tau {stats.tau:.2f}" if stats.speculative else ""
        console.print(
            f"[dim]{job.id} {update.finish_reason}: {stats.prompt_tokens} prompt + {stats.generated_tokens} "
            f"generated tokens, {stats.cached_tokens} prompt tokens reused, {stats.decode_tokens_per_s:.1f} "
            f"tok/s{tau}, waited {waited:.2f} s[/]",
            soft_wrap=True,
        )

    return report
