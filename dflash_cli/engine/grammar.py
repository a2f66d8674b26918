"""Constrained decoding (response_format, forced tool calls), exact under speculation.

A row with a grammar keeps an xgrammar matcher over its committed tokens. Before a verify's logits are sampled,
every position of the row's block is masked with the grammar's state after the block's preceding tokens: the
matcher advances over the drafts, filling one bitmask row per position, then rolls back; after the step it
accepts the committed tokens. A draft the grammar rejects ends the masks there: the target's masked choice before
it cannot equal it, so nothing after it is committed. Sampling then runs on the masked logits as plain decoding
does (the same loop with a block of 1), so a row decodes exactly what constrained plain decoding would: token for
token at temperature 0, in distribution above it.

xgrammar rather than llguidance, measured on the demo's tokenizer (49k tokens, 2-core CPU, a 3-field schema):
masks 0.01-0.03 ms a position against llguidance's 0.05-0.1 ms, schema compile 5-12 ms, a matcher with native
rollback; llguidance's first mask on a tokenizer took ~2 s. It is also what vLLM and SGLang use.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Sequence
from typing import Any

import torch

from dflash_cli.engine.sampling import greedy_tokens
from dflash_cli.errors import DflashError, RequestError
from dflash_cli.protocol.params import Grammar, SamplingParams
from dflash_cli.protocol.schemas import subschemas

# JSON is constrained to one layout, `{"a": 1, "b": [2, 3]}` (OpenAI's own): free whitespace lets small models loop
# on newlines inside an object until max_tokens.
JSON_LAYOUT = dict(any_whitespace=False)
JSON_WHITESPACE = 1  # the same bound inside tool-call arguments (the format's own structure sets the rest)
# An integer without bounds may take digits until max_tokens (the demo wrote "age": 1000000000... and no closing
# brace): bounded to JSON's interoperable integers (RFC 8259, 6), as llama.cpp bounds them to 16 digits
SAFE_INTEGER = 2**53 - 1
# A number no schema bounds (json_object's values, "type": "number") likewise: at most 16 digits before the point
# (llama.cpp's bound), 16 after it and 3 in the exponent: more than a double holds. Set in xgrammar's shared number
# rules, by name; under another xgrammar that names them otherwise the numbers stay open (tests check the bound).
FREE_NUMBER_DIGITS = {
    "basic_integer": ("[0-9]*", "[0-9]{0, 15}"),
    "basic_number_2": ("[0-9]*", "[0-9]{0, 15}"),
    "basic_number_3": ("basic_number_digits{1, -1}", "basic_number_digits{1, 16}"),
    "basic_number_5": ("basic_number_digits{1, -1}", "basic_number_digits{1, 3}"),
}


@functools.cache
def _compiler(tokenizer: Any, vocab_size: int) -> Any:
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    return xgrammar.GrammarCompiler(info, max_threads=1)


def compile_grammar(grammar: Grammar, tokenizer: Any, vocab_size: int) -> Any:
    """The compiled grammar (xgrammar caches them per tokenizer). Raises RequestError naming `grammar.field` for a
    schema or tool format the grammar library cannot take."""
    if tokenizer is None:
        raise DflashError("a grammar (response_format or a forced tool call) needs the model's tokenizer")
    compiler = _compiler(tokenizer, vocab_size)
    try:
        if grammar.kind in ("json", "json_schema"):
            schema = '{"type": "object"}' if grammar.kind == "json" else grammar.source
            compiled = compiler.compile_grammar(json_grammar(schema))
        elif grammar.kind == "tool_calls":
            compiled = compiler.compile_structural_tag(_tool_call_tag(grammar.source))
        else:
            raise AssertionError(f"unknown grammar kind {grammar.kind!r}")
    except (RuntimeError, ValueError, TypeError) as error:  # xgrammar's errors for schemas it does not support
        reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        reason = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", reason)  # (xgrammar's time and source line)
        raise RequestError(
            f"{grammar.field}: the grammar library cannot use this: {reason}", param=grammar.field
        ) from None
    if not _can_start(compiled, vocab_size):
        raise RequestError(
            f"{grammar.field}: nothing this model writes can match it (no token may start its output)",
            param=grammar.field,
        )
    return compiled


def json_grammar(schema: str, **layout: Any) -> str:
    """The grammar (EBNF) of JSON that follows `schema`, in one layout (xgrammar's `from_json_schema` keywords;
    default JSON_LAYOUT), its integers and free numbers bounded."""
    import xgrammar

    bounded = json.dumps(bounded_integers(json.loads(schema)))
    text = str(xgrammar.Grammar.from_json_schema(bounded, **(layout or JSON_LAYOUT)))
    # xgrammar writes U+0080-U+00FF as \xHH but reads back every hex digit after \x ("\xb0F", °F, became U+0B0F):
    # four digits read back as written
    text = re.sub(r"(?<!\\)((?:\\\\)*)\\x([0-9a-fA-F]{2})", r"\1\\u00\2", text)
    lines = []
    for line in text.splitlines():
        name = line.partition(" ::= ")[0]
        if name in FREE_NUMBER_DIGITS:
            line = line.replace(*FREE_NUMBER_DIGITS[name])
        lines.append(line)
    return "\n".join(lines)


def bounded_integers(schema: Any) -> Any:
    """A copy of `schema` with every integer's open ends bounded at +-SAFE_INTEGER: bounds it sets stay, and an
    end whose bound would cross the other end's (a minimum of 10^17) stays open."""
    bounded = copy.deepcopy(schema)

    def bound(node: Any) -> None:
        if isinstance(node, list):
            for part in node:
                bound(part)
            return
        if not isinstance(node, dict):
            return
        kind = node.get("type")
        if kind == "integer" or (isinstance(kind, list) and "integer" in kind):
            low, high = _number(node, "minimum", "exclusiveMinimum"), _number(node, "maximum", "exclusiveMaximum")
            if not {"minimum", "exclusiveMinimum"} & node.keys() and (high is None or high >= -SAFE_INTEGER):
                node["minimum"] = -SAFE_INTEGER
            if not {"maximum", "exclusiveMaximum"} & node.keys() and (low is None or low <= SAFE_INTEGER):
                node["maximum"] = SAFE_INTEGER
        for _, part in subschemas(node):
            bound(part)

    bound(bounded)
    return bounded


