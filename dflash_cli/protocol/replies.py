"""A reply as the agents' APIs (Anthropic Messages, OpenAI Responses) hand it out: reasoning, text and tool calls,
in the order the model wrote them, then how it ended. Torch-free.

`dflash serve` turns a generation's updates into a `Prompt`, then `Part`s (the text split by `ReasoningSplit`, the
calls found by `tools.ToolStream`), then an `Ending`; each API's module renders them as its stream events, and a
whole reply is the same items gathered, so a streamed and a whole reply cannot differ.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dflash_cli.protocol.tools import ToolCall

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"  # Qwen3's (and DeepSeek-R1's) reasoning markers


@dataclass(frozen=True)
class Prompt:
    """The prompt as the engine took it, a reply's first item (once its first step is in): its tokens, and how many
    of them were read from a slot (prefix reuse)."""

    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Part:
    """A piece of a reply: `kind` "reasoning" or "text" with its `text`, or "call" with its `call`."""

    kind: str
    text: str = ""
    call: ToolCall | None = None


@dataclass(frozen=True)
class Ending:
    """How a reply ended: `finish_reason` "stop", "length" or "tool_calls" (OpenAI's words, finish_with_calls);
    `stop_sequence`, the request's stop string that ended it (None: the model's end or a limit); the token counts,
    `cached_tokens` of the prompt's reused from a slot (prefix reuse), `reasoning_tokens` of the output's up to
    the step that closed its reasoning; `stats`, the engine's numbers of the generation (dflash's own report)."""

    finish_reason: str
    stop_sequence: str | None
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    stats: Any = field(default=None, compare=False)
    reasoning_tokens: int = 0


# The rendered prompt's last tokens that `prompt_opens_reasoning` reads: the marker and the whitespace after it,
# with room for a tokenizer that spells `<think>` in single characters (7 tokens) rather than one token.
PROMPT_TAIL_TOKENS = 16


def prompt_opens_reasoning(prompt_tail: str) -> bool:
    """Whether a rendered prompt ends inside an open reasoning section (templates that write `<think>\\n` after the
    assistant's header): the reply then starts with reasoning and only closes it."""
    return prompt_tail.rstrip().endswith(THINK_OPEN)


class ReasoningSplit:
    """A reply's text as it streams, split into reasoning (between `<think>` and `</think>`, the markers and the
    whitespace around them left out) and text. `feed` returns the (kind, text) pieces that are sure; text that may
    still become a marker, and whitespace that may be the reasoning's end, wait. A reply that does not open with
    reasoning is text as it comes (`opened`: the prompt opened it already)."""

    def __init__(self, opened: bool = False) -> None:
        self.state = "reasoning" if opened else "start"  # start -> reasoning -> after -> text, or start -> text
        self.held = ""
        self.reasoned = False  # reasoning text was given out (its leading whitespace is dropped until then)

    @property
    def reasoning(self) -> bool:
        """Whether the reply is in its reasoning (or still may be starting it)."""
        return self.state in ("start", "reasoning")

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.held += text
        out: list[tuple[str, str]] = []
        while self.held:
            if self.state == "start":
                start = self.held.lstrip()
                if start.startswith(THINK_OPEN):
                    self.state, self.held = "reasoning", start[len(THINK_OPEN) :]
                    continue
                if THINK_OPEN.startswith(start):  # (blank, or a start of the marker: wait)
                    break
                self.state = "text"
            elif self.state == "reasoning":
                if not self.reasoned:
                    self.held = self.held.lstrip()
                at = self.held.find(THINK_CLOSE)
                if at >= 0:
                    self._reason(out, self.held[:at].rstrip())
                    self.state, self.held = "after", self.held[at + len(THINK_CLOSE) :]
                    continue
                keep = next((k for k in range(len(THINK_CLOSE) - 1, 0, -1) if self.held.endswith(THINK_CLOSE[:k])), 0)
                sure = self.held[: len(self.held) - keep].rstrip()
                self._reason(out, sure)
                self.held = self.held[len(sure) :]
                break
            elif self.state == "after":  # the whitespace between the reasoning and the answer
                self.held = self.held.lstrip()
                if self.held:
                    self.state = "text"
            else:
                out.append(("text", self.held))
                self.held = ""
        return out

    def _reason(self, out: list[tuple[str, str]], text: str) -> None:
        if text:
            out.append(("reasoning", text))
            self.reasoned = True

    def finish(self) -> list[tuple[str, str]]:
        """What was held, at the end of the reply: an unclosed reasoning's last words, or text."""
        held, self.held = self.held, ""
        if self.state == "reasoning":
            held = held.rstrip() if self.reasoned else held.strip()
            return [("reasoning", held)] if held else []
        if self.state == "after":
            return []
        return [("text", held)] if held else []
