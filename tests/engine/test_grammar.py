"""Constrained decoding under speculation is exactly constrained plain decoding.

A tiny float32 Qwen3 with the real byte-level tokenizer, a JSON schema: greedy rows with every drafter format (and an
oracle drafter that drafts the constrained answer right for a varying number of slots, so blocks are accepted in
part) equal the same loop without a drafter, alone and in a batch beside unconstrained rows; every output parses
and validates; at temperature > 0 the first tokens' frequencies match the target's masked distribution
(chi-square), computed here from the model's own logits and the grammar's masks.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import jsonschema
import pytest
import torch
import xgrammar
from scipy.stats import chisquare

from dflash_cli.engine import Batch, SamplingParams, collect, generate
from dflash_cli.engine.grammar import SAFE_INTEGER, bounded_integers, compile_grammar
from dflash_cli.errors import RequestError
from dflash_cli.protocol.params import Grammar
from helpers.drafters import FORMATS, OracleDrafter, random_drafter
from helpers.tiny_models import build_tiny, tiny_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "tag": {"enum": ["red", "green", "blue"]},
        "name": {"type": "string", "pattern": "^[a-z ]{1,8}$"},
    },
    "required": ["ok", "n", "tag", "name"],
    "additionalProperties": False,
}
GRAMMAR = Grammar("json_schema", json.dumps(SCHEMA))
PROMPTS = ["Hello! How can I help", "The quick brown fox", "def add(a, b):"]


@functools.cache
def tokenizer():
    return tiny_tokenizer()


@functools.cache
def target(seed: int = 1):
    model = build_tiny("qwen3", seed=seed)
    with torch.no_grad():  # sharper than random init: varied text, few near-ties
        model.get_output_embeddings().weight.mul_(4)
    return model


def params(grammar: Grammar | None = GRAMMAR, **changes) -> SamplingParams:
    return SamplingParams(
        **{"max_new_tokens": 80, "stop_token_ids": (tokenizer().eos_token_id,), "grammar": grammar, **changes}
    )


def decode(drafter, prompt: str, sampling: SamplingParams, block_size: int | None = None):
    ids = tokenizer()(prompt)["input_ids"]
    return collect(generate(target(), drafter, ids, sampling, tokenizer=tokenizer(), block_size=block_size))


def test_plain_constrained_output_is_complete_json_that_validates() -> None:
    for prompt in PROMPTS:
        result = decode(None, prompt, params())
        assert result.finish_reason == "stop"
        jsonschema.validate(json.loads(result.text), SCHEMA)
        unconstrained = decode(None, prompt, params(grammar=None, max_new_tokens=20))
        assert not unconstrained.text.startswith("{")  # the grammar, not the model, made it JSON


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_greedy_with_each_drafter_format_equals_constrained_plain(fmt: str, block_size: int) -> None:
    drafter = random_drafter(target(), seed=block_size, block_size=block_size, fmt=fmt, window=3)
    for prompt in PROMPTS:
        plain = decode(None, prompt, params())
        spec = decode(drafter, prompt, params())
        assert spec.token_ids == plain.token_ids and spec.finish_reason == plain.finish_reason
        jsonschema.validate(json.loads(spec.text), SCHEMA)


@pytest.mark.parametrize("correct", [None, [0, 1, 3, 7, 2], [5, 0]])
def test_partly_accepted_blocks_roll_the_grammar_back(correct) -> None:
    """An oracle drafts the constrained answer right for `correct` slots, then a wrong token (often one the grammar
    rejects): acceptance varies, and the matcher advances over drafts and rolls back over the rejected ones."""
    for prompt in PROMPTS:
        ids = tokenizer()(prompt)["input_ids"]
        plain = decode(None, prompt, params())
        drafter = OracleDrafter(target(), ids + plain.token_ids, block_size=8, correct=correct)
        spec = decode(drafter, prompt, params())
        assert spec.token_ids == plain.token_ids and spec.finish_reason == "stop"
        if correct is None:
            assert max(spec.acceptance_lengths) == 8  # whole blocks stood: the drafts went through the matcher


@pytest.mark.parametrize("fmt", FORMATS)
def test_batched_rows_with_and_without_grammars_equal_each_alone(fmt: str) -> None:
    drafter = random_drafter(target(), seed=3, block_size=4, fmt=fmt, window=3)
    requests = [(p, params()) for p in PROMPTS] + [(PROMPTS[0], params(grammar=None, max_new_tokens=30))]
    requests.append((PROMPTS[1], params(grammar=Grammar("json"), max_new_tokens=40)))
    alone = [decode(drafter, p, sampling).token_ids for p, sampling in requests]
    batch = Batch(target(), drafter, rows=3, tokenizer=tokenizer())
    got: dict[int, list[int]] = {i: [] for i in range(len(requests))}
    try:
        for i, (prompt, sampling) in enumerate(requests):
            batch.add(tokenizer()(prompt)["input_ids"], sampling, key=i)
        while not batch.idle:
            for row, event in batch.step():
                assert not isinstance(event, BaseException), event
                got[row.key] += event.token_ids
    finally:
        batch.close()
    assert [got[i] for i in range(len(requests))] == alone
    assert isinstance(json.loads(tokenizer().decode(got[4], skip_special_tokens=True)), dict)


def _masked_probs(ids: list[int], matcher, temperature: float) -> torch.Tensor:
    bitmask = xgrammar.allocate_token_bitmask(1, target().config.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    with torch.no_grad():
        logits = target()(torch.tensor([ids])).logits[0, -1:].float()
    xgrammar.apply_token_bitmask_inplace(logits, bitmask)
    return torch.softmax(logits[0] / temperature, dim=-1)


@pytest.mark.slow
def test_sampling_under_a_grammar_has_the_targets_masked_distribution() -> None:
    """Chi-square on the first two tokens under `"n": integer` style output: frequencies from speculative sampling
    (one seed per run) against the exact masked distribution from the model's logits."""
    schema = {"type": "integer"}
    grammar = Grammar("json_schema", json.dumps(schema))
    prompt = tokenizer()("What is 2 + 2? The answer is")["input_ids"]
    temperature, runs = 1.5, 600
    compiled = compile_grammar(grammar, tokenizer(), target().config.vocab_size)
    exact: dict[tuple[int, int], float] = {}
    first = _masked_probs(prompt, xgrammar.GrammarMatcher(compiled), temperature)
    for a in torch.nonzero(first).flatten().tolist():
        matcher = xgrammar.GrammarMatcher(compiled, override_stop_tokens=[tokenizer().eos_token_id])
        assert matcher.accept_token(a)
        second = _masked_probs(prompt + [a], matcher, temperature)
        for b in torch.nonzero(second).flatten().tolist():
            exact[(a, b)] = first[a].item() * second[b].item()
    drafter = random_drafter(target(), seed=0, block_size=4)
    counts: dict[tuple[int, int], int] = {}
    for seed in range(runs):
        sampling = params(grammar, temperature=temperature, seed=seed, max_new_tokens=2)
        pair = tuple(collect(generate(target(), drafter, prompt, sampling, tokenizer=tokenizer())).token_ids)
        assert pair in exact, pair  # a pair the masks allow
        counts[pair] = counts.get(pair, 0) + 1
    # categories with >= 5 expected draws, the rest pooled
    keys = sorted(exact, key=exact.get, reverse=True)
    big = [k for k in keys if exact[k] * runs >= 5]
    observed = [counts.get(k, 0) for k in big] + [runs - sum(counts.get(k, 0) for k in big)]
    expected = [exact[k] * runs for k in big] + [runs * (1 - sum(exact[k] for k in big))]
    assert len(big) >= 4
    assert chisquare(observed, expected).pvalue > 0.001


