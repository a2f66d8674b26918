"""Sampling parameters, and the one table of request fields that set them.

Plain data, importable without torch, so input is validated before models load. `FIELDS` lists each sampling
field once: the key requests use (OpenAI's name; also the CLI flag `--max-tokens` and chat's `/set max_tokens`),
its aliases, its type and its valid range. `read_sampling` reads them from any request (a `dflash run` line, a
server request body, a bench prompt line, the CLI flags) and its errors name the key the user wrote.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dflash_cli.errors import DflashError, RequestError

# Below this a temperature only risks overflow in logits / temperature; like vLLM, it means greedy.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class Field:
    key: str  # the request key; RunOptions and the CLI flags use the same name
    attr: str  # the SamplingParams attribute it sets
    kind: type  # int, float, or tuple (stop strings)
    rule: str  # the valid values, as an error message says them
    valid: Callable[[Any], bool]
    help: str
    aliases: tuple[str, ...] = ()


FIELDS: tuple[Field, ...] = (
    Field(
        "max_tokens",
        "max_new_tokens",
        int,
        ">= 1",
        lambda v: v >= 1,
        "most tokens to generate",
        aliases=("max_completion_tokens",),
    ),
    Field("temperature", "temperature", float, ">= 0", lambda v: v >= 0, "0 = greedy (below 1e-5 too)"),
    Field("top_p", "top_p", float, "in (0, 1]", lambda v: 0 < v <= 1, "nucleus sampling; 1 = off"),
    Field("top_k", "top_k", int, ">= 0 (0 = off)", lambda v: v >= 0, "keep the K most likely tokens (-1 = off too)"),
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
            value = getattr(self, field.attr)
            if value is not None and not field.valid(value):
                raise DflashError(f"invalid sampling parameter: {field.attr} must be {field.rule}")


def _show(value: Any) -> str:
    import json

    text = json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= 60 else text[:57] + "..."


def read_value(field: Field, value: Any, name: str) -> Any:
    """One field's value from a request (JSON types), checked; `name` is the key as the user wrote it."""
    if field.kind is tuple:
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(stop, str) for stop in stops):
            raise RequestError(f"{name} must be {field.rule}, got {_show(value)}", param=name)
        if not all(stops):
            raise RequestError(f"{name} must be {field.rule}: an empty stop string would stop at once", param=name)
        return tuple(stops)
    wanted = (int,) if field.kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, wanted):
        kind = "an integer" if field.kind is int else "a number"
        raise RequestError(f"{name} must be {kind}, got {_show(value)}", param=name)
    if isinstance(value, float) and not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number, got {value}", param=name)
    if field.attr == "top_k" and value == -1:  # vLLM's spelling of "off"
        return 0
    if not field.valid(value):
        raise RequestError(f"{name} must be {field.rule}, got {_show(value)}", param=name)
    if field.attr == "temperature" and value < GREEDY_BELOW:
        return 0.0
    return value


def read_sampling(source: Mapping[str, Any], *, prefix: str = "") -> dict[str, Any]:
    """The SamplingParams fields a request sets, by attribute. JSON null means "the default" (clients send nulls);
    other keys are not looked at. `prefix` goes before key names in errors (e.g. "body.")."""
    params: dict[str, Any] = {}
    for field in FIELDS:
        given = [(name, source[name]) for name in (field.key, *field.aliases) if source.get(name) is not None]
        if len(given) > 1 and any(value != given[0][1] for _, value in given):
            names = " and ".join(prefix + name for name, _ in given)
            raise RequestError(f"{names} disagree: give one of them", param=prefix + given[0][0])
        if given:
            name, value = given[0]
            params[field.attr] = read_value(field, value, prefix + name)
    return params


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
