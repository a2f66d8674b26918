"""`dflash chat` with a real tiny model: the REPL driven through prompt-toolkit's pipe input, the slash
commands, Ctrl-C, history, and the one-shot (piped / --prompt) mode through the real CLI."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import pytest
import torch
from prompt_toolkit.application import create_app_session
from prompt_toolkit.completion import CompleteEvent
from prompt_toolkit.document import Document
from prompt_toolkit.history import FileHistory, InMemoryHistory
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput
from rich.console import Console
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from dflash_cli.cli.app import app
from dflash_cli.commands import chat
from dflash_cli.commands.chat import ChatState, handle_command, make_history, repl, reply, stats_line
from dflash_cli.loading.session import Session, open_session
from dflash_cli.protocol.params import SamplingParams
from dflash_cli.setup import recipes
from dflash_cli.setup.options import RunOptions
from dflash_cli.setup.thread_count import cpu_count
from dflash_cli.wording import plural
from helpers.drafters import save_random_drafter
from helpers.tiny_models import make_tiny_qwen3

TOKENS = 8  # per reply: enough to stream several steps, quick on a CPU
ENTER, ALT_ENTER, CTRL_C, CTRL_D = "\r", "\x1b\r", "\x03", "\x04"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("chat")
    target = make_tiny_qwen3(root / "target", seed=0)
    drafter = save_random_drafter(root / "drafter", AutoModelForCausalLM.from_pretrained(target), block_size=4)
    return target, drafter


@pytest.fixture(scope="module")
def options(model_dirs: tuple[Path, Path]) -> RunOptions:
    return RunOptions(
        target=str(model_dirs[0]), drafter=str(model_dirs[1]), sampling=SamplingParams(max_new_tokens=TOKENS)
    )


@pytest.fixture(scope="module")
def session(options: RunOptions) -> Session:
    return open_session(options)


@pytest.fixture
def state(session: Session, options: RunOptions) -> ChatState:
    return ChatState.start(session, options)


def run_repl(
    session: Session, state: ChatState, keys: str, history: FileHistory | None = None, err: Console | None = None
) -> str:
    """Type `keys` into the REPL; return what it printed on stdout, and on stderr too unless `err` takes that (a
    console that is not a terminal: plain text)."""
    console = Console(file=io.StringIO(), width=200)
    with create_pipe_input() as pipe, create_app_session(input=pipe, output=DummyOutput()):
        pipe.send_text(keys)
        repl(session, state, console, err or console, history or InMemoryHistory())
    return console.file.getvalue()


def expected_reply(session: Session, options: RunOptions, messages: list[dict[str, str]], **state_fields) -> str:
    """The reply a fresh conversation gets, decoded straight from the session (greedy: deterministic)."""
    fresh = ChatState.start(session, options)
    for name, value in state_fields.items():
        setattr(fresh, name, value)
    fresh.messages = messages[:-1]
    return reply(session, fresh, messages[-1]["content"], lambda _: None).text


def record_prompts(session: Session, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The prompt ids of every decode that the session starts."""
    prompts: list[list[int]] = []
    stream = session.stream

    def recording(prompt_ids, *args, **kwargs):
        prompts.append(list(prompt_ids))
        return stream(prompt_ids, *args, **kwargs)

    monkeypatch.setattr(session, "stream", recording)
    return prompts


# --- streaming and the conversation ------------------------------------------------------------------------------


def test_reply_streams_the_decoded_ids_and_templates_the_whole_conversation(
    session: Session, state: ChatState, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = record_prompts(session, monkeypatch)
    state.system = "You are terse."
    streamed: list[str] = []
    first = reply(session, state, "Hello!", streamed.append)
    assert len(streamed) > 1  # it streamed, step by step
    assert "".join(streamed) == first.text == session.tokenizer.decode(first.token_ids, skip_special_tokens=True)
    assert first.stats.generated_tokens == len(first.token_ids) == TOKENS and first.finish_reason == "length"
    second = reply(session, state, "And then?", lambda _: None)
    conversation = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And then?"},
    ]
    template = session.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    assert prompts[1] == template["input_ids"]
    assert state.messages == conversation[1:] + [{"role": "assistant", "content": second.text}]