def test_a_schema_the_grammar_library_rejects_names_the_field() -> None:
    bad = Grammar("json_schema", '{"type": "object", "properties": {"a": {"type": "strnig"}}}', "response_format")
    with pytest.raises(RequestError) as caught:
        compile_grammar(bad, tokenizer(), target().config.vocab_size)
    assert caught.value.param == "response_format"


def test_integers_without_bounds_end_within_jsons_safe_range() -> None:
    """An integer a schema leaves unbounded takes at most JSON's safe range (the demo wrote "age": 1000000000...
    until max_tokens, and no closing brace), in a response_format and in a forced call's arguments; bounds a
    schema sets stay, and data under const, enum or default is not read as a schema."""
    vocab = target().config.vocab_size
    schema = {"type": "object", "properties": {"age": {"type": "integer"}, "n": {"type": ["integer", "null"]}}}
    compiled = compile_grammar(Grammar("json_schema", json.dumps(schema)), tokenizer(), vocab)
    assert xgrammar.GrammarMatcher(compiled).accept_string('{"age": -9007199254740991, "n": 9007199254740991}')
    assert not xgrammar.GrammarMatcher(compiled).accept_string('{"age": 90071992547409910')
    assert not xgrammar.GrammarMatcher(compiled).accept_string('{"age": 1, "n": 9007199254740992')
    wide = {"type": "integer", "minimum": 0, "maximum": 10**17}
    compiled = compile_grammar(Grammar("json_schema", json.dumps(wide)), tokenizer(), vocab)
    assert xgrammar.GrammarMatcher(compiled).accept_string("99999999999999999")
    huge = {"type": "integer", "minimum": 10**17}  # (a maximum of 2^53-1 would cross it: that end stays open)
    assert bounded_integers(huge) == huge
    compile_grammar(Grammar("json_schema", json.dumps(huge)), tokenizer(), vocab)
    data = {"const": {"type": "integer"}, "default": [{"type": "integer"}]}
    assert bounded_integers(data) == data
    named = {"type": "object", "properties": {"default": {"type": "integer"}}, "$defs": {"enum": {"type": "integer"}}}
    assert bounded_integers(named)["properties"]["default"]["maximum"] == SAFE_INTEGER  # a name, not a keyword
    assert bounded_integers(named)["$defs"]["enum"]["minimum"] == -SAFE_INTEGER
    from dflash_cli.protocol.tools import FORMATS

    count = {"type": "object", "properties": {"count": {"type": "integer"}}, "required": ["count"]}
    tool = {"type": "function", "function": {"name": "repeat", "parameters": count}}
    spec = {"format": FORMATS["hermes"].grammar, "tools": [tool], "choice": "required", "parallel": False}
    compiled = compile_grammar(Grammar("tool_calls", json.dumps(spec), "tool_choice"), tokenizer(), vocab)
    call = '<tool_call>\n{"name": "repeat", "arguments": {"count": 12345678901234567'
    assert xgrammar.GrammarMatcher(compiled).accept_string(call[:-1])
    assert not xgrammar.GrammarMatcher(compiled).accept_string(call)


