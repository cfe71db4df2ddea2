"""usable_prefix_end: the one rule for how long a cached prefix may be."""

import pytest

from hicache_jax.cache.prefix import usable_prefix_end
from tests.cache_rules import classic_rules

P = 16
T, F = True, False


def rules(full=True, window=None, mamba=False):
    return classic_rules(P, full, window, mamba)


def end(r, input_len, full=(), swa=(), mamba=(), lsl=-1):
    held = {"full": list(full), "swa": list(swa), "state": list(mamba)}
    return usable_prefix_end(r, input_len, lsl, {k: held[k] for k in r.kinds})


def test_caps_at_input_minus_one_floored_to_page():
    r = rules()
    assert end(r, 64, full=[T] * 4) == 48  # 63 -> 48: one token must be computed
    assert end(r, 65, full=[T] * 4) == 64
    assert end(r, 65, full=[T] * 4, lsl=40) == 32  # input logprobs from 40 need rows >= 40
    assert end(r, 1, full=[T]) == 0


def test_full_attention_needs_every_page():
    assert end(rules(), 100, full=[T, T, F, T, T]) == 32


def test_sliding_window_needs_only_the_window():
    r = rules(full=False, window=20)
    # end 64 reads 45..63: pages 2 and 3; pages 0 and 1 may be gone
    assert end(r, 100, swa=[F, F, T, T]) == 64
    assert end(r, 100, swa=[F, F, F, T]) == 0  # 48 needs 29..47 (pages 1, 2); 32 needs 13..31
    assert end(r, 100, swa=[T, T, F, T]) == 32
    # a window of 1 reads nothing before the end
    assert end(rules(full=False, window=1), 100, swa=[F, F, F]) == 48


@pytest.mark.parametrize(
    "window, needed_from", [(16, 3), (17, 3), (18, 2), (33, 2), (34, 1), (49, 1), (50, 0)]
)
def test_window_not_a_page_multiple(window, needed_from):
    r = rules(full=False, window=window)
    swa = [j >= needed_from for j in range(4)]
    assert end(r, 100, swa=swa) == 64
    if needed_from:
        swa[needed_from] = False
        assert end(r, 100, swa=swa) < 64


def test_mamba_ends_only_at_snapshots():
    r = rules(mamba=True)
    assert end(r, 100, full=[T] * 6, mamba=[F, T, F, F, T, F]) == 80
    assert end(r, 70, full=[T] * 6, mamba=[F, T, F, F, T, F]) == 32  # cap 64 -> last snapshot 32


def test_hybrid_takes_every_kind_at_once():
    r = rules(full=True, window=20, mamba=True)
    full, swa, mamba = [T] * 6, [T, T, T, F, T, T], [F, T, F, T, T, F]
    # 80: snapshot ok, window pages 3-4: page 3 missing. 64: window pages 2-3: missing. 32: ok.
    assert end(r, 200, full=full, swa=swa, mamba=mamba) == 32


def test_availability_shorter_than_prompt():
    assert end(rules(), 1000, full=[T, T]) == 32
    assert end(rules(full=False, window=20), 1000, swa=[T]) == 16


# Any set of cache kinds, DeepSeek V4's included: the rule against its definition, by brute force.

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from hicache_jax.cache.prefix import PrefixRules  # noqa: E402
from hicache_jax.kinds import RETENTION, CacheKind, Retention  # noqa: E402

DSV4 = (
    CacheKind.SWA,
    CacheKind.INDEX,
    CacheKind.CSA,
    CacheKind.HCA,
    CacheKind.CSA_STATE,
    CacheKind.HCA_STATE,
)
PAGED_KINDS = tuple(k for k in CacheKind if RETENTION[k] is not Retention.SNAPSHOT)


def defined_end(kinds, window, input_len, lsl, held) -> int:
    """The longest page-aligned end e <= the cap such that every page before e of an
    every-page kind is held, and every page holding one of tokens e - window + 1 .. e - 1 of
    a window kind (a compressor's state page: the last one before e); and no kind's
    availability list ends before e (it lists only the pages some tier holds)."""
    cap = min(input_len - 1, lsl if lsl >= 0 else input_len)
    for e in range(max(cap, 0) // P * P, 0, -P):
        ok = True
        for kind in kinds:
            h = held[kind]
            if RETENTION[kind] is Retention.EVERY:
                need = range(e // P)
            else:
                need = {t // P for t in range(max(0, e - window + 1), e)}
            ok &= e // P <= len(h) and all(h[j] for j in need)
        if ok:
            return e
    return 0


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    kinds=st.one_of(
        st.just(DSV4), st.lists(st.sampled_from(PAGED_KINDS), min_size=1, unique=True).map(tuple)
    ),
    window=st.integers(1, 80),
    input_len=st.integers(1, 160),
    lsl=st.integers(-1, 160),
)
def test_any_paged_kinds_end_where_the_definition_says(data, kinds, window, input_len, lsl):
    rules = PrefixRules(page_size=P, kinds=kinds, window=window)
    pages = st.lists(st.booleans(), max_size=input_len // P + 1)
    held = {k: data.draw(pages, label=str(k)) for k in kinds}
    assert usable_prefix_end(rules, input_len, lsl, held) == defined_end(kinds, window, input_len, lsl, held)
    # The state page a V4 prefix needs (the page before its end) is among its window's pages
    # (a window of 2 tokens or more: ModelConfig refuses a V4 model with less).
    e = usable_prefix_end(rules, input_len, lsl, held)
    for kind in set(kinds) & {CacheKind.CSA_STATE, CacheKind.HCA_STATE}:
        assert e == 0 or window < 2 or held[kind][e // P - 1]