def test_repl_streams_replies_and_the_stats_footer(session: Session, state: ChatState, options: RunOptions) -> None:
    out = run_repl(session, state, f"Hello{ENTER}/stats{ENTER}How are you?{ENTER}/bye{ENTER}")
    first, second = state.messages[1]["content"], state.messages[3]["content"]
    assert first == expected_reply(session, options, [{"role": "user", "content": "Hello"}])
    assert out.index(first) < out.index("Stats footer on.") < out.index(second)
    footer = out[out.index(second) + len(second) :]
    assert f"{TOKENS} tokens," in footer and "tok/s" in footer and "TTFT" in footer
    assert "tau 1.00 (DFlash adaptive block ≤4: now " in footer and "[cut at the token limit: /set max_tokens" in footer
    assert "tokens," not in out[: out.index(second)]  # no footer before /stats
    assert "\x1b" not in out  # not a terminal: no colours or cursor codes


def test_replies_go_to_stdout_and_everything_else_to_stderr(session: Session, state: ChatState) -> None:
    """`dflash chat NAME | tee log.txt`: the log holds the replies only; banner, notes and results stay on stderr."""
    err = Console(file=io.StringIO(), width=200)
    out = run_repl(
        session, state, f"/stats on{ENTER}Hello{ENTER}/show{ENTER}/nope{ENTER}Bye{ENTER}/bye{ENTER}", err=err
    )
    assert out == "".join(message["content"] + "\n" for message in state.messages[1::2])
    shown = err.file.getvalue()
    assert shown.startswith("dflash chat ad-hoc") and "Stats footer on." in shown and "recipe    ad-hoc" in shown
    assert "Unknown command /nope" in shown and shown.count("[cut at the token limit") == shown.count("tau ") == 2


def test_a_turn_reuses_the_conversation_before_it_and_clear_starts_over(
    session: Session, state: ChatState, options: RunOptions
) -> None:
    """Each turn keeps the earlier turns in the model (prefix reuse: the footer says how many prompt tokens) and
    answers exactly as a fresh conversation would; /clear starts over."""
    first = reply(session, state, "Hello!", lambda _: None)
    second = reply(session, state, "And then?", lambda _: None)
    # the first turn's prompt stays in place, and its reply as far as the template renders the same ids (this random
    # model's replies are byte fragments that do not survive a round trip through text)
    assert second.stats.cached_tokens >= first.stats.prompt_tokens
    assert f"{second.stats.cached_tokens} reused" in stats_line(second.stats)
    session.prefix_cache = False  # the same turn, prefilled whole
    try:
        assert second.text == expected_reply(session, options, state.messages[:-1])
    finally:
        session.prefix_cache = True
    handle_command(session, state, "/clear")
    assert reply(session, state, "And then?", lambda _: None).stats.cached_tokens == 0


def test_text_sink_colours_only_on_a_terminal() -> None:
    plain, terminal = io.StringIO(), io.StringIO()
    chat.text_sink(Console(file=plain))("a\tb [bold]")
    chat.text_sink(Console(file=terminal, force_terminal=True, color_system="standard"))("hi [bold]")
    assert plain.getvalue() == "a\tb [bold]"  # byte for byte: no markup, tabs kept
    assert "\x1b[36m" in terminal.getvalue() and "hi [bold]" in terminal.getvalue()


def test_spec_off_decodes_without_the_drafter_and_says_the_same(
    session: Session, state: ChatState, options: RunOptions
) -> None:
    out = run_repl(session, state, f"/stats{ENTER}/spec off{ENTER}Hi there{ENTER}/spec on{ENTER}/bye{ENTER}")
    assert "Speculative decoding off" in out and "Speculative decoding on" in out and state.speculative
    assert "tau 1.00 (baseline, no drafter)" in out
    # Lossless: the baseline reply is the speculative one.
    assert state.messages[1]["content"] == expected_reply(session, options, [{"role": "user", "content": "Hi there"}])