def _number(node: dict[str, Any], *keys: str) -> float | None:
    """The first of `keys` in `node` that holds a number (draft 4's exclusiveMinimum is a flag beside minimum)."""
    for key in keys:
        value = node.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
    return None


def _can_start(compiled: Any, vocab_size: int) -> bool:
    """Whether some token, or the end, may come first under `compiled`: a grammar that allows nothing would have
    its row commit a token it rejects (protocol.schemas refuses the schemas known to, this catches the rest)."""
    import xgrammar

    matcher = xgrammar.GrammarMatcher(compiled)
    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return matcher.is_terminated() or bool(bitmask.any())


NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


def _tool_call_tag(source: str) -> str:
    """xgrammar's structural tag for a forced tool call in the model's format (`source`: the format's xgrammar name,
    the tools, the choice: "required" or a function's name, and whether calls may be parallel)."""
    import xgrammar

    spec = json.loads(source)
    choice = spec["choice"]
    if choice != "required":
        choice = {"type": "function", "function": {"name": choice}}
    tools = [  # a function without parameters (or `{}`) takes none, as OpenAI reads it: its arguments are {}
        {**tool, "function": {**tool["function"], "parameters": tool["function"].get("parameters") or NO_ARGUMENTS}}
        for tool in spec["tools"]
    ]
    tag = xgrammar.get_model_structural_tag(
        spec["format"],
        tools=bounded_integers(tools),
        tool_choice=choice,
        reasoning="disabled",
        max_whitespace_cnt=JSON_WHITESPACE,
        parallel_tool_calls=spec["parallel"],
    )
    tag = _bounded_numbers(json.loads(tag.model_dump_json()))
    calls = tag["format"]
    if calls["type"] == "triggered_tags":  # (text may come first there; a forced reply opens with its call)
        tag["format"] = {
            "type": "tags_with_separator",
            "tags": calls["tags"],
            "separator": "\n",
            "at_least_one": True,
            "stop_after_first": calls["stop_after_first"],
        }
    return json.dumps(tag)


