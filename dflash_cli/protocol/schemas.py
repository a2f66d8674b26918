"""The JSON schemas a request brings (response_format's json_schema, a tool's parameters), checked before it is
queued: torch-free, for every route's parser.

The grammar engine (engine.grammar) compiles a schema when the request is admitted; refused here, by the field
it came in: what the grammar would not enforce (`check_schema`), a schema no finite value matches (`{"$ref": "#"}`
and other reference cycles every value must go round again: decoding under it could never end), and tool
parameters that are not an object schema. A tool's parameters are held to the grammar's rules only where a grammar
follows them (a forced call): otherwise the model only reads them, as OpenAI's and Anthropic's models do, and an
agent's one odd tool (a `not`, a Unicode class in a pattern) must not refuse every turn.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from dflash_cli.errors import RequestError
from dflash_cli.protocol.params import show

# JSON schema keywords the grammar (xgrammar) would ignore without a word: refused by name, so a strict schema is
# either followed or refused
IGNORED_SCHEMA_KEYWORDS = frozenset(
    {"not", "if", "then", "else", "dependentSchemas", "dependentRequired", "unevaluatedProperties", "unevaluatedItems"}
)
SCHEMA_DATA = frozenset({"const", "enum", "default", "examples"})  # keywords whose values are data, not schemas
# keywords whose value maps names to schemas (a property may be called "if" or "default")
NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
OBJECT_KEYWORDS = ("properties", "required", "additionalProperties")
ARRAY_KEYWORDS = ("items", "prefixItems", "minItems")
SCHEMA_STEPS = 10_000  # schema nodes `admits_finite_value` visits before it leaves the question to the compiler
# How deep a walk into a schema may go, objects and lists inside one another and references followed (a property's
# schema is two in: its `properties` and itself; OpenAI allows 10 levels of properties): the checks here and the
# compiler recurse through them (a chain of 20,000 references crashed xgrammar's compiler)
SCHEMA_DEPTH = 128


def subschemas(node: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """What may hold schemas inside the schema object `node`, each with its path from it (`anyOf`,
    `properties.city`): a keyword's value (a schema, or a list such as anyOf's), and each schema of a map of
    names (properties, $defs: its names are not keywords); data (const, enum, default, examples) is left out."""
    for key, value in node.items():
        if key in SCHEMA_DATA:
            continue
        if key in NAMED_SCHEMAS and isinstance(value, dict):
            for name, schema in value.items():
                yield f"{key}.{name}", schema
        else:
            yield key, value


def check_schema(schema: Any, name: str) -> None:
    """Refuse what the grammar would not enforce: the keywords above, and a $ref outside the schema."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            check_schema(item, f"{name}[{i}]")
    elif isinstance(schema, dict):
        for key, value in schema.items():
            where = f"{name}.{key}"
            if key in IGNORED_SCHEMA_KEYWORDS:
                raise RequestError(f"{where}: the JSON schema keyword {key!r} is not supported", param=where)
            if key == "$ref" and not (isinstance(value, str) and value.startswith("#")):
                raise RequestError(f"{where}: only references inside the schema (#/...) are supported", param=where)
            named = key == "patternProperties" and isinstance(value, dict)
            patterns = [value] if key == "pattern" else list(value) if named else []
            for pattern, control in [(p, control_character(p)) for p in patterns if isinstance(p, str)]:
                if control is None:
                    continue
                raise RequestError(
                    f"{where}: {show(pattern)} matches the control character {control}, which "
                    "the grammar library would write unescaped in a JSON string (invalid JSON)",
                    param=where,
                    fix=r"leave control characters (\n, \t, \x00-\x1f) out of the pattern",
                )
        for path, value in subschemas(schema):
            check_schema(value, f"{name}.{path}")


CONTROL_ESCAPES = {"n": 0x0A, "r": 0x0D, "t": 0x09, "f": 0x0C, "v": 0x0B, "0": 0x00, "a": 0x07}


