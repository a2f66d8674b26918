"""A loaded recipe: what every frontend (chat, run, bench) holds.

`open_session` resolves the recipe, reads this machine, makes the plan and loads the models once;
`Session.stream` is the one way frontends decode, with or without the drafter.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from rich.console import Console

from dflash_cli.engine import Batch, PrefixStore, SamplingParams, Step, forget_prefixes, generate
from dflash_cli.engine.decode_threads import DecodeThreads, decode_threads
from dflash_cli.engine.drafter import compiled_step as draft_step
from dflash_cli.engine.kernels import native
from dflash_cli.engine.policy import BlockPolicy, adaptive_policy
from dflash_cli.engine.target import compiled_step, standard
from dflash_cli.engine.target.base import batch_limit
from dflash_cli.engine.text import TextStream
from dflash_cli.errors import DflashError, RequestError
from dflash_cli.loading import compiled_steps
from dflash_cli.loading.compiled_steps import load_exported_step
from dflash_cli.loading.models import LoadedModels, load_models
from dflash_cli.progress import working
from dflash_cli.protocol.params import Grammar
from dflash_cli.protocol.replies import THINK_CLOSE, THINK_OPEN
from dflash_cli.protocol.requests import Request, check_context
from dflash_cli.protocol.tools import FORMATS, ToolCall, Tools, hermes_messages, parse_reply, template_format
from dflash_cli.setup.hardware import detect_machine
from dflash_cli.setup.options import RunOptions
from dflash_cli.setup.planning import Plan, PlanOverrides, block_size_note, make_plan
from dflash_cli.setup.recipes import Recipe, recipe_for_target
from dflash_cli.setup.thread_count import ThreadPlan, apply_threads


@dataclass
class Session:
    recipe: Recipe
    plan: Plan
    models: LoadedModels
    threads: ThreadPlan | None = None  # CPU plans: torch's thread count and why
    compile: bool = False  # run the target's steps compiled (engine.compiled.jit)
    console: Console | None = None  # where a progress line shows while a step compiles
    batching: bool = False  # the frontend decodes several requests at once (run, serve): the plan line says how many
    prefix_cache: bool = True  # a request continues from what a slot of the target state holds (engine.prefix)
    decode_threads: DecodeThreads | None = None  # CPU: the thread count decode steps run at (engine.decode_threads)
    # CPU: the drafter's stored steps (engine.drafter.compiled_step) for a drafter loaded later: "load" them, "build" them
    # first when missing (--compile on), or "off"
    draft_steps: Literal["off", "load", "build"] = "off"
    build_note: str | None = None  # a background build of the compiled steps: started, running or failed
    _prefix_store: PrefixStore | None = field(default=None, repr=False)

    @property
    def target(self) -> Any:
        return self.models.target

    @property
    def tokenizer(self) -> Any:
        return self.models.tokenizer

    @property
    def drafter(self) -> Any:
        return self.models.drafter

    @property
    def block_size(self) -> int:
        """The block the speculative loop uses: the plan's choice, else the drafter's own."""
        if self.plan.block_size is not None:
            return self.plan.block_size
        return self.drafter.block_size if self.drafter is not None else 1

    @property
    def batch_size(self) -> int:
        """Rows decoded together by `run` and `serve`: the plan's, or 1 for a target that cannot batch."""
        return 1 if batch_limit(self.target) is not None else self.plan.batch_size

    @property
    def exported(self) -> bool:
        """Whether one-row steps run the target's stored exported step (engine.target.compiled_step; a step that failed
        mid-run has been unloaded)."""
        return compiled_step.loaded_step(self.target) is not None

    @property
    def compiled(self) -> bool:
        """Whether steps run compiled: compiled steps run one row, so a batch of several runs eager."""
        return self.compile and not (self.batching and self.batch_size > 1)

    def plan_line(self) -> str:
        """The plan as it runs: the loaded drafter's own block size fills in what the plan left to it; the rows a
        batching frontend decodes together; the CPU thread count where it matters; whether steps are compiled."""
        line = self.plan.one_line(
            self.drafter.block_size if self.drafter is not None else None,
            drafting=self.drafter is not None,
            rows=self.batch_size if self.batching else 1,
        )
        line += f", batch {self.batch_size}" if self.batching else ""
        return (
            line
            + (f", {self.threads.label()}" if self.threads is not None else "")
            + (f" ({self.decode_threads.threads} decoding)" if self._fewer_decode_threads else "")
            + (", compiled" if self.compiled else ", compiled step stored" if self.exported else "")
        )

    @property
    def _fewer_decode_threads(self) -> bool:
        return self.decode_threads is not None and self.decode_threads.threads != self.decode_threads.offered

    def block_size_note(self, block_size: int | None) -> str | None:
        """A note when `block_size` is longer than the loaded drafter was trained for (None when it is not)."""
        return block_size_note(block_size, self.drafter.block_size if self.drafter is not None else None)

    @property
    def notes(self) -> list[str]:
        """Settings that run, but badly: the plan's, more threads than cores, a block longer than the loaded drafter
        was trained for, a batch this target or compiling cannot have."""
        block = self.block_size_note(self.plan.block_size)
        threads = self.threads.note if self.threads is not None else None
        notes = [*self.plan.notes, *([threads] if threads else []), *([block] if block else [])]
        if self.batching and self.plan.batch_size > 1:
            limit = batch_limit(self.target)
            if limit is not None:
                notes.append(f"batch 1, not {self.plan.batch_size}: {limit}")
            elif self.compile:
                notes.append(
                    f"compile off: compiled steps run one row, and this runs batches of {self.batch_size} "
                    "(--batch-size 1 to compile)"
                )
        return notes

    @property
    def can_speculate(self) -> bool:
        return self.recipe.drafter is not None

    def ensure_drafter(self) -> None:
        """Load the drafter on first need (a session started with --no-spec has none yet)."""
        if self.drafter is None and self.can_speculate:
            from dflash_cli.loading.models import load_drafter, resolve_ref

            self.models.drafter_dir = resolve_ref(self.recipe.drafter, "drafter")
            self.models.drafter = load_drafter(str(self.models.drafter_dir), self.target)
            if self.draft_steps != "off":
                build = self.draft_steps == "build"
                load_exported_step(self.models.drafter, build=build, console=self.console, part="drafter")

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """End-of-turn ids: the tokenizer's eos and the generation config's (chat models often list several)."""
        ids: set[int] = set()
        eos = getattr(self.target.generation_config, "eos_token_id", None)
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    def require_tokenizer(self) -> Any:
        """The tokenizer, or a DflashError naming what is missing (a target without vocabulary files runs on ids only)."""
        if self.tokenizer is None:
            raise DflashError(
                f"{self.recipe.target.id} has no tokenizer: {self.models.target_dir} holds no vocabulary file",
                fix="re-run `dflash pull`, or pass a model directory that includes its tokenizer "
                '(`dflash bench --prompts FILE.jsonl` also takes token ids: {"prompt_ids": [...]})',
            )
        return self.tokenizer

    @property
    def context_window(self) -> int | None:
        from dflash_cli.engine import context_window

        return context_window(self.target)

    @property
    def served_name(self) -> str:
        """The model's name for clients: the recipe's, or the target's id for an ad-hoc --target."""
        return self.recipe.target.id if self.recipe.name == "ad-hoc" else self.recipe.name

    def encode_chat(
        self,
        messages: Sequence[dict[str, Any]],
        template_kwargs: dict[str, Any] | None = None,
        tools: Tools | None = None,
    ) -> list[int]:
        """Apply the chat template to the whole conversation, ready for the assistant's reply. `template_kwargs`
        (a request's chat_template_kwargs) go over the recipe's. `tools` and tool turns go through the template
        where it renders them, else in the hermes format (protocol.tools.hermes_messages)."""
        if not getattr(self.require_tokenizer(), "chat_template", None):
            raise DflashError(
                f"{self.recipe.target.id} has no chat template",
                fix='use `dflash run` with plain {"prompt": ...} lines, or a chat (instruct) model',
            )
        kwargs = {**self.recipe.chat_template_kwargs, **(template_kwargs or {})}
        if self.renders_tools:
            if tools is not None:
                kwargs["tools"] = [dict(tool) for tool in tools.functions]
        elif tools is not None or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            messages = hermes_messages(messages, tools)
        return apply_chat_template(self.tokenizer, messages, kwargs)

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template renders tools itself (transformers' test: the template reads `tools`)."""
        return "tools" in (getattr(self.tokenizer, "chat_template", None) or "")

    @property
    def tool_format(self) -> str | None:
        """The format this model writes tool calls in: the recipe's, else the one its template renders calls in,
        or hermes where the template renders no tools (we render them, in that format); None: unknown, tools are
        refused."""
        if not self.renders_tools:
            return "hermes"
        return self.recipe.tool_parser or template_format(self.tokenizer.chat_template)

    def request_params(self, options: RunOptions, request: Request) -> SamplingParams:
        """A request's sampling params (its fields over the options') with its grammar (response_format, or the
        forced tool call) compiled for this tokenizer, each tool it may call first (a schema the grammar cannot
        take is refused by its tool's field). Raises RequestError naming the field it cannot take. The admission
        check of every route: what it accepts, the engine decodes."""
        from dflash_cli.engine.grammar import compile_grammar

        changes = dict(request.sampling)
        tools = request.tools
        vocab = self.target.config.get_text_config().vocab_size
        if tools is not None:
            if self.tool_format is None:
                raise RequestError(
                    f"{tools.field}: {self.recipe.name} has no known tool-call format (its recipe sets no tool_parser)",
                    param=tools.field,
                    fix=f"set tool_parser in the recipe to one of {', '.join(FORMATS)}",
                )
            for i in tools.enforced:
                parameters = tools.functions[i]["function"].get("parameters")
                if parameters:
                    where = f"{tools.field}[{i}].function.parameters"
                    grammar = Grammar("json_schema", json.dumps(parameters, ensure_ascii=False), field=where)
                    compile_grammar(grammar, self.require_tokenizer(), vocab)
            if tools.forced:
                changes["grammar"] = self._tool_grammar(tools)
        params = self.sampling_params(options, **changes)
        if params.grammar is not None:
            compile_grammar(params.grammar, self.require_tokenizer(), vocab)  # (cached for the generation)
        return params

    def _tool_grammar(self, tools: Tools) -> Grammar:
        tag, field = FORMATS[self.tool_format].grammar, tools.field.removesuffix("tools") + "tool_choice"
        if tag is None:
            raise RequestError(
                f"{field} {tools.choice!r}: forcing a call is not supported for the {self.tool_format} format; "
                "use auto",
                param=field,
            )
        enforced = [tools.functions[i] for i in tools.enforced]
        spec = {"format": tag, "tools": enforced, "choice": tools.choice, "parallel": tools.parallel}
        return Grammar("tool_calls", json.dumps(spec, sort_keys=True), field=field)

    def reply_text(self, token_ids: Sequence[int], stop_strings: Sequence[str] = ()) -> str:
        """Generated ids as a tool parser reads them: special tokens kept (they delimit calls), end-of-turn ids
        left out, and the text cut where the first of `stop_strings` starts (the engine's text is cut there)."""
        stops = set(self.stop_token_ids)
        text = self.require_tokenizer().decode([t for t in token_ids if t not in stops], skip_special_tokens=False)
        return text[: min((at for at in map(text.find, filter(None, stop_strings)) if at >= 0), default=len(text))]

    def reply_text_stream(self, stop_strings: Sequence[str] = (), *, only_markers: bool = False) -> TextStream:
        """`reply_text` a step at a time: `push(ids)[0]` is the new raw text (a short window decoded per step),
        held back where one of `stop_strings` may be starting and cut where one starts. `only_markers`: of the
        special tokens only the reasoning markers are kept (a tokenizer may make `<think>` one), so the text is
        the shown text with its reasoning marked."""
        tokenizer = self.require_tokenizer()
        skip = set(self.stop_token_ids)
        if only_markers:
            added = getattr(tokenizer, "added_tokens_decoder", {})
            special = set(tokenizer.all_special_ids) | {i for i, token in added.items() if token.special}
            skip |= special - {i for i, token in added.items() if token.content in (THINK_OPEN, THINK_CLOSE)}
        return TextStream(tokenizer, stop_strings, special=True, skip_ids=sorted(skip))

    def parse_reply(
        self, request: Request, token_ids: Sequence[int], text: str, finish_reason: str | None = None
    ) -> tuple[str | None, list[ToolCall]]:
        """The reply's content and tool calls: (text, []) for a request without tools. A reply max_tokens cut
        (`finish_reason` "length") drops a call it left open."""
        if request.tools is None or self.tool_format is None:
            return text, []
        raw = self.reply_text(token_ids, request.sampling.get("stop_strings") or ())
        return parse_reply(raw, request.tools, self.tool_format, cut=finish_reason == "length")

    def encode_prompt(self, text: str) -> list[int]:
        """Plain completion: the text as is (with BOS where the tokenizer adds one)."""
        return list(self.require_tokenizer()(text)["input_ids"])

    def encode_request(self, request: Request, *, prompt_as_chat: bool = False, fit_window: bool = True) -> list[int]:
        """A request's prompt ids, checked against this model (vocabulary, chat template, and with `fit_window`
        the context window: the prompt and the max_tokens it asks for; a count of tokens needs no room to generate).

        Raises RequestError for a request this model cannot take. With `prompt_as_chat` a plain `prompt` is sent
        as a user turn when the model has a chat template (bench measures chat replies)."""
        field = request.prompt_key
        if request.prompt_ids is not None:
            ids = list(request.prompt_ids)
            vocab = self.target.get_input_embeddings().num_embeddings
            outside = [token for token in ids if token >= vocab]
            if outside:
                raise RequestError(
                    f"token id {outside[0]} is outside the vocabulary of {self.recipe.target.id} (size {vocab})",
                    param=field,
                    fix="use token ids made with this model's tokenizer",
                )
        else:
            chat = request.is_chat or (prompt_as_chat and getattr(self.tokenizer, "chat_template", None))
            try:
                if chat:
                    messages = request.messages or [{"role": "user", "content": request.prompt or ""}]
                    ids = self.encode_chat(messages, dict(request.chat_template_kwargs), request.tools)
                else:
                    ids = self.encode_prompt(request.prompt or "")
            except RequestError:
                raise
            except DflashError as error:  # no tokenizer, no chat template, a template that rejects the conversation
                raise RequestError(error.message, param=field, fix=error.fix) from None
        if not ids:
            raise RequestError("the prompt encodes to no tokens", param=field)
        if fit_window:
            check_context(request, len(ids), self.context_window)
        return ids

    def sampling_params(self, options: RunOptions, **changes: Any) -> SamplingParams:
        """The options' sampling flags plus this model's stop ids; `changes` override single fields."""
        base = options.sampling_params(stop_token_ids=self.stop_token_ids)
        fields = {**base.__dict__, **changes}
        return SamplingParams(**fields)

    def stream(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        speculative: bool = True,
        block_size: int | None = None,
    ) -> Iterator[Step]:
        """Decode with the drafter (speculative) or without it (baseline): the same loop either way. The block
        size: `block_size` for every step when given, else the plan's (adaptive up to it, unless --block-size)."""
        if speculative:
            self.ensure_drafter()
        drafter = self.drafter if speculative else None
        policy = self._policy(drafter, block_size, self.compile)
        return generate(
            self.target,
            drafter,
            prompt_ids,
            params,
            block_size=block_size or self.block_size,
            tokenizer=self.tokenizer,
            compile=self.compile,
            notify=self._compile_status,
            policy=policy,
            prefix_cache=self.prefix_cache,
            prefix_store=self.prefix_store,
            decode_threads=self.decode_threads.threads if self.decode_threads is not None else None,
        )

    def forget_prefixes(self) -> None:
        """The next request prefills its whole prompt (chat's /clear and /load start over)."""
        forget_prefixes(self.target)
        if self._prefix_store is not None:
            self._prefix_store.clear()

    @property
    def prefix_store(self) -> PrefixStore | None:
        """Prefixes beyond the slots, in host memory, up to the plan's `cache_ram_mib` (None: none kept)."""
        if not self.prefix_cache or self.plan.cache_ram_mib == 0:
            return None
        if self._prefix_store is None:
            self._prefix_store = PrefixStore(self.plan.cache_ram_mib * 2**20)
        return self._prefix_store

    def batch(self, *, speculative: bool = True) -> Batch:
        """A batch of `batch_size` rows for frontends that decode several requests at once (run, serve): one block
        size per step for all rows (the adaptive policy pools their acceptance)."""
        if speculative:
            self.ensure_drafter()
        drafter = self.drafter if speculative else None
        return Batch(
            self.target,
            drafter,
            rows=self.batch_size,
            block_size=self.block_size,
            tokenizer=self.tokenizer,
            compile=self.compiled,
            notify=self._compile_status,
            policy=self._policy(drafter, None, self.compiled),
            prefix_cache=self.prefix_cache,
            prefix_store=self.prefix_store,
            decode_threads=self.decode_threads.threads if self.decode_threads is not None else None,
        )

    def _policy(self, drafter: Any, block_size: int | None, compile: bool) -> BlockPolicy | None:
        """The adaptive block policy, unless the plan or the caller (`block_size`) fixes the block."""
        if drafter is None or block_size is not None or not self.plan.adaptive_block:
            return None
        return adaptive_policy(self.target, drafter, self.block_size, compile=compile, notify=self._compile_status)

    def _compile_status(self, message: str) -> AbstractContextManager[Any]:
        """A progress line while a step compiles (nothing to show without a console)."""
        return working(self.console, message)


def apply_chat_template(
    tokenizer: Any, messages: Sequence[dict[str, Any]], template_kwargs: dict[str, Any]
) -> list[int]:
    """Token ids of the conversation, ready for the assistant's reply, rendered with the template options (the
    recipe's, such as `enable_thinking = false` for the Qwen3 drafters, and a request's over them). `dflash train` renders its prompts with this too, so a
    drafter is distilled on exactly what it will be served."""
    from jinja2.exceptions import TemplateError

    try:
        encoded = tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True, **template_kwargs
        )
    except (TemplateError, TypeError) as error:  # templates that allow no system prompt; odd template kwargs
        folded = fold_system(messages)
        if folded != list(messages):  # a template that takes no system message (or only first): fold them in
            return apply_chat_template(tokenizer, folded, template_kwargs)
        raise DflashError(
            f"the chat template rejects this conversation: {error}",
            fix="drop the system message, or start the conversation with a user message",
        ) from None
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def fold_system(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with its system messages as text of user turns, order kept: joined to the user turn just
    before (or else just after), or a user turn of their own; for templates that render no system message, or
    one only first (agents send them mid-conversation), as ollama's templates fold a system prompt."""

    def is_text(message: dict[str, Any], role: str) -> bool:
        return message["role"] == role and isinstance(message.get("content"), str)

    out: list[dict[str, Any]] = []
    waiting: list[str] = []  # system text not yet placed
    for message in messages:
        if is_text(message, "system") and not waiting and out and is_text(out[-1], "user"):
            out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n\n{message['content']}"}
        elif is_text(message, "system"):
            waiting.append(message["content"])
        elif waiting and is_text(message, "user"):
            out.append({**message, "content": "\n\n".join([*waiting, message["content"]])})
            waiting = []
        else:
            if waiting:
                out.append({"role": "user", "content": "\n\n".join(waiting)})
                waiting = []
            out.append(dict(message))
    if waiting:
        out.append({"role": "user", "content": "\n\n".join(waiting)})
    return out


def cpu_kernels_reason(console: Console | None) -> str:
    """Load dflash's CPU kernels into this process before its first product (compiled first, once per machine, with
    a status line); the --explain line saying which kernels the bf16 products and attention run on."""
    building = native.pending_build()
    message = "Compiling dflash's CPU kernels (once on this machine, about 10 s)..."
    with working(console if building else None, message):
        why = native.unavailable()
    if why is None:
        return f"kernels: products and attention on dflash's CPU kernels ({native.loaded_tier()} tier, engine.kernels.native)"
    return f"kernels: products and attention on torch's kernels ({why})"


def plan_label(recipe: Recipe, target: str | None) -> str:
    """What the plan line names: the recipe, or for `--target` naming a recipe (`--target demo`: an ad-hoc recipe
    with that recipe's facts, not its drafter) that recipe's target, as `demo's target`, not "ad-hoc"."""
    if recipe.source != "ad-hoc" or not target:
        return recipe.name
    known = recipe_for_target(target)
    if known is None or target.strip().lower() == known.target.id.lower():  # (a repo id or a directory: ad-hoc)
        return recipe.name
    return f"{known.name}'s target"


def open_session(
    options: RunOptions, console: Console | None = None, *, batching: bool = False, build_later: bool = False
) -> Session:
    """Recipe -> machine facts -> plan -> loaded models. Prints the plan (and why, with --explain). `batching`: the
    frontend decodes several requests at once (run, serve). `build_later` (chat, run, serve): a CPU plan whose
    compiled steps are not stored yet starts their build in the background (loading.compiled_steps) and runs eager."""
    recipe = options.resolve_recipe()
    plan = make_plan(detect_machine(), recipe, options.overrides)
    threads = apply_threads(options.threads) if plan.device == "cpu" else None
    compile, compile_why = options.compile_on(plan.device)
    speculative = not options.no_spec and recipe.drafter is not None
    models = load_models(recipe, plan, with_drafter=speculative, console=console)
    if compile:
        from dflash_cli.engine.target.hybrid import linear_cache_layers

        if linear_cache_layers(models.target):  # say so rather than print "compiled" over an eager run
            compile, compile_why = False, "compile off: hybrid targets run eager (their state rollback is Python-side)"
    kernels_why = cpu_kernels_reason(console) if plan.device == "cpu" else None
    draft_steps, draft_why, missing = "off", None, False
    if plan.device == "cpu" and options.compile != "off":
        if standard.unsupported(models.target) is None:
            step, compile_why = load_exported_step(models.target, build=compile, console=console)
            missing = step is None
        draft_steps = "build" if options.compile == "on" else "load"
        if models.drafter is not None:
            build = draft_steps == "build"
            step, draft_why = load_exported_step(models.drafter, build=build, console=console, part="drafter")
            missing = missing or (step is None and draft_step.unsupported(models.drafter) is None)
    session = Session(recipe, plan, models, threads, compile, console, batching, options.prefix_cache)
    session.draft_steps = draft_steps
    # Built for the recipe's default plan: a session that overrides the plan would not find them.
    default_plan = replace(options.overrides, batch_size=None) == PlanOverrides()
    if build_later and missing and options.compile == "auto" and default_plan:
        if os.environ.get(compiled_steps.ENVIRONMENT, "1") != "0":
            ref = {"name": options.recipe_name, "recipe_file": options.recipe_file, "target": options.target,
                   "drafter": options.drafter}  # fmt: skip
            session.build_note = compiled_steps.build_in_background(ref)
    if threads is not None and options.threads is None and threads.threads > 1 and not compile:
        message = "Measuring how many threads decode fastest (once on this machine)..."
        with working(console, message):
            session.decode_threads = decode_threads(models.target, threads.threads)
    if console is not None:  # after loading: the drafter's config completes the line (its block size)
        label = plan_label(recipe, options.target)
        console.print(f"{label}: {session.plan_line()}", style="dim", markup=False, highlight=False)
        for note in session.notes:
            console.print(f"  note: {note}", style="yellow", markup=False, highlight=False)
        if session.build_note is not None:
            console.print(f"  {session.build_note}", style="dim", markup=False, highlight=False)
        if options.explain:
            source = (models.target_source,) if models.target_source else ()
            decoding = (session.decode_threads.reason(),) if session.decode_threads is not None else ()
            kernels = (kernels_why,) if kernels_why is not None else ()
            drafting = (draft_why,) if draft_why is not None else ()
            for reason in (
                *plan.reasons,
                *source,
                *((threads.reason,) if threads else ()),
                *decoding,
                *kernels,
                compile_why,
                *drafting,
            ):
                console.print(f"  - {reason}", style="dim", markup=False, highlight=False)
    return session
