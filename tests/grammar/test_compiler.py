"""Grammar specs compiled by llguidance against the model's tokenizer: compiled once per
spec, a fresh matcher per request, ids past the tokenizer never allowed, structural tags
enforced inside their tags only, errors that name the field."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import hicache_jax
from hicache_jax.grammar.compiler import GrammarCompiler
from hicache_jax.grammar.constraint import Constraint, fill_masks
from hicache_jax.grammar.spec import GrammarKind, GrammarSpec
from hicache_jax.models.tokenizer import Tokenizer
from hicache_jax.sampling_params import InvalidRequest

TOKENIZER = Tokenizer(os.path.join(os.path.dirname(hicache_jax.__file__), "assets", "tiny_tokenizer.json"))
EOS = 2


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(TOKENIZER, TOKENIZER.vocab_size + 100, [EOS])  # padded vocabulary


def allowed_ids(c: GrammarCompiler, constraint: Constraint) -> np.ndarray:
    mask = np.zeros((1, -(-c.vocab_size // 32)), np.int32)
    fill_masks([(constraint, 0)], mask)
    t = np.arange(c.vocab_size)
    return t[(mask.view(np.uint32)[0, t // 32] >> (t % 32).astype(np.uint32)) & 1 == 1]


def feed(constraint: Constraint, text: str):
    """Take ``text``'s tokens until the grammar ends; the finish reason, if it did (then the
    text's remaining tokens are not taken)."""
    for tok in TOKENIZER.encode(text, add_special_tokens=False):
        reason = constraint.accept(tok)
        if reason is not None:
            return reason
    return None


def test_compiled_once_per_spec(compiler):
    spec = GrammarSpec(GrammarKind.REGEX, "[a-c]{3}")
    before = dict(compiler.stats)
    a, b = Constraint(compiler.matcher(spec)), Constraint(compiler.matcher(spec))
    assert compiler.stats["grammar_compiles"] == before["grammar_compiles"] + 1
    assert compiler.stats["grammar_cache_hits"] == before["grammar_cache_hits"] + 1
    feed(a, "ab")  # matchers are independent copies
    assert set(allowed_ids(compiler, b)) != set(allowed_ids(compiler, a))


def test_padded_ids_and_eos(compiler):
    c = Constraint(compiler.matcher(GrammarSpec(GrammarKind.REGEX, "a+")))
    ids = allowed_ids(compiler, c)
    assert ids.max() < TOKENIZER.vocab_size and EOS not in ids  # nothing yet: "a" must come
    feed(c, "aa")
    ids = allowed_ids(compiler, c)
    assert EOS in ids and ids.max() < TOKENIZER.vocab_size
    assert all(set(TOKENIZER.decode([int(t)])) <= {"a"} for t in ids if t != EOS)


def test_closed_json_stops_without_eos(compiler):
    schema = {
        "type": "object",
        "properties": {"k": {"enum": [1, 2]}},
        "required": ["k"],
        "additionalProperties": False,
    }
    c = Constraint(compiler.matcher(GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema))))
    assert feed(c, '{"k": 2}') == {"type": "stop", "matched": None}


def test_structural_tag_enforced_inside_tags_only(compiler):
    body = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
    }
    tag = {"structures": [{"begin": "<f=a>", "schema": body, "end": "</f>"}], "triggers": ["<f="]}
    spec = GrammarSpec(GrammarKind.STRUCTURAL_TAG, json.dumps(tag))
    ok = Constraint(compiler.matcher(spec))
    assert feed(ok, 'free text {"x": 1} then <f=a>{"n": 7}</f> and more') is None
    assert not ok.matcher.is_error()
    bad = Constraint(compiler.matcher(spec))
    reason = feed(bad, 'text <f=a>{"n": 17}')
    assert reason is not None and reason["message"].startswith("grammar dead end"), reason


@pytest.mark.parametrize(
    "kind, text, named",
    [
        (GrammarKind.JSON_SCHEMA, "[1, 2]", "json_schema: must be a JSON object"),
        (GrammarKind.JSON_SCHEMA, '{"type": "nope"}', "json_schema: invalid grammar"),
        (GrammarKind.REGEX, "a{2,1}", "regex: invalid grammar"),
        (GrammarKind.EBNF, "root ::= missing", "ebnf"),
        (
            GrammarKind.STRUCTURAL_TAG,
            '{"structures": [{"begin": "x", "end": "y"}], "triggers": ["<"]}',
            "no trigger",
        ),
    ],
)
def test_errors_name_the_field(compiler, kind, text, named):
    with pytest.raises(InvalidRequest, match=named):
        compiler.compile(GrammarSpec(kind, text))


def test_no_tokenizer_is_a_clear_error():
    c = GrammarCompiler(Tokenizer(None), 512, [EOS])
    with pytest.raises(InvalidRequest, match="no tokenizer"):
        c.compile(GrammarSpec(GrammarKind.REGEX, "a"))
