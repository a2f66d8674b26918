"""Sampling parameters, and the one table of request fields that set them.

Plain data, importable without torch, so input is validated before models load. `FIELDS` lists each sampling
field once: the key requests use (OpenAI's name; also the CLI flag `--max-tokens` and chat's `/set max_tokens`),
its aliases, its type and its valid range. `read_sampling` reads them from any request (a `dflash run` line, a
server request body, a bench prompt line, the CLI flags) and its errors name the key the user wrote.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dflash_cli.errors import DflashError, RequestError

# Below this a temperature only risks overflow in logits / temperature; like vLLM, it means greedy.
GREEDY_BELOW = 1e-5


# The largest count a request may ask for (max_tokens, top_k): what a 32-bit integer holds, far past any context
# window or vocabulary, and small enough for every tensor size and index it becomes.
MOST_COUNT = 2**31 - 1


@dataclass(frozen=True)
class Field:
    key: str  # the request key; RunOptions and the CLI flags use the same name
    attr: str  # the SamplingParams attribute it sets
    kind: type  # int, float, or tuple (stop strings)
    rule: str  # the valid values, as an error message says them
    valid: Callable[[Any], bool]
    help: str
    aliases: tuple[str, ...] = ()
    most: int | None = None  # an integer's upper bound (said apart from `rule`: "must be at most ...")
    off: Any = None  # a peer's other spelling of "off" (vLLM's top_k -1), read as 0

    def read(self, value: Any) -> Any:
        """A value as the user wrote it, "off" spelt one way (requests, lines, flags and /set alike)."""
        return 0 if self.off is not None and value == self.off else value

    def problem(self, value: Any) -> str | None:
        """What is wrong with a value of the right type ("must be ..."), or None."""
        if self.most is not None and value > self.most:
            return f"must be at most {self.most}"
        return None if self.valid(value) else f"must be {self.rule}"


FIELDS: tuple[Field, ...] = (
    Field(
        "max_tokens",
        "max_new_tokens",
        int,
        ">= 1",
        lambda v: v >= 1,
        "most tokens to generate",
        aliases=("max_completion_tokens",),
        most=MOST_COUNT,
    ),
    # (OpenAI's range; past 2 sampling is all but uniform: garbage, never what a user means)
    Field("temperature", "temperature", float, "in [0, 2]", lambda v: 0 <= v <= 2, "0 = greedy (below 1e-5 too)"),
    Field("top_p", "top_p", float, "in (0, 1]", lambda v: 0 < v <= 1, "nucleus sampling; 1 = off"),
    Field(
        "top_k",
        "top_k",
        int,
        ">= -1 (0 or -1 = off)",
        lambda v: v >= 0,  # (checked after `read`: -1 is 0 by then)
        "keep the K most likely tokens (-1 = off too)",
        most=MOST_COUNT,
        off=-1,
    ),
    Field("min_p", "min_p", float, "in [0, 1)", lambda v: 0 <= v < 1, "drop tokens below this share of the top one"),
    Field("seed", "seed", int, "a 64-bit integer", lambda v: -(2**63) <= v < 2**64, "random seed (null = none)"),
    Field(
        "stop",
        "stop_strings",
        tuple,
        "a string or a list of non-empty strings",
        lambda v: all(v),
        "stop before any of these strings",
    ),
)
BY_KEY: dict[str, Field] = {name: field for field in FIELDS for name in (field.key, *field.aliases)}


@dataclass(frozen=True)
class Grammar:
    """An output constraint, torch-free (engine.grammar compiles it). `kind`: "json" (any JSON object),
    "json_schema" (`source`: the schema as JSON text) or "tool_calls" (`source`: JSON text of the model's
    tool-call format, the tools, the choice and whether calls may be parallel: a forced tool call). `field` is the request field it came from, as the user wrote it (for errors)."""

    kind: str
    source: str = ""
    field: str = "response_format"


@dataclass(frozen=True)
class SamplingParams:
    # The defaults are the CLI's (`--max-tokens` 512, greedy): RunOptions holds one of these, so a flag's default
    # and a request's are the same value.
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    grammar: Grammar | None = None  # decode under this constraint (exactly: the target's logits are masked)

    def __post_init__(self) -> None:
        for field in FIELDS:
            value = field.read(getattr(self, field.attr))  # (top_k=-1, as the rule allows, holds 0)
            object.__setattr__(self, field.attr, value)
            if value is not None and (problem := field.problem(value)) is not None:
                raise DflashError(f"invalid sampling parameter: {field.attr} {problem}")


def show(value: Any) -> str:
    """A value as JSON, cut short, for error messages (every protocol module's)."""
    text = json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= 60 else text[:57] + "..."


def read_value(field: Field, value: Any, name: str) -> Any:
    """One field's value from a request (JSON types), checked; `name` is the key as the user wrote it."""
    if field.kind is tuple:
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(stop, str) for stop in stops):
            raise RequestError(f"{name} must be {field.rule}, got {show(value)}", param=name)
        if not all(stops):
            raise RequestError(f"{name} must be {field.rule}: an empty stop string would stop at once", param=name)
        return tuple(stops)
    value = field.read(read_number(value, name, integer=field.kind is int))
    if (problem := field.problem(value)) is not None:
        raise RequestError(f"{name} {problem}, got {show(value)}", param=name)
    if field.attr == "temperature" and value < GREEDY_BELOW:
        return 0.0
    return value