def test_stats_on_and_off_set_the_footer_bare_stats_toggles(session: Session, state: ChatState) -> None:
    for line, shown in (("/stats on", True), ("/stats on", True), ("/stats", False), ("/STATS ON", True)):
        result = handle_command(session, state, line)
        assert result.ok and state.show_stats is shown
        assert result.message == f"Stats footer {'on' if shown else 'off'}."
    assert handle_command(session, state, "/stats off").ok and not state.show_stats
    refused = handle_command(session, state, "/stats banana")
    assert not refused.ok and refused.message == "/stats takes on or off, not 'banana'" and not state.show_stats
    assert "/stats on|off" in handle_command(session, state, "/help").message


def test_spec_on_loads_the_drafter_of_a_no_spec_session(options: RunOptions) -> None:
    baseline = RunOptions(**{**options.__dict__, "no_spec": True})
    session = open_session(baseline)
    state = ChatState.start(session, baseline)
    assert session.drafter is None and not state.speculative
    assert handle_command(session, state, "/spec on").ok
    assert session.drafter is not None and state.speculative
    assert reply(session, state, "Hi", lambda _: None).stats.speculative


def test_spec_on_without_a_drafter_explains(model_dirs: tuple[Path, Path]) -> None:
    options = RunOptions(target=str(model_dirs[0]), sampling=SamplingParams(max_new_tokens=TOKENS))
    session = open_session(options)
    state = ChatState.start(session, options)
    result = handle_command(session, state, "/spec on")
    assert not result.ok and "no drafter" in result.message and not state.speculative
    assert not handle_command(session, state, "/spec maybe").ok


# --- keys: Ctrl-C, Ctrl-D, multi-line ----------------------------------------------------------------------------


