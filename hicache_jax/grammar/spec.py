"""What a request constrains its output to, and its llguidance grammar.

The sources are SGLang's sampling params (``json_schema``, ``regex``, ``ebnf``,
``structural_tag``); the OpenAI routes map ``response_format`` onto ``json_schema``. At most
one may be set. A spec is its (kind, text) pair: the grammar cache's key.

JSON is generated compact and OpenAI-shaped (``{"a": 1, "b": [2, 3]}``): llguidance's
default allows any run of whitespace between tokens, which a model may fill forever
(random weights do: 200 newlines between two keys). A schema's own ``x-guidance`` options
override this, as llguidance documents.
"""

from __future__ import annotations

import dataclasses
import enum
import json

from hicache_jax.sampling_params import InvalidRequest

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_GRAMMAR_BYTES = 512 << 10  # a grammar's text (schema, regex, EBNF, tags): refused past it, uncompiled
MAX_JSON_DEPTH = 64  # nesting of a schema's (or a structural tag's) JSON


class GrammarKind(enum.StrEnum):
    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    EBNF = "ebnf"
    STRUCTURAL_TAG = "structural_tag"


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    kind: GrammarKind
    text: str

    def grammar(self) -> str:
        """The llguidance grammar (not yet checked: ``GrammarCompiler`` validates it).
        InvalidRequest when the text itself is malformed (JSON that does not parse, nested
        past ``MAX_JSON_DEPTH``) or larger than ``MAX_GRAMMAR_BYTES``."""
        import llguidance

        field = f"sampling_params.{self.kind.value}"
        size = len(self.text.encode("utf-8", "surrogatepass"))
        if size > MAX_GRAMMAR_BYTES:
            raise InvalidRequest(f"{field}: {size} bytes; at most {MAX_GRAMMAR_BYTES}")
        match self.kind:
            case GrammarKind.JSON_SCHEMA:
                schema = _json(self.text, "json_schema")
                if schema is True:  # the schema that allows any value
                    schema = {}
                if schema is False:
                    raise InvalidRequest(f"{field}: the schema false allows no value")
                if not isinstance(schema, dict):
                    raise InvalidRequest(f"{field}: must be a JSON object")
                try:
                    return llguidance.LLMatcher.grammar_from_json_schema(
                        json.dumps(schema), defaults=JSON_OPTIONS
                    )
                except ValueError as e:  # llguidance's own checks of the schema
                    raise InvalidRequest(f"{field}: {_first_line(str(e))}") from None
            case GrammarKind.REGEX:
                try:
                    return llguidance.LLMatcher.grammar_from_regex(self.text)
                except ValueError as e:
                    raise InvalidRequest(f"{field}: {_first_line(str(e))}") from None
            case GrammarKind.EBNF:
                try:
                    return llguidance.grammar_from("ebnf", self.text)
                except Exception as e:  # the GBNF converter raises its own error types
                    raise InvalidRequest(f"sampling_params.ebnf: {e}") from e
            case GrammarKind.STRUCTURAL_TAG:
                return structural_tag_grammar(self.text)
        raise AssertionError(self.kind)


def spec_of(sp) -> GrammarSpec | None:
    """The spec of a ``SamplingParams`` (None: unconstrained)."""
    set_ = [(k, getattr(sp, k.value)) for k in GrammarKind if getattr(sp, k.value) is not None]
    if not set_:
        return None
    return GrammarSpec(*set_[0])


def structural_tag_grammar(text: str) -> str:
    """SGLang's ``structural_tag``: ``{"structures": [{"begin", "schema", "end"}],
    "triggers": [...]}``. Free text, in which a trigger starts one of the structures whose
    ``begin`` starts with it; its body follows ``schema``, then ``end``."""
    import llguidance

    field = "sampling_params.structural_tag"
    tag = _json(text, "structural_tag")
    structures = tag.get("structures") if isinstance(tag, dict) else None
    triggers = tag.get("triggers") if isinstance(tag, dict) else None
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list) or not triggers:
        raise InvalidRequest(f"{field}: needs non-empty 'structures' and 'triggers' lists")
    if not all(isinstance(t, str) and t for t in triggers):
        raise InvalidRequest(f"{field}.triggers: must be non-empty strings")
    tags = []
    for i, s in enumerate(structures):
        if (
            not isinstance(s, dict)
            or not isinstance(s.get("begin"), str)
            or not isinstance(s.get("end"), str)
        ):
            raise InvalidRequest(f"{field}.structures[{i}]: needs string 'begin' and 'end' and a 'schema'")
        schema = s.get("schema", {})
        if not isinstance(schema, dict):
            raise InvalidRequest(f"{field}.structures[{i}].schema: must be a JSON object")
        if not isinstance(schema.get("x-guidance", {}), dict):
            raise InvalidRequest(f"{field}.structures[{i}].schema.x-guidance: must be a JSON object")
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise InvalidRequest(f"{field}.structures[{i}]: begin {s['begin']!r} starts with no trigger")
        grammar = {**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}
        tags.append(llguidance.StructTag(trigger=trigger, begin=s["begin"], grammar=grammar, end=s["end"]))
    try:
        return llguidance.StructTag.to_grammar(tags)
    except (ValueError, TypeError) as e:
        raise InvalidRequest(f"{field}: {_first_line(str(e))}") from None


def _json(text: str, field: str):
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, TypeError) as e:
        raise InvalidRequest(f"sampling_params.{field}: not valid JSON ({e})") from e
    except RecursionError:
        value = _TOO_DEEP  # nested deeper than Python's parser goes: certainly past the limit
    if value is _TOO_DEEP or json_depth(value) > MAX_JSON_DEPTH:
        raise InvalidRequest(f"sampling_params.{field}: nested more than {MAX_JSON_DEPTH} levels deep")
    return value


_TOO_DEEP = object()


def json_depth(value) -> int:
    """How deeply a parsed JSON value nests (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            deepest = max(deepest, d)
            continue
        deepest = max(deepest, d + 1)
        stack.extend((x, d + 1) for x in v)
    return deepest


def _first_line(message: str) -> str:
    lines = message.strip().splitlines()
    return lines[0] if lines else message
