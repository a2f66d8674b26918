"""`dflash chat`: a terminal REPL (or a one-shot answer for pipes) over a loaded `Session`.

`ChatState` is the conversation and its settings; `handle_command` runs a slash command on it and `reply` streams
one assistant turn. The prompt-toolkit loop in `repl` only reads lines and prints what those two return.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from platformdirs import user_data_dir
from prompt_toolkit import PromptSession
from prompt_toolkit.application import create_app_session
from prompt_toolkit.completion import CompleteEvent, Completer, Completion, PathCompleter
from prompt_toolkit.document import Document
from prompt_toolkit.history import FileHistory, History, InMemoryHistory
from prompt_toolkit.key_binding import KeyBindings
from prompt_toolkit.output import create_output
from rich.console import Console

from dflash_cli.engine import GenerationStats, SamplingParams
from dflash_cli.engine.grammar import compile_grammar
from dflash_cli.errors import DflashError, RequestError
from dflash_cli.loading.session import Session, open_session
from dflash_cli.protocol.params import FIELDS, Grammar, read_setting, sampling_settings
from dflash_cli.protocol.requests import read_messages
from dflash_cli.setup.options import RunOptions

ASSISTANT_STYLE = "cyan"
MULTILINE = '"""'
EXIT_COMMANDS = ("/bye", "/exit", "/quit")
COMMANDS = {  # name -> (arguments, what it does); the order of /help
    "/help": ("", "this help (also /?)"),
    "/bye": ("", "leave (also /exit, /quit, Ctrl+D)"),
    "/clear": ("", "forget the conversation (and what the model kept of it), keep the system prompt"),
    "/set": (
        "KEY VALUE",
        "temperature, top_p, top_k, min_p, max_tokens, seed, block_size (N or auto), format (text, json or "
        "a JSON schema file), or system TEXT",
    ),
    "/stats": ("on|off", "a footer after each reply: tokens, tok/s, TTFT, reused prompt tokens, tau (bare: toggle)"),
    "/spec": ("on|off", "decode with the DFlash drafter (on) or the target alone (off)"),
    "/save": ("FILE", "write the conversation as JSON"),
    "/load": ("FILE", "read a conversation written by /save"),
    "/show": ("", "the recipe, the plan and the current settings"),
}
# /set KEY: the request fields (params.FIELDS) that take one value, then chat's own
SAMPLING_SETTINGS = tuple(field.key for field in FIELDS if field.kind is not tuple)
SETTINGS = (*SAMPLING_SETTINGS, "block_size", "format", "system")
FINISH_NOTES = {
    "interrupted": "[interrupted]",
    "length": "[cut at the token limit: /set max_tokens N for longer replies]",
}
ONE_SHOT_CUT_NOTE = "[cut at the token limit: --max-tokens N for longer replies]"  # one-shot: no /set, the flag
INPUT_TIPS = (
    'Several lines: start and end a block with """, or press Alt+Enter (Esc, Enter) for a new line.',
    "Ctrl+C stops a reply (or clears the line). A message that starts with a space is sent as is, / or not.",
)


