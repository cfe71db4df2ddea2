"""The theoretical maximum (trie over pages, one pass over send and first-token events)
against a brute-force recompute that compares every pair of sequences token by token and
checks each candidate end with its own reading of the rule."""

from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_jax.bench.theoretical import SeqRecord, capacity_max, theoretical_max
from hicache_jax.cache.prefix import PrefixRules
from tests.cache_rules import classic_rules

RULES = [  # (has_full, sliding_window, has_state)
    (True, None, False),
    (True, 3, False),
    (False, 5, False),
    (True, None, True),
    (True, 1, True),
]


def kept(rules: PrefixRules, chunk: int, s: SeqRecord, j: int, kind: str) -> bool:
    P, L, T = rules.page_size, len(s.prompt), len(s.prompt) + len(s.output)
    if kind == "swa":  # prompt pages, and the window before the last page boundary
        end = T // P * P
        return j <= L // P or j >= max(0, end - rules.window + 1) // P
    if kind == "state":  # a snapshot at token (j+1)P
        t = (j + 1) * P
        return (t % chunk == 0 and t <= L) or t in ((L - 1) // P * P, L, T // P * P)
    return True


def brute(records, rules, chunk, visible_at, seen=(), views=None):
    """``views(i)``: the sequences request ``i`` may hit (default: those sent by
    ``visible_at(r)``, whole)."""
    P = rules.page_size
    out = []
    for i, r in enumerate(records):
        if views is not None:
            vis = list(seen) + views(i)
        else:
            vis = list(seen) + [s for k, s in enumerate(records) if k != i and s.sent <= visible_at(r)]

        def holds(j, kind, r=r, vis=vis):
            n = (j + 1) * P
            return any(
                len(s.prompt + s.output) >= n
                and (s.prompt + s.output)[:n] == r.prompt[:n]
                and kept(rules, chunk, s, j, kind)
                for s in vis
            )

        best = 0
        for e in range(P, (len(r.prompt) - 1) // P * P + 1, P):
            ok = all(holds(j, "seen") for j in range(e // P))
            if rules.snapshot:
                ok = ok and holds(e // P - 1, "state")
            if rules.window:
                first = max(0, e - rules.window + 1) // P
                ok = ok and all(holds(j, "swa") for j in range(first, (e - 1) // P + 1))
            if ok:
                best = e
        out.append(best)
    return out


@st.composite
def runs(draw):
    P = draw(st.sampled_from([2, 4]))
    full, window, mamba = draw(st.sampled_from(RULES))
    rules = classic_rules(P, full, window, mamba)
    chunk = P * draw(st.sampled_from([1, 2]))
    token = st.integers(0, 1)
    bases = draw(st.lists(st.lists(token, min_size=16, max_size=16), min_size=1, max_size=3))
    records, t = [], 0.0
    for _ in range(draw(st.integers(1, 7))):
        base = draw(st.sampled_from(bases))
        prompt = base[: draw(st.integers(0, 16))] + draw(st.lists(token, max_size=6))
        prompt = prompt or [0]
        t += draw(st.sampled_from([0.1, 0.5, 1.0, 2.0]))
        out = draw(st.lists(token, max_size=6))
        records.append(SeqRecord(tuple(prompt), tuple(out), sent=t))
    seen = [records.pop(0)] if len(records) > 1 and draw(st.booleans()) else []
    return rules, chunk, records, seen, draw(st.sampled_from([0.0, 0.5, 3.0]))


@settings(max_examples=100, deadline=None)
@given(runs())
def test_theoretical_max_matches_brute_force(run):
    rules, chunk, records, seen, reorder = run
    got = theoretical_max(records, rules, chunk, seen=seen, reorder_s=reorder)
    assert got == brute(records, rules, chunk, lambda r: r.sent + reorder, seen)
    assert all(g <= len(r.prompt) - 1 for g, r in zip(got, records))
    # Unlimited capacity in send order: only requests sent strictly before count.
    in_order = capacity_max(records, rules, chunk, None, seen=seen)
    assert in_order == brute(records, rules, chunk, lambda r: r.sent - 1e-9, seen)
    assert all(a <= b for a, b in zip(in_order, got))
    # A bounded LRU holds a subset of what the unbounded one holds.
    for cap in (0, 1, 3):
        assert all(a <= b for a, b in zip(capacity_max(records, rules, chunk, cap, seen=seen), in_order))
    assert capacity_max(records, rules, chunk, 0) == [0] * len(records)


@settings(max_examples=100, deadline=None)
@given(runs(), st.data())
def test_capacity_max_replays_the_run_as_it_happened(run, data):
    """With first-token and finish times a request looks up just before its first token and
    sees the prompts of requests that had their first token before, and the whole sequences
    of those that had finished."""
    rules, chunk, records, seen, _ = run
    delay = st.sampled_from([0.0, 0.3, 1.0, 4.0])
    timed = []
    for r in records:
        prompt = r.prompt
        if timed and data.draw(st.booleans()):  # a later turn: an earlier sequence and more
            before = data.draw(st.sampled_from(timed))
            prompt = before.prompt + before.output + prompt[: data.draw(st.integers(1, 4))]
        first = r.sent + data.draw(delay)
        timed.append(SeqRecord(prompt, r.output, r.sent, first, first + data.draw(delay)))

    def views(i):
        me = timed[i].prefilled
        out = []
        for k, s in enumerate(timed):
            if k != i and s.done < me:
                out.append(s)
            elif k != i and s.prefilled < me:
                out.append(SeqRecord(s.prompt, ()))
        return out

    got = capacity_max(timed, rules, chunk, None, seen=seen)
    assert got == brute(timed, rules, chunk, None, seen, views=views)
    for cap in (0, 1, 3):
        assert all(a <= b for a, b in zip(capacity_max(timed, rules, chunk, cap, seen=seen), got))
    # The maximum counts whatever was sent before a request's first token (its prefix was
    # matched before it), so no order of admission, this replay's included, passes it.
    best = theoretical_max(timed, rules, chunk, seen=seen)
    assert best == brute(timed, rules, chunk, lambda r: r.prefilled, seen)
    assert all(a <= b for a, b in zip(got, best))


def test_a_request_admitted_after_a_later_one_is_served_by_it():
    """The bench smoke test's request over its maximum (L1+L2+L3, multi-turn): A is sent
    first but waits for its L3 prefetch; B, sent 0.2 s later, is admitted and computes the
    shared system prompt, which A then hits. The engine does this (a held first probe, same
    sizes: A cached 32, B 0); a maximum that counted only sequences sent before A (and
    50 ms after) gave A 0."""
    rules = classic_rules(16)
    system = tuple(range(3, 35))  # two pages
    a = SeqRecord(system + tuple(range(100, 148)), (7, 8), sent=0.0, prefilled=0.9, done=1.0)
    b = SeqRecord(system + tuple(range(200, 248)), (7, 8), sent=0.2, prefilled=0.4, done=0.5)
    assert capacity_max([a, b], rules, 16, None) == [32, 0]  # as it happened
    assert theoretical_max([a, b], rules, 16) == [32, 32]
    # Without timings only the send order is known: within 50 ms either may go first.
    untimed = [SeqRecord(r.prompt, r.output, r.sent) for r in (a, b)]
    assert theoretical_max(untimed, rules, 16) == [0, 32]