def test_numbers_no_schema_bounds_end_within_16_digits() -> None:
    """json_object's values and "type": "number" take at most 16 digits before the point, 16 after it and 3 in
    the exponent (a small model may write digits until max_tokens); everything else JSON allows stays."""
    vocab = target().config.vocab_size
    number = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    for grammar in (Grammar("json"), Grammar("json_schema", json.dumps(number))):
        compiled = compile_grammar(grammar, tokenizer(), vocab)

        def accepts(text: str) -> bool:
            return xgrammar.GrammarMatcher(compiled).accept_string(text)  # noqa: B023 (used at once)

        assert accepts('{"x": -9999999999999999.1234567890123456e-123}') and accepts('{"x": 0.5E+3}')
        assert not accepts('{"x": 12345678901234567') and not accepts('{"x": 1.12345678901234567')
        assert not accepts('{"x": 1e1234')
        if grammar.kind == "json":
            assert accepts('{"a": [1, {"b": null}, "c\\"", true], "d": {}}')
            assert not accepts('{"a": [12345678901234567')
    from dflash_cli.protocol.tools import FORMATS

    # a forced call's arguments alike (xgrammar compiles a tag's schema with its numbers open)
    tool = {"type": "function", "function": {"name": "scale", "parameters": number}}
    spec = {"format": FORMATS["hermes"].grammar, "tools": [tool], "choice": "required", "parallel": False}
    compiled = compile_grammar(Grammar("tool_calls", json.dumps(spec), "tool_choice"), tokenizer(), vocab)
    call = '<tool_call>\n{"name": "scale", "arguments": {"x": '
    for good in ("1.5}}\n</tool_call>", "-0.1234567890123456e-12}}", "2E+3 }}"):
        assert xgrammar.GrammarMatcher(compiled).accept_string(call + good), good
    for bad in ("1.12345678901234567", "12345678901234567", "1e1234", "1.5,"):
        assert not xgrammar.GrammarMatcher(compiled).accept_string(call + bad), bad