def test_out_of_memory_in_a_reply_drops_that_turn_and_the_repl_goes_on(
    session: Session, state: ChatState, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream, calls = session.stream, []

    def out_of_memory_once(*args, **kwargs):
        calls.append(args)
        for number, step in enumerate(stream(*args, **kwargs)):
            if number == 2 and len(calls) == 1:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")  # as a long chat would
            yield step

    monkeypatch.setattr(session, "stream", out_of_memory_once)
    out = run_repl(session, state, f"first{ENTER}second{ENTER}/bye{ENTER}")
    assert "out of memory in this reply (CUDA out of memory. Tried to allocate 2.00 GiB)" in out
    assert "/set max_tokens" in out and len(calls) == 2
    assert [m["content"] for m in state.messages if m["role"] == "user"] == ["second"]  # the failed turn left nothing


def test_ctrl_c_stops_a_reply_keeps_the_part_said_and_the_repl_goes_on(
    session: Session, state: ChatState, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream, calls = session.stream, []
    first_ids = session.encode_chat([{"role": "user", "content": "first"}])
    said_before_ctrl_c = "".join(step.text for _, step in zip(range(3), stream(first_ids, state.params)))

    def interrupted_once(*args, **kwargs):
        calls.append(args)
        for number, step in enumerate(stream(*args, **kwargs)):
            if number == 3 and len(calls) == 1:
                raise KeyboardInterrupt  # as if Ctrl-C arrived during the 4th decode step
            yield step

    monkeypatch.setattr(session, "stream", interrupted_once)
    out = run_repl(session, state, f"first{ENTER}second{ENTER}/bye{ENTER}")
    partial, full = state.messages[1], state.messages[3]
    assert partial == {"role": "assistant", "content": said_before_ctrl_c, "interrupted": True}
    assert "interrupted" not in full and len(calls) == 2
    assert out.index(said_before_ctrl_c) < out.index("[interrupted]") < out.index(full["content"])
    # The next turn's prompt holds the partial reply (without the marker).
    assert state.conversation()[1] == {"role": "assistant", "content": said_before_ctrl_c}


def test_ctrl_c_at_the_prompt_clears_the_line_and_ctrl_d_leaves(session: Session, state: ChatState) -> None:
    out = run_repl(session, state, f"half a thought{CTRL_C}{CTRL_C}{CTRL_D}")
    assert state.messages == []
    assert out.count("Use Ctrl+D or /bye to leave.") == 1  # only the Ctrl-C on the empty line


def test_multiline_blocks_and_alt_enter(session: Session, state: ChatState) -> None:
    run_repl(session, state, f'"""first line{ENTER}second line{ENTER}"""{ENTER}one{ALT_ENTER}two{ENTER}/bye{ENTER}')
    assert [m["content"] for m in state.messages[::2]] == ["first line\nsecond line", "one\ntwo"]


def test_an_error_in_a_reply_changes_nothing(session: Session, state: ChatState) -> None:
    out = run_repl(session, state, f"{'x ' * 600}{ENTER}/bye{ENTER}")  # longer than the 512-token window
    assert "context window" in out and "/clear" in out and state.messages == []


# --- slash commands ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "field", "value"),
    [
        ("/set temperature 0.7", "temperature", 0.7),
        ("/set top_p 0.9", "top_p", 0.9),
        ("/set top_k 40", "top_k", 40),
        ("/set min_p 0.05", "min_p", 0.05),
        ("/set max_tokens 3", "max_new_tokens", 3),
        ("/set seed 7", "seed", 7),
        ("/SET Temperature 0", "temperature", 0.0),
    ],
)
def test_set_changes_a_sampling_setting(session: Session, state: ChatState, line: str, field: str, value) -> None:
    result = handle_command(session, state, line)
    assert result.ok and getattr(state.params, field) == value


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("/set temperature hot", "temperature needs a number, got 'hot'"),
        ("/set temperature -1", "temperature must be in [0, 2]"),
        ("/set temperature 2.5", "temperature must be in [0, 2]"),
        ("/set temperature nan", "temperature must be a finite number"),
        ("/set top_p 1.5", "top_p must be in (0, 1]"),
        ("/set top_k 2.5", "top_k needs a whole number"),
        ("/set top_k -7", "top_k must be >= -1 (0 or -1 = off), got -7"),
        ("/set max_tokens 0", "max_tokens must be >= 1"),
        ("/set block_size 0", "block_size must be a whole number >= 1"),
        ("/set block_size 2.5", "block_size must be a whole number >= 1"),
        ("/set temprature 1", "Did you mean temperature?"),
        ("/set top_k", "needs a value"),
        ("/set", "/set needs a setting"),
    ],
)
def test_set_rejects_bad_values_and_keeps_the_old(session: Session, state: ChatState, line: str, message: str) -> None:
    before = (state.params, state.block_size)
    result = handle_command(session, state, line)
    assert not result.ok and message in result.message
    assert (state.params, state.block_size) == before


def test_max_tokens_and_block_size_apply_to_the_next_reply(session: Session, state: ChatState) -> None:
    assert handle_command(session, state, "/set max_tokens 3").ok
    assert handle_command(session, state, "/set block_size 2").ok
    stats = reply(session, state, "Hi", lambda _: None).stats
    assert stats.generated_tokens == 3 and stats.block_size == 2
    longer = handle_command(session, state, f"/set block_size {session.drafter.block_size + 1}")
    assert longer.ok and "longer than the" in longer.message and "/set block_size" in longer.message  # runs, slower
    assert "note" not in handle_command(session, state, f"/set block_size {session.drafter.block_size}").message


def test_system_prompt_set_clear_and_kept_by_clear(session: Session, state: ChatState) -> None:
    run_repl(session, state, f"/set system Answer in French.{ENTER}Hello{ENTER}/bye{ENTER}")
    assert state.system == "Answer in French." and len(state.messages) == 2
    assert "system prompt stays" in handle_command(session, state, "/clear").message
    assert state.messages == [] and state.conversation() == [{"role": "system", "content": "Answer in French."}]
    handle_command(session, state, "/set system")
    assert state.system is None and state.conversation() == []


