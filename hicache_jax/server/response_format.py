"""OpenAI's ``response_format`` (and SGLang's ``structural_tag`` form of it) as SGLang
sampling params: the grammar the output is held to (``hicache_jax/grammar``).

- ``{"type": "text"}``: nothing;
- ``{"type": "json_object"}``: any JSON object (``json_schema`` ``{"type": "object"}``);
- ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``:
  that schema. The grammar always holds the output to it; ``strict`` changes nothing here;
- ``{"type": "structural_tag", "structures": [...], "triggers": [...]}`` (SGLang's).
"""

from __future__ import annotations

import json

from hicache_jax.sampling_params import InvalidRequest, show

FIELD = "response_format"
JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}


def grammar_params(rf: dict | None) -> dict:
    """SGLang sampling params for ``response_format`` ``rf`` (None: none)."""
    if rf is None:
        return {}
    if not isinstance(rf, dict):
        raise InvalidRequest(f"{FIELD} must be an object, got {show(rf)}")
    kind = rf.get("type")
    if not isinstance(kind, str) or kind not in _ALLOWED:
        raise InvalidRequest(f"{FIELD}.type must be one of {sorted(_ALLOWED)}, got {show(kind)}")
    extra = sorted(set(rf) - {"type", *_ALLOWED[kind]})
    if extra:
        raise InvalidRequest(f"{FIELD}: unknown field(s) {extra} for type {kind!r}")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": json.dumps({"type": "object"})}
    if kind == "structural_tag":
        return {"structural_tag": json.dumps({k: v for k, v in rf.items() if k != "type"})}
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequest(f"{FIELD}.json_schema must be an object with a 'schema', got {show(spec)}")
    unknown = sorted(set(spec) - JSON_SCHEMA_KEYS)
    if unknown:
        raise InvalidRequest(
            f"{FIELD}.json_schema: unknown field(s) {unknown}; known: {sorted(JSON_SCHEMA_KEYS)}"
        )
    schema = spec.get("schema", {})  # OpenAI: absent means any JSON
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequest(f"{FIELD}.json_schema.schema must be a JSON object, got {show(schema)}")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise InvalidRequest(f"{FIELD}.json_schema.strict must be true or false")
    return {"json_schema": json.dumps(schema)}


_ALLOWED = {
    "text": (),
    "json_object": (),
    "json_schema": ("json_schema",),
    "structural_tag": ("structures", "triggers"),
}