def control_character(pattern: str) -> str | None:
    """A control character (U+0000-U+001F) `pattern` names outside a negated class (`\\n`, `\\x0a`, `\\u000a`,
    `\\cJ`, one as is, a range from one), as U+XXXX; None: it names none. The grammar library writes what a
    pattern matches into a JSON string as is (`"` and `\\` escaped, control characters not), and its `.`, `\\s`
    and negated classes leave control characters out."""
    i, in_class, negated = 0, False, False
    while i < len(pattern):
        char, code = pattern[i], None
        if char == "\\" and i + 1 < len(pattern):
            escape, rest = pattern[i + 1], pattern[i + 2 :]
            if escape in CONTROL_ESCAPES or (escape == "b" and in_class):  # ([\b]: a backspace)
                code, i = CONTROL_ESCAPES.get(escape, 0x08), i + 2
            elif ord(escape) < 0x20:  # (a control character escaped is itself)
                code, i = ord(escape), i + 2
            elif escape == "x" and re.match(r"[0-9a-fA-F]{2}", rest):
                code, i = int(rest[:2], 16), i + 4
            elif escape == "u" and re.match(r"[0-9a-fA-F]{4}", rest):
                code, i = int(rest[:4], 16), i + 6
            elif escape == "c" and rest[:1].isascii() and rest[:1].isalpha():
                code, i = ord(rest[0].upper()) % 32, i + 3
            else:
                i += 2
                continue
        elif char == "[" and not in_class:
            in_class, negated = True, pattern[i + 1 : i + 2] == "^"
            i += 1 + negated
            continue
        elif char == "]" and in_class:
            in_class, i = False, i + 1
            continue
        else:
            code, i = ord(char), i + 1
        if code < 0x20 and not (in_class and negated):
            return f"U+{code:04X}"
    return None


class TooDeep(Exception):
    """A schema whose values lie deeper than SCHEMA_DEPTH schemas inside one another, references followed."""


def admits_finite_value(schema: Any) -> bool:
    """Whether some finite JSON value can match `schema`, as far as its structure goes: no value matches
    `{"$ref": "#"}`, nor an object whose required property is that object again (each value would hold another
    one). Decided as for a grammar's productive rules: a node admits a finite value when one of its alternatives
    does with every part it requires; a reference being resolved further up counts as none. Contradictions within
    one node (a minimum above the maximum, an empty enum) are left to the grammar compiler, which names them.
    Raises TooDeep past SCHEMA_DEPTH schemas inside one another, references followed (a chain of 20,000 $refs
    crashed the compiler)."""
    finite: set[int] = set()  # nodes known to admit a finite value (a "no" found inside a cycle may be a "yes")
    steps = [SCHEMA_STEPS]

    def admits(node: Any, resolving: frozenset[str], depth: int) -> bool:
        if not isinstance(node, dict):
            return node is not False  # true, or not a schema at all (the compiler's to refuse)
        if depth > SCHEMA_DEPTH:
            raise TooDeep
        if id(node) in finite:
            return True
        steps[0] -= 1
        if steps[0] < 0:
            return True  # too large to tell here: the compiler decides
        if _admits(node, resolving, depth + 1):
            finite.add(id(node))
            return True
        return False

    def _admits(node: Mapping[str, Any], resolving: frozenset[str], depth: int) -> bool:
        ref = node.get("$ref")
        if isinstance(ref, str):
            target = resolve(schema, ref)
            if ref in resolving or (target is not None and not admits(target, resolving | {ref}, depth)):
                return False
        for key in ("anyOf", "oneOf"):
            options = node.get(key)
            if isinstance(options, list) and options and not any(admits(o, resolving, depth) for o in options):
                return False
        options = node.get("allOf")
        if isinstance(options, list) and not all(admits(option, resolving, depth) for option in options):
            return False
        if "enum" in node or "const" in node:
            return True
        kind = node.get("type")
        kinds = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else [None]
        return any(_admits_as(node, kind, resolving, depth) for kind in kinds)

    def _admits_as(node: Mapping[str, Any], kind: Any, resolving: frozenset[str], depth: int) -> bool:
        if kind == "object" or (kind is None and any(key in node for key in OBJECT_KEYWORDS)):
            properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
            required = node.get("required") if isinstance(node.get("required"), list) else []
            rest = node.get("additionalProperties", True)
            for key in required:
                if isinstance(key, str) and not admits(properties.get(key, rest), resolving, depth):
                    return False
        if kind == "array" or (kind is None and any(key in node for key in ARRAY_KEYWORDS)):
            least = node.get("minItems", 0)
            first = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
            if isinstance(least, int) and least > 0:
                if not all(admits(item, resolving, depth) for item in first[:least]):
                    return False
                if least > len(first) and not admits(node.get("items", True), resolving, depth):
                    return False
        return True

    return admits(schema, frozenset(), 0)