def read_number(
    value: Any, name: str, *, integer: bool = False, low: float | None = None, high: float | None = None
) -> Any:
    """A request's number, checked: an integer (`integer`) or any finite number (not a boolean), within [low, high]
    where given. Any route's parser checks its numeric fields with this; RequestError names `name`."""
    wanted = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, wanted):
        raise RequestError(f"{name} must be {'an integer' if integer else 'a number'}, got {show(value)}", param=name)
    if isinstance(value, float) and not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number, got {value}", param=name)
    below, above = low is not None and value < low, high is not None and value > high
    if below or above:
        both = low is not None and high is not None
        rule = f"in [{low:g}, {high:g}]" if both else f">= {low:g}" if below else f"<= {high:g}"
        raise RequestError(f"{name} must be {rule}, got {show(value)}", param=name)
    return value


def _given(source: Mapping[str, Any], field: Field) -> list[tuple[str, Any]]:
    """The (key, value) pairs `source` sets `field` with, its aliases too (JSON null: not set)."""
    return [(name, source[name]) for name in (field.key, *field.aliases) if source.get(name) is not None]


def read_sampling(source: Mapping[str, Any], *, prefix: str = "") -> dict[str, Any]:
    """The SamplingParams fields a request sets, by attribute. JSON null means "the default" (clients send nulls);
    other keys are not looked at. `prefix` goes before key names in errors (e.g. "body.")."""
    params: dict[str, Any] = {}
    for field in FIELDS:
        given = _given(source, field)
        if len(given) > 1 and any(value != given[0][1] for _, value in given):
            names = " and ".join(prefix + name for name, _ in given)
            raise RequestError(f"{names} disagree: give one of them", param=prefix + given[0][0])
        if given:
            name, value = given[0]
            params[field.attr] = read_value(field, value, prefix + name)
    return params


def sampling_keys(source: Mapping[str, Any], *, prefix: str = "") -> dict[str, str]:
    """The key each SamplingParams field `source` sets came under, by attribute (`max_completion_tokens` where the
    request said so), for errors found later (requests.check_context)."""
    return {field.attr: prefix + given[0][0] for field in FIELDS if (given := _given(source, field))}


def read_setting(key: str, text: str) -> tuple[str, Any]:
    """A setting typed as text (chat's `/set KEY VALUE`): the SamplingParams attribute and its checked value."""
    field = BY_KEY[key]
    if field.key == "seed" and text.lower() in ("none", "off"):
        return field.attr, None
    if field.kind is tuple:
        return field.attr, read_value(field, text, key)
    try:
        value: Any = int(text) if field.kind is int else float(text)
    except ValueError:
        kind, example = ("a whole number", "50") if field.kind is int else ("a number", "0.7")
        raise RequestError(
            f"{key} needs {kind}, got {text!r}", param=key, fix=f"for example: /set {key} {example}"
        ) from None
    return field.attr, read_value(field, value, key)


def sampling_settings(params: SamplingParams) -> dict[str, Any]:
    """The sampling fields of `params` under their request keys (what a report or `/show` prints)."""
    return {field.key: getattr(params, field.attr) for field in FIELDS}