def test_help_show_and_unknown_commands(session: Session, state: ChatState) -> None:
    help_text = handle_command(session, state, "/help").message
    assert all(name in help_text for name in chat.COMMANDS) and '"""' in help_text
    assert handle_command(session, state, "/?").message == help_text
    shown = handle_command(session, state, "/show").message
    assert session.plan_line() in shown and "DFlash, block adaptive up to 4" in shown and "temperature 0.0" in shown
    assert (
        handle_command(session, state, "/set block_size 2").ok
        and "DFlash, block 2" in handle_command(session, state, "/show").message
    )
    assert handle_command(session, state, "/set block_size auto").ok and state.block_size is None
    unknown = handle_command(session, state, "/sav chat.json")
    assert not unknown.ok and unknown.message == "Unknown command /sav. Did you mean /save?"
    assert "/help lists the commands" in handle_command(session, state, "/zzzz").message
    assert all(handle_command(session, state, name).exit for name in ("/bye", "/exit", "/quit"))


def test_a_line_starting_with_a_space_is_a_message(session: Session, state: ChatState) -> None:
    run_repl(session, state, f" /usr/bin holds what?{ENTER}/bye{ENTER}")
    assert state.messages[0]["content"] == "/usr/bin holds what?"


def test_save_and_load_round_trip(session: Session, state: ChatState, options: RunOptions, tmp_path: Path) -> None:
    path = tmp_path / "chat.json"
    run_repl(session, state, f"/set system Be kind.{ENTER}Hello{ENTER}/save {path}{ENTER}/bye{ENTER}")
    saved = json.loads(path.read_text())
    assert saved == {"system": "Be kind.", "messages": state.messages}
    other = ChatState.start(session, options)
    result = handle_command(session, other, f"/load {path}")
    assert result.ok and "Loaded 2 messages" in result.message
    assert (other.system, other.messages) == (state.system, state.messages)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read"),
        ("{not json", "is not JSON"),
        ('["a list"]', "holds no conversation"),
        (
            '{"messages": [{"role": "robot", "content": "hi"}]}',
            "messages[0].role must be system, developer, user, assistant",
        ),
        ('{"messages": [{"role": "user", "content": 3}]}', "messages[0].content must be a string"),
        (
            '{"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]}',
            "messages[1] is a system message",
        ),
        ('{"system": 3, "messages": []}', "system must be text or null"),
    ],
)
def test_load_rejects_bad_files_and_loses_nothing(
    session: Session, state: ChatState, tmp_path: Path, content: str | None, message: str
) -> None:
    path = tmp_path / "conversation.json"
    if content is not None:
        path.write_text(content)
    state.system, state.messages = "keep me", [{"role": "user", "content": "and me"}]
    result = handle_command(session, state, f"/load {path}")
    assert not result.ok and message in result.message
    assert (state.system, state.messages) == ("keep me", [{"role": "user", "content": "and me"}])


def test_load_takes_an_openai_style_system_message(session: Session, state: ChatState, tmp_path: Path) -> None:
    path = tmp_path / "openai.json"
    path.write_text(json.dumps({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]}))
    assert handle_command(session, state, f"/load {path}").ok
    assert state.system == "S" and state.messages == [{"role": "user", "content": "U"}]


def test_save_makes_a_missing_directory_and_explains_what_it_cannot_write(
    session: Session, state: ChatState, tmp_path: Path
) -> None:
    assert handle_command(session, state, f"/save {tmp_path / 'new' / 'chat.json'}").ok
    assert json.loads((tmp_path / "new" / "chat.json").read_text())["messages"] == state.messages
    (tmp_path / "file").write_text("")
    result = handle_command(session, state, f"/save {tmp_path / 'file' / 'chat.json'}")
    assert not result.ok and "cannot write" in result.message