def resolve(schema: Any, ref: str) -> Any:
    """What a reference inside `schema` (`#`, `#/$defs/name`) points at; None: nothing."""
    node: Any = schema
    for part in ref.removeprefix("#").removeprefix("/").split("/") if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def schema_depth(schema: Any) -> int:
    """The longest walk into `schema` without going round a cycle: objects and lists inside one another, and
    references followed (a compiler converting it recurses as deep). Linear in the schema's size, without
    recursion; counting stops past SCHEMA_DEPTH."""
    depth: dict[int, int] = {}  # the nodes measured
    walking: set[int] = set()  # the nodes on the walk now (a reference back to one is a cycle: not deeper)
    stack: list[tuple[Any, bool]] = [(schema, False)]
    while stack:
        node, measured = stack.pop()
        if not isinstance(node, (dict, list)) or (not measured and (id(node) in depth or id(node) in walking)):
            continue
        inside = list(node.values() if isinstance(node, dict) else node)
        if isinstance(node, dict) and isinstance(node.get("$ref"), str):
            inside.append(resolve(schema, node["$ref"]))
        if not measured:
            walking.add(id(node))
            stack += [(node, True), *((item, False) for item in inside)]
            continue
        walking.discard(id(node))
        depth[id(node)] = 1 + max((depth.get(id(item), 0) for item in inside), default=0)
        if depth[id(node)] > SCHEMA_DEPTH:
            break
    return max(depth.values(), default=0)


def read_schema(value: Any, name: str) -> dict[str, Any]:
    """A JSON schema object from a request, checked (see the module docstring); RequestError names `name`."""
    if not isinstance(value, dict):
        raise RequestError(f"{name} must be a JSON schema object, got {show(value)}", param=name)
    if schema_depth(value) > SCHEMA_DEPTH:
        raise _too_deep(name)
    check_schema(value, name)
    try:
        finite = admits_finite_value(value)
    except TooDeep:
        raise _too_deep(name) from None
    if not finite:
        raise RequestError(
            f'{name} admits no finite JSON value: it refers to itself (a "$ref" cycle) with no way out, so no '
            "output could ever be complete",
            param=name,
        )
    return value


def read_parameters(value: Any, name: str) -> dict[str, Any]:
    """A tool's parameters: an object schema (OpenAI's rule: the arguments are a JSON object), its `properties`
    an object of schemas and `required` a list of their names; `{}` for a tool without arguments. What a grammar
    needs more is read_schema's, for the tools a forced call may call."""
    if not isinstance(value, dict):
        raise RequestError(f'{name} must be a JSON schema of "type": "object", got {show(value)}', param=name)
    if value and value.get("type") != "object":
        raise RequestError(
            f'{name} must be a JSON schema of "type": "object" (the arguments are an object), got "type": '
            f"{show(value.get('type'))}",
            param=f"{name}.type",
        )
    properties = value.get("properties", {})
    if not isinstance(properties, dict) or not all(isinstance(p, (dict, bool)) for p in properties.values()):
        where = f"{name}.properties"
        raise RequestError(
            f"{where} must be an object of schemas (one per argument), got {show(properties)}", param=where
        )
    required = value.get("required", [])
    if not isinstance(required, list) or not all(isinstance(key, str) for key in required):
        where = f"{name}.required"
        raise RequestError(f"{where} must be a list of argument names, got {show(required)}", param=where)
    if schema_depth(value) > SCHEMA_DEPTH:
        raise _too_deep(name)
    return value


def _too_deep(name: str) -> RequestError:
    return RequestError(f"{name} nests schemas more than {SCHEMA_DEPTH} deep (references followed)", param=name)