def _bounded_numbers(node: Any) -> Any:
    """A structural tag whose JSON arguments (a format's "json" style contents) are json_grammar's, so their free
    numbers end within FREE_NUMBER_DIGITS as a response_format's do (xgrammar compiles a schema content itself,
    numbers open). Other styles (XML parameters) stay as they are."""
    if isinstance(node, list):
        return [_bounded_numbers(part) for part in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and node.get("style") == "json" and isinstance(node["json_schema"], dict):
        layout = dict(any_whitespace=True, max_whitespace_cnt=node.get("max_whitespace_cnt"))
        grammar = json_grammar(json.dumps(node["json_schema"]), **layout, any_order=node.get("any_order", False))
        return {"type": "grammar", "grammar": grammar}
    return {key: _bounded_numbers(value) for key, value in node.items()}


class GrammarState:
    """One row's matcher and its bitmask buffer (a row per block position). `stop_ids` end the grammar (the
    row's own stop tokens; empty: the tokenizer's end of sequence)."""

    def __init__(self, compiled: Any, *, block_size: int, vocab_size: int, stop_ids: Sequence[int] = ()) -> None:
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(compiled, override_stop_tokens=list(stop_ids) or None)
        self.bitmask = xgrammar.allocate_token_bitmask(block_size, vocab_size)
        self.vocab_size = vocab_size

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def mask(self, logits: torch.Tensor, drafts: Sequence[int] = ()) -> None:
        """Mask `logits` [n, vocab] in place: row j with the grammar's state after drafts[:j] (n - 1 drafts). Rows
        past a draft the grammar rejects stay as they are: they cannot be committed."""
        import xgrammar

        filled = advanced = 0
        for j in range(logits.shape[0]):
            if j:
                # (a draft outside the previous position's mask is rejected here, before the matcher sees it)
                if not self._allows(j - 1, drafts[j - 1]) or not self.matcher.accept_token(drafts[j - 1]):
                    break
                advanced += 1
                if self.matcher.is_terminated():  # nothing follows the grammar's end
                    break
            self.matcher.fill_next_token_bitmask(self.bitmask, j)
            filled += 1
        self.matcher.rollback(advanced)
        bitmask = self.bitmask[:filled].to(logits.device, non_blocking=True)
        xgrammar.apply_token_bitmask_inplace(
            logits[:filled], bitmask, vocab_size=min(self.vocab_size, logits.shape[-1])
        )

    def draft(self, logits: torch.Tensor) -> torch.Tensor:
        """A drafter's proposal under the grammar: from its logits [k, vocab] for the k slots after the row's last
        committed token, slot j's most likely token the grammar allows after the proposal's slots before it. It
        only changes which drafts the target checks (speed), never what is committed."""
        import xgrammar

        tokens = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        advanced = 0
        for j in range(logits.shape[0]):
            self.matcher.fill_next_token_bitmask(self.bitmask, j)
            row = logits[j : j + 1]
            xgrammar.apply_token_bitmask_inplace(
                row, self.bitmask[j : j + 1].to(row.device), vocab_size=self.vocab_size
            )
            token = int(greedy_tokens(row))
            tokens[j:] = token
            if not self.matcher.accept_token(token):
                break
            advanced += 1
            if self.matcher.is_terminated():
                break
        self.matcher.rollback(advanced)
        return tokens

    def _allows(self, row: int, token: int) -> bool:
        return token < self.vocab_size and bool((int(self.bitmask[row, token // 32]) >> (token % 32)) & 1)

    def accept(self, ids: Sequence[int]) -> int:
        """Advance over committed `ids`; returns how many of them stand (up to the one that ends the grammar)."""
        for n, token in enumerate(ids):
            if self.matcher.is_terminated():
                return n
            if not self.matcher.accept_token(token):  # masking makes this unreachable; say so rather than drift
                raise RuntimeError(f"the grammar rejected committed token {token}")
        return len(ids)


def grammar_state(params: SamplingParams, tokenizer: Any, *, block_size: int, vocab_size: int) -> GrammarState | None:
    """The row's grammar state for `params.grammar` (None without one)."""
    if params.grammar is None:
        return None
    compiled = compile_grammar(params.grammar, tokenizer, vocab_size)
    return GrammarState(compiled, block_size=block_size, vocab_size=vocab_size, stop_ids=params.stop_token_ids)