def test_completion_of_commands_settings_and_arguments(tmp_path: Path) -> None:
    completer = chat.CommandCompleter()
    (tmp_path / "chat.json").write_text("{}")

    def complete(text: str) -> list[str]:
        return [c.text for c in completer.get_completions(Document(text), CompleteEvent())]

    assert complete("/sa") == ["/save"]
    assert set(complete("/s")) >= {"/set", "/stats", "/spec", "/save", "/show"}
    assert complete("/set te") == ["temperature"]
    assert complete("/spec o") == ["on", "off"] and complete("/stats of") == ["off"]
    assert complete(f"/load {tmp_path}/ch") == ["at.json"]
    assert complete("hello") == [] and complete("/set system Be") == []


# --- history -------------------------------------------------------------------------------------------------------


def test_history_file_is_written_under_the_data_dir(
    session: Session, state: ChatState, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    history = make_history(True, Console(file=io.StringIO()))
    path = tmp_path / "data" / "dflash" / "chat_history"
    assert isinstance(history, FileHistory) and chat.history_path() == path
    run_repl(session, state, f"/stats{ENTER}/bye{ENTER}", history)
    assert "+/stats" in path.read_text() and "+/bye" in path.read_text()
    assert list(make_history(True, Console(file=io.StringIO())).load_history_strings()) == ["/bye", "/stats"]


def test_no_history_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert isinstance(make_history(False, Console(file=io.StringIO())), InMemoryHistory)
    assert not (tmp_path / "data").exists()


def test_an_unwritable_history_falls_back_to_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "data").write_text("a file where the directory should be")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    warnings = io.StringIO()
    assert isinstance(make_history(True, Console(file=warnings)), InMemoryHistory)
    assert "No chat history" in warnings.getvalue()


# --- one-shot mode through the CLI -------------------------------------------------------------------------------


def cli(options: RunOptions, *args: str, input: str | None = None):
    base = ["chat", "--target", options.target, "--drafter", options.drafter, "--max-tokens", str(TOKENS)]
    return CliRunner().invoke(app, [*base, *args], input=input)


def test_piped_stdin_gets_one_clean_answer(session: Session, options: RunOptions) -> None:
    result = cli(options, "--stats", input="What is 2 + 2?\n")
    assert result.exit_code == 0, result.output
    assert result.stdout == expected_reply(session, options, [{"role": "user", "content": "What is 2 + 2?"}]) + "\n"
    assert "cpu" in result.stderr and f"{TOKENS} tokens" in result.stderr  # the plan and the footer: stderr only
    # cut at --max-tokens: said on stderr (as the REPL says it), the exit code unchanged
    assert "[cut at the token limit: --max-tokens N for longer replies]\n" in result.stderr


def test_prompt_flag_with_system_and_piped_text(session: Session, options: RunOptions) -> None:
    result = cli(options, "--prompt", "Summarize:", "--system", "Be brief.", input="A long text.\n")
    assert result.exit_code == 0, result.output
    question = [{"role": "user", "content": "Summarize:\n\nA long text."}]
    assert result.stdout == expected_reply(session, options, question, system="Be brief.") + "\n"


def test_an_empty_pipe_is_an_error(options: RunOptions) -> None:
    result = cli(options, input="  \n")
    assert result.exit_code == 2 and result.stdout == ""
    assert "nothing to answer" in result.stderr and "--prompt" in result.stderr


def test_bad_setting_flags_fail_before_loading(options: RunOptions) -> None:
    result = cli(options, "--temperature", "-1", input="hi")
    assert result.exit_code == 2 and result.stdout == ""


@pytest.mark.parametrize("history", [True, False])
def test_run_chat_on_a_terminal_runs_the_repl(
    options: RunOptions, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, history: bool
) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    console, err_console = Console(file=io.StringIO()), Console(file=io.StringIO())
    with create_pipe_input() as pipe, create_app_session(input=pipe, output=DummyOutput()):
        pipe.send_text(f"Hello{ENTER}/show{ENTER}/bye{ENTER}")
        code = chat.run_chat(
            options,
            system="Be brief.",
            question=None,
            history=history,
            show_stats=True,
            console=console,
            err_console=err_console,
        )
    out, err = console.file.getvalue(), err_console.file.getvalue()
    assert code == 0 and "dflash chat ad-hoc" in err and "system    Be brief." in err and f"{TOKENS} tokens" in err
    assert "dflash chat" not in out and f"{TOKENS} tokens," not in out  # stdout: the reply only
    assert (tmp_path / "dflash" / "chat_history").exists() == history


