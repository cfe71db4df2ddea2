"""``NgramIndex.propose`` against the definition, written plainly here: the longest suffix
n-gram (n from max_match down to min_match) that also ends earlier, its latest earlier end,
and the up-to-k tokens from there. Small alphabets, so that matches, overlaps and loops are
common; the same index fed growing prefixes, or a list that does not extend the last one,
must answer as a fresh index does."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hicache_jax.speculative import ngram
from hicache_jax.speculative.ngram import NgramConfig, NgramIndex

SETTINGS = settings(max_examples=150, deadline=None)


def reference(tokens: list[int], k: int, config: NgramConfig) -> list[int]:
    """The definition, by brute force: every length, every earlier end, latest first."""
    if k <= 0:
        return []
    size = len(tokens)
    for n in range(config.max_match, config.min_match - 1, -1):
        suffix = tokens[size - n :]
        if n > size:
            continue
        for end in range(size - 1, n - 1, -1):  # an end at size would be the suffix itself
            if tokens[end - n : end] == suffix:
                return tokens[end : end + k]
    return []


@st.composite
def configs(draw) -> NgramConfig:
    lo = draw(st.integers(1, 4))
    return NgramConfig(min_match=lo, max_match=draw(st.integers(lo, 7)))


def token_lists(max_size: int = 60):
    alphabet = st.shared(st.integers(1, 4), key="alphabet")
    return alphabet.flatmap(lambda a: st.lists(st.integers(0, a - 1), max_size=max_size))


@SETTINGS
@given(config=configs(), tokens=token_lists(), k=st.integers(1, 9))
def test_can_follow_says_whether_some_next_token_gives_a_draft(config, tokens, k):
    """Over every next token the alphabet has, and one never seen: a draft follows one of
    them exactly when ``can_follow`` says so (it is what lets a step be planned ahead)."""
    index = NgramIndex(config)
    index.propose(tokens, 0)
    nexts = range(max(tokens, default=0) + 2)
    assert index.can_follow() == any(reference([*tokens, x], k, config) for x in nexts)


@SETTINGS
@given(config=configs(), tokens=token_lists(), k=st.integers(-2, 9))
def test_a_fresh_index_proposes_as_the_definition(config, tokens, k):
    assert NgramIndex(config).propose(tokens, k) == reference(tokens, k, config)


@SETTINGS
@given(
    config=configs(),
    tokens=token_lists(80),
    cuts=st.lists(st.integers(0, 80), max_size=12),
    ks=st.lists(st.integers(0, 9), min_size=12, max_size=12),
)
def test_an_index_fed_growing_prefixes_answers_as_a_fresh_one(config, tokens, cuts, ks):
    index = NgramIndex(config)
    for cut, k in zip(sorted(cuts) + [len(tokens)], ks):
        prefix = tokens[:cut]
        # A new list each call, as a caller that concatenates prompt and outputs passes.
        assert index.propose(list(prefix), k) == reference(prefix, k, config)
        assert index.propose(prefix, k) == NgramIndex(config).propose(prefix, k)


@SETTINGS
@given(
    config=configs(),
    first=token_lists(40),
    where=st.sampled_from(["shorter", "head", "tail"]),
    pick=st.integers(0, 10**6),
    grown=token_lists(20),
    k=st.integers(1, 9),
)
# A change that only the head, or only the tail, comparison sees.
@example(NgramConfig(1, 2), [0, 0, 1], "head", 0, [], 3)
@example(NgramConfig(1, 1), [0, 0, 0], "tail", 0, [], 1)
def test_a_list_that_does_not_extend_the_indexed_one_is_indexed_afresh(config, first, where, pick, grown, k):
    """Shorter, or different within the first or last max_match indexed tokens (what the
    index compares); then grown further."""
    index = NgramIndex(config)
    index.propose(first, k)
    if where == "shorter":
        if not first:
            return
        second = first[: pick % len(first)]
    else:
        if not first:
            return
        w = min(config.max_match, len(first))
        at = pick % w if where == "head" else len(first) - 1 - pick % w
        second = list(first)
        second[at] += 1  # differs from what was indexed there
        second += grown
    assert index.propose(second, k) == reference(second, k, config)
    # And it keeps growing incrementally from the new list.
    assert index.propose(second + grown, k) == reference(second + grown, k, config)


@given(config=configs(), tokens=token_lists())
@settings(max_examples=50, deadline=None)
def test_k_zero_or_negative_proposes_nothing_and_spoils_nothing(config, tokens):
    """And indexes: feeding a prompt in chunks with k = 0 leaves the index as one call would."""
    index = NgramIndex(config)
    for cut in range(0, len(tokens), 7):
        assert index.propose(tokens[:cut], 0) == []
    assert index.propose(tokens, -3) == []
    assert index.propose(tokens, 4) == reference(tokens, 4, config)


@given(config=configs(), tokens=token_lists(), k=st.integers(1, 9))
@settings(max_examples=50, deadline=None)
def test_numpy_tokens_propose_the_same_python_ints(config, tokens, k):
    got = NgramIndex(config).propose(np.asarray(tokens, dtype=np.int32), k)
    assert got == reference(tokens, k, config)
    assert all(type(t) is int for t in got)


def test_the_reference_agrees_with_the_example_vllm_documents():
    """vLLM's ``NgramProposer.propose`` docstring: [1,2,3,4,2,3], min 2, max 3, k 4 drafts
    [4,2,3] ([4,2,3] never occurred before; [2,3] did, and three tokens follow it)."""
    tokens, config = [1, 2, 3, 4, 2, 3], NgramConfig(min_match=2, max_match=3)
    assert reference(tokens, 4, config) == [4, 2, 3]
    assert NgramIndex(config).propose(tokens, 4) == [4, 2, 3]


def test_lengths_outside_the_bounds_are_not_matched():
    """A two-token repeat is too short for min_match 3; with max_match 2 a longer repeat is
    matched by its last two tokens only, so the latest pair wins over the longer match."""
    pair = [7, 8, 0, 7, 8]
    assert NgramIndex(NgramConfig(min_match=3, max_match=4)).propose(pair, 3) == []
    assert NgramIndex(NgramConfig(min_match=2, max_match=2)).propose(pair, 3) == [0, 7, 8]
    longer = [1, 2, 3, 9, 5, 2, 3, 6, 1, 2, 3]
    assert reference(longer, 2, NgramConfig(min_match=2, max_match=3)) == [9, 5]
    assert NgramIndex(NgramConfig(min_match=2, max_match=3)).propose(longer, 2) == [9, 5]
    assert NgramIndex(NgramConfig(min_match=2, max_match=2)).propose(longer, 2) == [6, 1]


class CountingTokens(Sequence[int]):
    """A token list that counts the elements read through it."""

    def __init__(self, tokens: list[int]):
        self.tokens, self.reads = tokens, 0

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i):
        got = self.tokens[i]
        self.reads += len(got) if isinstance(i, slice) else 1
        return got

    def __iter__(self):
        raise AssertionError("the index iterated over the whole token list")


def test_a_call_after_one_new_token_reads_only_what_is_new():
    config = NgramConfig()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, size=5_000).tolist()
    index = NgramIndex(config)
    first = CountingTokens(tokens)
    index.propose(first, 8)
    assert first.reads >= len(tokens)  # the counter sees a full read
    for step in range(20):
        tokens = tokens + [int(rng.integers(0, 50))]
        counting = CountingTokens(tokens)
        assert index.propose(counting, 8) == reference(tokens, 8, config)
        # One new token plus the first and last max_match tokens compared.
        assert counting.reads <= 1 + 2 * config.max_match, (step, counting.reads)


def test_a_call_after_one_new_token_hashes_only_the_new_ngrams(monkeypatch):
    """White-box: the index hashes each n-gram it records or looks up once, so hashes count
    its work. A call after one new token records at most one n-gram per length and looks up
    at most one per length, whatever the context length."""
    config = NgramConfig()
    lengths = config.max_match - config.min_match + 1
    calls = 0

    def counting_hash(value):
        nonlocal calls
        calls += 1
        return hash(value)

    monkeypatch.setattr(ngram, "hash", counting_hash, raising=False)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 50, size=5_000).tolist()
    index = NgramIndex(config)
    index.propose(tokens, 8)
    assert calls >= len(tokens)  # the counter sees the first full indexing
    for _ in range(20):
        tokens = tokens + [int(rng.integers(0, 50))]
        calls = 0
        index.propose(tokens, 8)
        assert calls <= 2 * lengths, calls


@given(config=configs(), tokens=token_lists(), k=st.integers(1, 9))
@settings(max_examples=100, deadline=None)
def test_hash_collisions_cost_drafts_never_make_wrong_ones(config, tokens, k):
    """Under a hash with three values every length's table collides all the time; a draft
    must still be what follows a real earlier occurrence of a suffix n-gram in bounds."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ngram, "hash", lambda gram: hash(gram) % 3, raising=False)
        got = NgramIndex(config).propose(tokens, k)
    size = len(tokens)
    genuine = [
        tokens[end : end + k]
        for n in range(config.min_match, config.max_match + 1)
        for end in range(n, size)
        if tokens[end - n : end] == tokens[size - n :]
    ]
    assert got == [] or got in genuine


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"min_match": 0}, "min_match"),
        ({"min_match": -1, "max_match": 3}, "min_match"),
        ({"min_match": 4, "max_match": 3}, "max_match"),
        ({"max_match": 0}, "max_match"),
        ({"min_match": 2.0}, "min_match"),
        ({"max_match": "12"}, "max_match"),
        ({"min_match": True}, "min_match"),
    ],
)
def test_a_bad_config_is_refused_naming_the_field(kwargs, field):
    with pytest.raises((ValueError, TypeError), match=rf"NgramConfig\.{field}="):
        NgramConfig(**kwargs)


def test_the_defaults_are_valid_and_frozen():
    config = NgramConfig()
    assert 1 <= config.min_match <= config.max_match
    with pytest.raises(AttributeError):
        config.min_match = 2  # type: ignore[misc]
