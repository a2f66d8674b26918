"""Prefix reuse (issue 30), measured: time to first token with and without it.

`chat`: a conversation of N turns through the Session API `dflash chat` uses (the demo's held-out prompts as the
user's messages), after one warm-up reply. Each turn runs twice, back to back: with prefix reuse (continuing from
the slot, which holds the last turn), then prefilling the whole prompt (`prefix_cache` off); in float32 both give
the same reply (checked; bf16 may round a near-tie differently) and leave the same state. Prints each turn's
prompt length, reused tokens and TTFT both ways, then the last turn's TTFT over the first turn's, each way.

`serve`: `dflash serve` in a subprocess (127.0.0.1, a free port), then R requests one after another, streamed,
that share a system prompt of about S tokens (the demo's prompts, joined) and each ask their own question. TTFT is
the client's: request sent to the first token's chunk (the one after the role's, which comes before the prefill). The same again with `--no-prefix-cache`. Prints each request's
TTFT and `usage.prompt_tokens_details.cached_tokens`, then requests 2..R's TTFT as a share of the first's.

    python -m benchmarks.prefix_bench [chat|serve|both] [--recipe demo] [--turns 10] [--requests 8]
        [--system-tokens 1500] [--max-tokens 32] [--dtype float32] [-- FLAGS]

FLAGS after `--` go to `dflash serve` (e.g. `-- --batch-size 1`); the chat runs the recipe's plan.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from dflash_cli.setup.options import RunOptions
from dflash_cli.setup.planning import PlanOverrides

ASSET = Path(__file__).resolve().parents[1] / "dflash_cli" / "assets" / "demo_prompts_eval.jsonl"


def questions() -> list[str]:
    return [json.loads(line)["prompt"] for line in ASSET.read_text(encoding="utf-8").splitlines()]


def chat(options: RunOptions, turns: int, max_tokens: int) -> None:
    from dflash_cli.engine import collect
    from dflash_cli.loading.session import open_session

    session = open_session(options)
    params = session.sampling_params(options, max_new_tokens=max_tokens)
    messages: list[dict[str, str]] = []
    print(
        f"{session.recipe.name}: {session.plan_line()}; {turns} turns, --max-tokens {max_tokens}; "
        f"load {os.getloadavg()[0]:.2f}"
    )
    collect(session.stream(session.encode_chat([{"role": "user", "content": "Hi"}]), params))  # warm-up
    session.forget_prefixes()
    print("| turn | prompt tokens | reused | TTFT with reuse (s) | TTFT without (s) |")
    print("| --- | --- | --- | --- | --- |")
    ttft: dict[bool, list[float]] = {True: [], False: []}
    for turn, question in enumerate(questions()[:turns], 1):
        messages.append({"role": "user", "content": question})
        ids = session.encode_chat(messages)
        results = {}
        for reuse in (True, False):
            session.prefix_cache = reuse
            results[reuse] = collect(session.stream(ids, params))
            ttft[reuse].append(results[reuse].stats.ttft_s)
        if results[True].token_ids != results[False].token_ids:
            print(f"turn {turn}: the replies differ with and without reuse")
        stats = results[True].stats
        print(
            f"| {turn} | {len(ids)} | {stats.cached_tokens} | {stats.ttft_s:.3f} | {results[False].stats.ttft_s:.3f} |",
            flush=True,
        )
        messages.append({"role": "assistant", "content": results[True].text})
    for reuse in (True, False):
        print(
            f"{'with' if reuse else 'without'} reuse: last turn's TTFT / first turn's = "
            f"{ttft[reuse][-1] / ttft[reuse][0]:.2f}x"
        )


def start_server(flags: list[str]) -> tuple[subprocess.Popen[str], int]:
    """`dflash serve FLAGS` on a free port; returns once it listens."""
    command = [sys.executable, "-m", "dflash_cli", "serve", "--port", "0", *flags]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    started, port = threading.Event(), []

    def drain() -> None:  # always read it: a full pipe would block the server
        assert process.stderr is not None
        for line in process.stderr:
            found = re.search(r" at http://127\.0\.0\.1:(\d+)", line)
            if found:
                port.append(int(found.group(1)))
                started.set()
        started.set()

    threading.Thread(target=drain, daemon=True).start()
    if not started.wait(600) or not port:
        process.kill()
        raise SystemExit(f"{' '.join(command)} did not start")
    deadline = time.monotonic() + 60
    while True:  # the socket is bound before the line is printed; it accepts once uvicorn runs
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port[0], timeout=60)
            connection.request("GET", "/health")
            connection.getresponse().read()
            connection.close()
            return process, port[0]
        except ConnectionError:
            if time.monotonic() > deadline:
                process.kill()
                raise
            time.sleep(0.1)


def timed_request(port: int, messages: list[dict[str, str]], max_tokens: int) -> tuple[float, dict[str, Any]]:
    """One streamed chat completion: seconds from sending it to its first token (the first chunk after the
    role's, which the server sends before the prefill), and its last chunk's usage and numbers."""
    body = {"messages": messages, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    sent = time.perf_counter()
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise SystemExit(f"the server answered {response.status}: {response.read().decode()}")
    first, last, chunks = float("nan"), {}, 0
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunks += 1
        if chunks == 2:
            first = time.perf_counter() - sent
        last = json.loads(line[6:])
    connection.close()
    return first, last


def serve(model: list[str], requests: int, system_tokens: int, max_tokens: int, flags: list[str]) -> None:
    """`model`: the serve command's model arguments (a recipe name, or --target and --drafter)."""
    words = " ".join(questions())
    system = " ".join(words.split()[: int(system_tokens * 0.75)])  # about 4 tokens per 3 English words
    asks = questions()[-requests:]
    print(
        f"{' '.join(model)}: {requests} requests, a shared system prompt, --max-tokens {max_tokens}; "
        f"load {os.getloadavg()[0]:.2f}"
    )
    for extra in ([], ["--no-prefix-cache"]):
        process, port = start_server([*model, *flags, *extra])
        try:
            label = " ".join(extra) or "prefix reuse on"
            print(f"\n{label}:")
            print("| request | prompt tokens | cached tokens | TTFT (s) | share of the first | server TTFT (s) |")
            print("| --- | --- | --- | --- | --- | --- |")
            shares, first = [], None
            for i, ask in enumerate(asks, 1):
                messages = [{"role": "system", "content": system}, {"role": "user", "content": ask}]
                seconds, last = timed_request(port, messages, max_tokens)
                first = seconds if first is None else first
                shares.append(seconds / first)
                usage = last["usage"]
                print(
                    f"| {i} | {usage['prompt_tokens']} | {usage['prompt_tokens_details']['cached_tokens']} | "
                    f"{seconds:.3f} | {shares[-1]:.0%} | {last['dflash']['ttft_s']:.3f} |",
                    flush=True,
                )
            print(f"{label}: requests 2-{requests} TTFT = {min(shares[1:]):.0%}-{max(shares[1:]):.0%} of the first's")
        finally:
            process.terminate()
            process.wait(60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="?", choices=("chat", "serve", "both"), default="both")
    parser.add_argument("--recipe", default="demo")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", help="the plan's dtype unless given (float32: replies identical both ways)")
    args, extra = parser.parse_known_args(argv)
    extra = [flag for flag in extra if flag != "--"]
    if args.what in ("chat", "both"):
        chat(
            RunOptions(recipe_name=args.recipe, overrides=PlanOverrides(dtype=args.dtype)), args.turns, args.max_tokens
        )
    if args.what in ("serve", "both"):
        dtype = ["--dtype", args.dtype] if args.dtype else []
        serve([args.recipe], args.requests, args.system_tokens, args.max_tokens, [*dtype, *extra])
    return 0


if __name__ == "__main__":
    sys.exit(main())