def test_ctrl_c_in_one_shot_mode_keeps_the_part_said_and_exits_130(
    session: Session, state: ChatState, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream = session.stream

    def interrupted(*args, **kwargs):
        steps = stream(*args, **kwargs)
        yield next(steps)
        raise KeyboardInterrupt

    monkeypatch.setattr(session, "stream", interrupted)
    out, err = io.StringIO(), io.StringIO()
    assert chat.answer_once(session, state, "Hi", Console(file=out), Console(file=err)) == 130
    assert out.getvalue() == state.messages[1]["content"] + "\n" and err.getvalue() == ""


def test_a_recipe_name_takes_a_drafter_trained_for_its_target(
    model_dirs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `dflash train --target NAME` prints: `dflash chat NAME --drafter DIR` (and --target NAME works too)."""
    folder = tmp_path / "recipes"
    folder.mkdir()
    (folder / "tiny.toml").write_text(f'name = "tiny"\ndescription = "t"\n[target]\nid = "{model_dirs[0]}"\n')
    monkeypatch.setattr(recipes, "user_recipe_dir", lambda: folder)
    for model in (["tiny"], ["--target", "tiny"]):
        for extra, mode in (([], "(DFlash adaptive block ≤4: now "), (["--block-size", "2"], "(DFlash block 2)")):
            args = ["chat", *model, "--drafter", str(model_dirs[1]), "--max-tokens", "3", "--stats", "--prompt", "Hi"]
            result = CliRunner().invoke(app, args + extra)
            assert result.exit_code == 0, result.output
            assert mode in result.stderr


def test_odd_settings_are_said_under_the_plan_line(options: RunOptions) -> None:
    result = cli(options, "--block-size", "9", "--prompt", "Hi")  # the drafter was trained with blocks of 4
    assert result.exit_code == 0, result.output
    plan, note = result.stderr.splitlines()[:2]
    assert plan.startswith("ad-hoc: cpu ") and "block 9" in plan
    assert note.startswith("  note: block 9 is longer than the 4 the drafter was trained with")
    cores = cpu_count()
    absurd = cli(options, "--threads", str(cores + 1), "--cache-ram", "99999999", "--prompt", "Hi")
    assert absurd.exit_code == 0, absurd.output  # they run (the flags win), with a note each under the plan line
    notes = [line for line in absurd.stderr.splitlines() if line.startswith("  note: ")]
    assert any(f"--threads {cores + 1} is more than the {plural(cores, 'core')} here" in note for note in notes)
    assert any("--cache-ram 99999999 MiB is more than the" in note for note in notes), absurd.stderr
    plain = cli(options, "--prompt", "Hi")
    assert (
        "note:" not in plain.stderr and "block ≤4 adaptive" in plain.stderr.splitlines()[0]
    )  # up to the drafter's size


def test_set_format_constrains_the_next_replies(session: Session, state: ChatState, tmp_path: Path) -> None:
    import jsonschema

    state.params = dataclasses.replace(state.params, max_new_tokens=60)
    assert handle_command(session, state, "/set format json").ok
    assert "format    json" in handle_command(session, state, "/show").message
    text = reply(session, state, "Hi", lambda _: None).text
    assert isinstance(json.loads(text), dict)
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    assert handle_command(session, state, f"/set format {path}").ok
    jsonschema.validate(json.loads(reply(session, state, "Again", lambda _: None).text), schema)
    bad = handle_command(session, state, f"/set format {tmp_path / 'missing.json'}")
    assert not bad.ok and "not text, json, or a readable JSON schema file" in bad.message
    assert handle_command(session, state, "/set format text").ok and state.params.grammar is None