def test_the_bounded_json_grammar_takes_what_the_schema_allows() -> None:
    """json_grammar round-trips xgrammar's grammar of a schema through its text: escapes, patterns, formats,
    references and Unicode names accept and refuse as the schema compiled directly does."""
    cases = [
        ({"type": "string", "pattern": "^[a-zé\"'\\\\]{1,8}$"}, ['"éa\\""', '"\\\\"'], ['"é_a"', '""']),
        ({"type": "string", "pattern": "^[\\u00e9a-z]+\\d$"}, ['"éa1"'], ['"é_1"', '"1"']),
        (
            {"type": "object", "properties": {'é😀"\\': {"enum": ['a"b', "😀"]}}, "required": ['é😀"\\']},
            ['{"é😀\\"\\\\": "😀"}', '{"é😀\\"\\\\": "a\\"b"}'],
            ['{"é😀\\"\\\\": "b"}'],
        ),
        ({"type": "string", "pattern": "^(?:[a-z]+|\\.\\*\\[\\])$"}, ['"abc"', '".*[]"'], ['"a.b"']),
        ({"type": "string", "format": "date-time"}, ['"2026-11-29T10:00:00Z"'], ['"tomorrow"']),
        # U+0080-U+00FF before a hex digit (xgrammar writes \xHH and reads back every hex digit after \x)
        ({"enum": ["°F", "é1", "a\\xb0"]}, ['"°F"', '"é1"', '"a\\\\xb0"'], ['"°"', '"a°"']),
        ({"type": "object", "properties": {"größe": {"type": "integer"}}, "required": ["größe"]}, ['{"größe": 1}'], []),
        ({"type": "string", "pattern": "^[éf]+$"}, ['"éfé"'], ['"e"']),
        (
            {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"},
            ['{"c": {"c": {}}}'],
            ['{"c": 1}'],
        ),  # fmt: skip
    ]
    vocab = target().config.vocab_size
    for schema, good, bad in cases:
        ours = compile_grammar(Grammar("json_schema", json.dumps(schema)), tokenizer(), vocab)
        direct = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tokenizer(), vocab_size=vocab))
        theirs = direct.compile_json_schema(json.dumps(schema), any_whitespace=False)
        for text in [*good, *bad]:
            expected = text in good
            for compiled in (ours, theirs):
                matcher = xgrammar.GrammarMatcher(compiled)
                assert (matcher.accept_string(text) and matcher.is_completed()) == expected, (schema, text)


def test_a_grammar_that_allows_no_first_token_is_refused_by_its_field() -> None:
    """Compiled past the schema checks (protocol.schemas refuses this one first), a grammar under which no token
    may come first is refused when it is compiled, at admission: a row under it would commit a token it rejects
    ("the grammar rejected committed token 0")."""
    empty = Grammar("json_schema", '{"anyOf": [{"$ref": "#"}]}', field="body.response_format.json_schema.schema")
    with pytest.raises(RequestError, match="no token may start its output") as caught:
        compile_grammar(empty, tokenizer(), target().config.vocab_size)
    assert caught.value.param == "body.response_format.json_schema.schema"
    compile_grammar(
        Grammar("json_schema", '{"anyOf": [{"$ref": "#"}, {"type": "null"}]}'), tokenizer(), target().config.vocab_size
    )


def test_drafts_chosen_under_the_grammar_stand_more_often_and_change_nothing() -> None:
    """The drafter's proposal is picked under the row's grammar: the same tokens come out, more drafts stand."""
    from dflash_cli.engine.drafter import DFlashDrafter

    class Unconstrained(DFlashDrafter):
        def propose(self, *args, constraints=None, **kwargs):
            return super().propose(*args, **kwargs)

    drafter = random_drafter(target(), seed=5, block_size=8)
    plain = Unconstrained(drafter.config, target()).eval()
    plain.load_state_dict(drafter.state_dict())
    taus = []
    for proposer in (plain, drafter):
        results = [decode(proposer, prompt, params()) for prompt in PROMPTS]
        taus.append(sum(len(r.token_ids) for r in results) / sum(len(r.acceptance_lengths) for r in results))
        assert [r.token_ids for r in results] == [decode(None, p, params()).token_ids for p in PROMPTS]
    assert taus[1] > taus[0] + 0.5, taus


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "gemma4", "gpt_oss"])
def test_other_families_constrained_greedy_equals_plain(family: str) -> None:
    """Hybrid (linear-attention state rolled back per row), sliding-window and MoE targets: the masks sit before
    sampling, whatever the target state does with the rejected slots."""
    model = build_tiny(family, seed=2)
    drafter = random_drafter(model, seed=1, block_size=4)
    ids = tokenizer()(PROMPTS[0])["input_ids"]
    plain = collect(generate(model, None, ids, params(), tokenizer=tokenizer()))
    spec = collect(generate(model, drafter, ids, params(), tokenizer=tokenizer()))
    assert spec.token_ids == plain.token_ids
    if plain.finish_reason == "stop":
        jsonschema.validate(json.loads(plain.text), SCHEMA)