@dataclass
class ChatState:
    """The conversation (system prompt + turns) and the settings the next reply uses."""

    params: SamplingParams
    speculative: bool
    block_size: int | None = None  # None: the recipe's (or the drafter's) own
    system: str | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)  # user/assistant turns; interrupted replies marked
    show_stats: bool = False

    @classmethod
    def start(
        cls, session: Session, options: RunOptions, *, system: str | None = None, show_stats: bool = False
    ) -> ChatState:
        speculative = session.can_speculate and not options.no_spec
        return cls(session.sampling_params(options), speculative, system=system or None, show_stats=show_stats)

    def conversation(self, *more: dict[str, Any]) -> list[dict[str, str]]:
        """What the chat template sees: the system prompt, then each turn as role and content only."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [{"role": m["role"], "content": m["content"]} for m in (*self.messages, *more)]


@dataclass
class CommandResult:
    message: str = ""
    ok: bool = True
    exit: bool = False


@dataclass
class Reply:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    finish_reason: str  # "stop", "length" (max_tokens or the context window), or "interrupted" (Ctrl-C)


def reply(session: Session, state: ChatState, text: str, output: Callable[[str], None]) -> Reply:
    """Answer `text` in the conversation, streaming the reply into `output`; Ctrl-C stops it, keeping the part said.

    The turn joins `state.messages` only once decoding started: an error (a too-long conversation) changes nothing."""
    user = {"role": "user", "content": text}
    prompt_ids = session.encode_chat(state.conversation(user))
    steps = session.stream(prompt_ids, state.params, speculative=state.speculative, block_size=state.block_size)
    said: list[str] = []
    token_ids: list[int] = []
    stats, finish = GenerationStats(prompt_tokens=len(prompt_ids)), "interrupted"
    try:
        with closing(steps):
            for step in steps:
                stats, finish = step.stats, step.finish_reason or "interrupted"
                token_ids += step.token_ids
                said.append(step.text)
                if step.text:
                    output(step.text)
    except KeyboardInterrupt:
        finish = "interrupted"
    answer: dict[str, Any] = {"role": "assistant", "content": "".join(said)}
    if finish == "interrupted":
        answer["interrupted"] = True
    state.messages += [user, answer]
    return Reply(answer["content"], token_ids, stats, finish)


def stats_line(stats: GenerationStats) -> str:
    if not stats.speculative:
        mode = "baseline, no drafter"
    elif stats.adaptive:  # the block size now, then how many steps ran at each size
        sizes = " ".join(f"{size}×{count}" for size, count in stats.size_histogram.items())
        mode = f"DFlash adaptive block ≤{stats.block_size}: now {stats.current_block_size}, steps by size {sizes}"
    else:
        mode = f"DFlash block {stats.block_size}"
    compiling = f" (+{stats.compile_s:.0f} s compiling, once per start)" if stats.compile_s >= 1 else ""
    # the prompt tokens the last turns left in place (prefix reuse), and those the state could not continue from
    unreused = f", {stats.unreused_tokens} not reusable" if stats.unreused_tokens else ""
    return (
        f"{stats.generated_tokens} tokens, {stats.decode_tokens_per_s:.1f} tok/s{compiling}, "
        f"TTFT {stats.ttft_s:.2f} s (prompt {stats.prompt_tokens}, {stats.cached_tokens} reused{unreused}), "
        f"tau {stats.tau:.2f} ({mode})"
    )


# ---------------------------------------------------------------------------------------------------------------
# slash commands: each takes (session, state, argument) and returns the message to show, or raises DflashError


def _closest(word: str, choices: list[str] | tuple[str, ...]) -> str:
    match = difflib.get_close_matches(word, choices, n=1, cutoff=0.5)
    return f" Did you mean {match[0]}?" if match else ""


def _help(session: Session, state: ChatState, arg: str) -> str:
    usages = {name: f"{name} {args}".strip() for name, (args, _) in COMMANDS.items()}
    width = max(map(len, usages.values()))
    lines = [f"  {usages[name]:<{width}}  {doc}" for name, (_, doc) in COMMANDS.items()]
    return "\n".join(["Commands:", *lines, "", *INPUT_TIPS])


def _clear(session: Session, state: ChatState, arg: str) -> str:
    state.messages.clear()
    session.forget_prefixes()
    return "Conversation cleared" + (" (the system prompt stays)." if state.system else ".")


def _set(session: Session, state: ChatState, arg: str) -> str:
    key, _, value = arg.partition(" ")
    key, value = key.lower(), value.strip()
    if key == "system":
        state.system = value or None
        return "System prompt set." if value else "System prompt cleared."
    if key not in SETTINGS:
        unknown = f"no setting {key!r}.{_closest(key, SETTINGS)}" if key else "/set needs a setting and a value"
        raise DflashError(unknown, fix=f"/set KEY VALUE, KEY one of: {', '.join(SETTINGS)}")
    if not value:
        raise DflashError(f"/set {key} needs a value")
    if key == "format":
        return _set_format(session, state, value)
    if key == "block_size":
        if value.lower() == "auto":
            state.block_size = None
            return "block_size = auto (the plan's: " + _decoding(session, state) + ")"
        if not value.isdigit() or int(value) < 1:
            raise DflashError(
                f"block_size must be a whole number >= 1 or auto, got {value!r}",
                fix="use the drafter's trained block size (/show) or less, or auto",
            )
        state.block_size = int(value)
        note = session.block_size_note(state.block_size)
        if note is not None:  # it runs (lossless), only slower: say so, as the flag does
            return f"{key} = {value} (note: {note.replace('--block-size', '/set block_size')})"
    else:
        name, parsed = read_setting(key, value)
        state.params = dataclasses.replace(state.params, **{name: parsed})
    return f"{key} = {value}"


def _set_format(session: Session, state: ChatState, value: str) -> str:
    """/set format text | json | FILE: replies as text, as a JSON object, or as JSON that follows the schema in FILE."""
    if value.lower() == "text":
        grammar = None
    elif value.lower() == "json":
        grammar = Grammar("json", field="format")
    else:
        path = Path(value).expanduser()
        try:
            schema = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as error:
            raise DflashError(
                f"format {value!r}: not text, json, or a readable JSON schema file ({error})",
                fix="/set format json, or /set format schema.json",
            ) from None
        grammar = Grammar("json_schema", json.dumps(schema), field="format")
    if grammar is not None:
        compile_grammar(grammar, session.require_tokenizer(), session.target.config.get_text_config().vocab_size)
    state.params = dataclasses.replace(state.params, grammar=grammar)
    return f"format = {value}" + (" (replies are constrained to it)" if grammar is not None else "")


def _stats(session: Session, state: ChatState, arg: str) -> str:
    if arg.lower() not in ("on", "off", ""):
        raise DflashError(f"/stats takes on or off, not {arg!r}")
    state.show_stats = arg.lower() == "on" if arg else not state.show_stats
    return f"Stats footer {'on' if state.show_stats else 'off'}."


def _spec(session: Session, state: ChatState, arg: str) -> str:
    if arg.lower() not in ("on", "off", ""):
        raise DflashError(f"/spec takes on or off, not {arg!r}")
    if arg.lower() == "on":
        if not session.can_speculate:
            raise DflashError("this model has no drafter to speculate with", fix="start chat with --drafter DIR")
        session.ensure_drafter()
        state.speculative = True
    elif arg.lower() == "off":
        state.speculative = False
    if state.speculative:
        return "Speculative decoding on: the DFlash drafter drafts, the target verifies."
    return "Speculative decoding off: the target decodes alone (baseline)."


def _save(session: Session, state: ChatState, arg: str) -> str:
    if not arg:
        raise DflashError("/save needs a file name", fix="/save chat.json")
    path = Path(arg).expanduser()
    conversation = {"system": state.system, "messages": state.messages}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # as run -o and bench --output make theirs
        path.write_text(json.dumps(conversation, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    except OSError as error:
        raise DflashError(f"cannot write {path}: {error.strerror}", fix="/save another path") from None
    return f"Saved {len(state.messages)} messages to {path}."


def load_conversation(path: Path) -> tuple[str | None, list[dict[str, Any]]]:
    """The system prompt and messages of a /save file. A leading system message (OpenAI style) is the prompt too."""
    fix = 'load a /save file: {"system": "..." or null, "messages": [{"role": "user", "content": "..."}, ...]}'
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise DflashError(f"cannot read {path}: {error.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DflashError(f"{path} is not JSON ({error})", fix=fix) from None
    if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
        raise DflashError(f"{path} holds no conversation", fix=fix)
    system, raw = data.get("system"), list(data["messages"])
    if system is not None and not isinstance(system, str):
        raise DflashError(f"{path}: system must be text or null", fix=fix)
    if not raw:
        return system, []
    try:
        messages = list(read_messages(raw))  # the one reader of conversations (run, serve, bench share it)
    except RequestError as error:
        raise DflashError(f"{path}: {error.message}", fix=fix) from None
    if messages[0]["role"] == "system" and system is None:  # OpenAI style: the system prompt as a first message
        system, messages, raw = messages[0]["content"], messages[1:], raw[1:]
    for number, message in enumerate(messages):
        if message["role"] == "system":
            raise DflashError(f"{path}: messages[{number}] is a system message; only the first may be", fix=fix)
        if raw[number].get("interrupted") is True:  # a reply cut short by Ctrl-C, as /save marks it
            message["interrupted"] = True
    return system, messages


def _load(session: Session, state: ChatState, arg: str) -> str:
    if not arg:
        raise DflashError("/load needs a file name", fix="/load chat.json")
    path = Path(arg).expanduser()
    state.system, state.messages = load_conversation(path)
    session.forget_prefixes()
    return f"Loaded {len(state.messages)} messages from {path}" + (" (with a system prompt)." if state.system else ".")


def _decoding(session: Session, state: ChatState) -> str:
    if not state.speculative:
        return "baseline"
    if state.block_size is None and session.plan.adaptive_block:
        return f"DFlash, block adaptive up to {session.block_size}"
    return f"DFlash, block {state.block_size or session.block_size}"


def _show(session: Session, state: ChatState, arg: str) -> str:
    recipe, params = session.recipe, state.params
    drafter = f"+ {recipe.drafter.id}" if recipe.drafter else "(no drafter)"
    decoding = _decoding(session, state)
    return "\n".join(
        [
            f"recipe    {recipe.name}: {recipe.target.id} {drafter}",
            f"plan      {session.plan_line()} (at start; /set and /spec change the decoding below)",
            f"decoding  {decoding}",
            "sampling  "
            + ", ".join(
                f"{key} {'(none: random)' if value is None else value}"
                for key, value in sampling_settings(params).items()
                if key in SAMPLING_SETTINGS
            ),
            f"format    {_format_name(params.grammar)}",
            f"stats     {'on' if state.show_stats else 'off'}",
            f"system    {state.system if state.system else '(none)'}",
            f"messages  {len(state.messages)}",
        ]
    )


def _format_name(grammar: Grammar | None) -> str:
    if grammar is None:
        return "text"
    return "json" if grammar.kind == "json" else "JSON schema " + grammar.source[:60]


HANDLERS: dict[str, Callable[[Session, ChatState, str], str]] = {
    "/help": _help,
    "/?": _help,
    "/clear": _clear,
    "/set": _set,
    "/stats": _stats,
    "/spec": _spec,
    "/save": _save,
    "/load": _load,
    "/show": _show,
}


def handle_command(session: Session, state: ChatState, line: str) -> CommandResult:
    """Run one slash command on `state`. Bad input gives a message and changes nothing."""
    name, _, arg = line.strip().partition(" ")
    name, arg = name.lower(), arg.strip()
    if name in EXIT_COMMANDS:
        return CommandResult(exit=True)
    handler = HANDLERS.get(name)
    if handler is None:
        hint = _closest(name, [*HANDLERS, *EXIT_COMMANDS]) or " /help lists the commands."
        return CommandResult(f"Unknown command {name}.{hint}", ok=False)
    try:
        return CommandResult(handler(session, state, arg))
    except DflashError as error:
        return CommandResult(str(error), ok=False)


# ---------------------------------------------------------------------------------------------------------------
# the terminal


def history_path() -> Path:
    return Path(user_data_dir("dflash")) / "chat_history"


def make_history(enabled: bool, console: Console) -> History:
    """The prompt history file, or none with --no-history / DFLASH_NOHISTORY=1 (or when it cannot be written)."""
    if not enabled:
        return InMemoryHistory()
    path = history_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    except OSError as error:
        console.print(f"[yellow]No chat history: cannot write {path} ({error.strerror}).[/]")
        return InMemoryHistory()
    return FileHistory(str(path))


def text_sink(console: Console) -> Callable[[str], None]:
    """Where reply text streams: coloured on a terminal, the bare text otherwise (pipes, files)."""

    def write(text: str) -> None:
        if console.is_terminal:
            console.print(text, style=ASSISTANT_STYLE, end="", markup=False, highlight=False, soft_wrap=True)
        else:
            console.file.write(text)
        console.file.flush()

    return write


def _key_bindings() -> KeyBindings:
    bindings = KeyBindings()

    @bindings.add("escape", "enter")  # what Alt+Enter sends
    def _newline(event: Any) -> None:
        event.current_buffer.insert_text("\n")

    @bindings.add("c-c")
    def _clear_or_interrupt(event: Any) -> None:
        if event.current_buffer.text:
            event.current_buffer.reset()
        else:
            event.app.exit(exception=KeyboardInterrupt())

    return bindings


class CommandCompleter(Completer):
    """Completes slash commands, /set keys, /spec and /stats on|off and the file of /save and /load."""

    names = (*COMMANDS, *EXIT_COMMANDS[1:], "/?")
    arguments = {"/set": SETTINGS, "/spec": ("on", "off"), "/stats": ("on", "off")}
    paths = PathCompleter(expanduser=True)

    def get_completions(self, document: Document, complete_event: CompleteEvent) -> Iterator[Completion]:
        name, space, arg = document.text_before_cursor.partition(" ")
        if not name.startswith("/"):
            return
        if not space:
            yield from (Completion(c, -len(name)) for c in self.names if c.startswith(name.lower()))
        elif name.lower() in ("/save", "/load"):
            yield from self.paths.get_completions(Document(arg), complete_event)
        elif " " not in arg:
            words = self.arguments.get(name.lower(), ())
            yield from (Completion(word, -len(arg)) for word in words if word.startswith(arg.lower()))


def read_message(prompt: PromptSession) -> str:
    """One line, or a block between triple quotes spanning several lines."""
    line = prompt.prompt(">>> ")
    if not line.lstrip().startswith(MULTILINE):
        return line
    block = line.lstrip()[len(MULTILINE) :]
    while not block.rstrip().endswith(MULTILINE):
        block += "\n" + prompt.prompt("... ")
    return block.rstrip()[: -len(MULTILINE)].strip()


def repl(session: Session, state: ChatState, console: Console, err_console: Console, history: History) -> None:
    """Replies stream to `console` (stdout); everything else (banner, command results, notes, footer) goes to
    `err_console`, so `dflash chat NAME | tee log.txt` keeps only the replies."""
    prompt: PromptSession = PromptSession(
        history=history, completer=CommandCompleter(), complete_while_typing=True, key_bindings=_key_bindings()
    )
    err_console.print(
        f"[bold]dflash chat[/] {session.recipe.name}  [dim]/help for commands, /bye or Ctrl+D to leave[/]"
    )
    while True:
        try:
            text = read_message(prompt)
        except KeyboardInterrupt:
            err_console.print("[dim]Use Ctrl+D or /bye to leave.[/]")
            continue
        except EOFError:
            return
        if not text.strip():
            continue
        if text.startswith("/"):
            result = handle_command(session, state, text)
            if result.message:
                err_console.print(result.message, style=None if result.ok else "red", markup=False, highlight=False)
            if result.exit:
                return
            continue
        try:
            answer = reply(session, state, text.strip(), text_sink(console))
        except DflashError as error:
            err_console.print(str(error), style="red", markup=False, highlight=False)
            continue
        except torch.OutOfMemoryError as error:  # a long conversation on a small GPU: this turn goes, the chat stays
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            reason = str(error).splitlines()[0] if str(error) else "out of memory"
            err_console.print(
                f"error: out of memory in this reply ({reason}); the message was not added to the conversation\n"
                "fix: /set max_tokens N for shorter replies, or /save FILE then /clear to start a shorter conversation",
                style="red",
                markup=False,
                highlight=False,
            )
            continue
        console.print()  # (the reply's own line end)
        if answer.finish_reason in FINISH_NOTES:
            err_console.print(FINISH_NOTES[answer.finish_reason], style="dim", markup=False, highlight=False)
        if state.show_stats:
            err_console.print(stats_line(answer.stats), style="dim", markup=False, highlight=False, soft_wrap=True)


def answer_once(session: Session, state: ChatState, question: str, console: Console, err_console: Console) -> int:
    """The non-interactive mode: the reply and a newline on stdout; a note if it was cut and the footer (with
    --stats) on stderr."""
    answer = reply(session, state, question, text_sink(console))
    console.file.write("\n")
    if answer.finish_reason == "length":
        err_console.print(ONE_SHOT_CUT_NOTE, style="dim", markup=False, highlight=False)
    if state.show_stats:
        err_console.print(stats_line(answer.stats), style="dim", markup=False, highlight=False, soft_wrap=True)
    return 130 if answer.finish_reason == "interrupted" else 0


def run_chat(
    options: RunOptions,
    *,
    system: str | None,
    question: str | None,
    history: bool,
    show_stats: bool,
    console: Console,
    err_console: Console,
) -> int:
    """`dflash chat`: one answer to `question` (from --prompt or piped stdin, read by the CLI before the model
    loads), else the REPL on the terminal. Returns the exit code."""
    session = open_session(options, err_console, build_later=True)
    state = ChatState.start(session, options, system=system, show_stats=show_stats)
    if question is not None:
        return answer_once(session, state, question, console, err_console)
    # The prompt goes to the terminal even when stdout is redirected (`dflash chat NAME > log.txt`).
    with create_app_session(output=create_output(always_prefer_tty=True)):
        repl(session, state, console, err_console, make_history(history, err_console))
    return 0