FORCED_REPLIES = {  # a forced call in each format, as the grammar shapes it (and as the family's template writes it)
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "harmony": '<|channel|>commentary to=functions.get_weather<|constrain|>json<|message|>{"city": "Paris"}<|call|>',
}


@pytest.mark.parametrize("fmt", sorted(FORCED_REPLIES))
def test_a_forced_call_is_what_the_format_parses(fmt: str) -> None:
    """The grammar for tool_choice "required" (xgrammar's structural tag for the family) accepts the family's call
    text and nothing before it, and that text parses back into the call: grammar and parser agree on the format."""
    from dflash_cli.protocol.tools import FORMATS, Tools, parse_reply

    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
    spec = {"format": FORMATS[fmt].grammar, "tools": [tool], "choice": "required", "parallel": False}
    compiled = compile_grammar(
        Grammar("tool_calls", json.dumps(spec), "tool_choice"), tokenizer(), target().config.vocab_size
    )
    matcher = xgrammar.GrammarMatcher(compiled)
    assert matcher.accept_string(FORCED_REPLIES[fmt])
    if fmt != "harmony":  # (harmony's reply may open with an analysis message)
        assert not xgrammar.GrammarMatcher(compiled).accept_string("Sure! " + FORCED_REPLIES[fmt])
    content, (call,) = parse_reply(FORCED_REPLIES[fmt], Tools((tool,)), fmt)
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"} and not content


@pytest.mark.parametrize("parameters", [None, {}])
def test_a_forced_call_of_a_function_without_parameters_takes_no_arguments(parameters: Any) -> None:
    """OpenAI reads a function without `parameters` (or with `{}`) as taking none: its forced call's arguments are
    `{}`, not any JSON (an array, or made-up keys)."""
    from dflash_cli.protocol.tools import FORMATS

    function = {"name": "ping"} if parameters is None else {"name": "ping", "parameters": parameters}
    spec = {
        "format": FORMATS["hermes"].grammar,
        "tools": [{"type": "function", "function": function}],
        "choice": "required",
    }
    compiled = compile_grammar(
        Grammar("tool_calls", json.dumps({**spec, "parallel": False}), "tool_choice"),
        tokenizer(),
        target().config.vocab_size,
    )
    call = '<tool_call>\n{"name": "ping", "arguments": %s}\n</tool_call>'
    assert xgrammar.GrammarMatcher(compiled).accept_string(call % "{}")
    for arguments in ('[1, "world"]', '{"name": "ping"}', '"x"'):
        assert not xgrammar.GrammarMatcher(compiled).accept_string(call % arguments), arguments


def _schemas():
    from hypothesis import strategies as st

    leaf = st.sampled_from(
        [
            {"type": "boolean"},
            {"type": "integer", "minimum": -5, "maximum": 50},
            {"enum": ["red", "green", 3, None]},
            {"type": "string", "pattern": "^[a-z]{1,5}$"},
            {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
            {"type": "null"},
        ]
    )

    def objects(children):
        return st.dictionaries(st.sampled_from(["a", "b", "c", "key"]), children, min_size=1, max_size=3).map(
            lambda properties: {
                "type": "object",
                "properties": properties,
                "required": sorted(properties),
                "additionalProperties": False,
            }
        )

    return objects(st.recursive(leaf, objects, max_leaves=4))


@pytest.mark.slow
def test_any_small_schema_speculative_equals_plain_and_validates() -> None:
    """Random schemas (nested objects, enums, bounded integers, patterns, arrays): speculation gives the plain
    constrained tokens, and a reply that ends is valid JSON that validates."""
    from hypothesis import HealthCheck, given, settings

    drafter = random_drafter(target(), seed=7, block_size=4, fmt="swa")

    @settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
    @given(schema=_schemas())
    def check(schema: dict) -> None:
        sampling = params(Grammar("json_schema", json.dumps(schema)), max_new_tokens=120)
        plain = decode(None, PROMPTS[1], sampling)
        spec = decode(drafter, PROMPTS[1], sampling)
        assert spec.token_ids == plain.token_ids
        if plain.finish_reason == "stop":
            jsonschema.validate(json.loads(plain.text), schema)

    check()
