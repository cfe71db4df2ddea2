"""At temperature 1, speculative decoding samples from the distribution decoding without it
samples from (issue 44's acceptance): a chi-square two-sample test on the joint distribution
of three output tokens, runs with disjoint seeds (so the test sees distributions, not the
per-seed equality ``test_speculative.py`` checks), a 4-token effective vocabulary (top-k 4),
without and with repetition and presence penalties.

The drafter proposes, after each first token, the second token the run without speculation
sampled most often there, so about 40% of drafts are accepted, and both paths of the verify
step (the token sampled after an accepted draft token, and the replacement of a rejected
one) decide many samples. The same test run against a verify step with a classic off-by-one
must reject: a draft position's token read from its neighbour's logits row, or (with
penalties) a draft token's check penalised for that token itself. The sample is large
enough to tell."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest
from scipy import stats

from hicache_jax.config import EngineConfig
from hicache_jax.engine.engine import Engine
from hicache_jax.runtime.batch_builder import BatchBuilder

PROMPT = [5, 17, 99]
NEW = 3  # the first token from the prefill step; a verify step feeds it and one draft token
WAVE = 64  # requests run together: one prefill step, then one verify step for all of them
WAVES = 12
N = WAVE * WAVES  # samples per run
ALPHA = 1e-3
SAMPLING = dict(temperature=1.0, top_k=4, max_new_tokens=NEW, ignore_eos=True)
# With penalties a drafted row is penalised for the draft tokens before it, on device.
PENALTIES = {"none": {}, "penalties": dict(repetition_penalty=1.2, presence_penalty=0.2)}


def engine(spec: bool) -> Engine:
    extra = dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4) if spec else {}
    return Engine(
        EngineConfig(
            preset="tiny",
            page_size=16,
            chunked_prefill_size=WAVE * len(PROMPT),  # a wave's prompts in one prefill step
            max_running_requests=WAVE,
            max_total_tokens=4 * WAVE * 16,
            dtype="float32",
            **extra,
        )
    )


def sample(engine: Engine, seeds: range, penalties: str) -> list[tuple[int, ...]]:
    """The output tokens of one request per seed, ``WAVE`` requests at a time (so every step
    after a wave's prefill is all-decode and may verify)."""
    out = []
    for w in range(0, len(seeds), WAVE):
        rids = [
            engine.add_request(
                input_ids=PROMPT, sampling_params=dict(SAMPLING, seed=s, **PENALTIES[penalties])
            )
            for s in seeds[w : w + WAVE]
        ]
        while engine.has_unfinished():
            engine.step()
        out += [tuple(engine.pop_output(r)["output_ids"]) for r in rids]
    return out


class Likeliest:
    """Drafts the continuation sampled most often after the request's output so far in a
    reference sample (nothing when that prefix never occurred)."""

    def __init__(self, reference: list[tuple[int, ...]]):
        counts = collections.defaultdict(collections.Counter)
        for seq in reference:
            for n in range(len(seq)):
                counts[seq[:n]][seq[n]] += 1
        self.next = {prefix: c.most_common(1)[0][0] for prefix, c in counts.items()}

    def __call__(self, req, k: int) -> list[int]:
        req.drafter_state = "likeliest"
        seq, draft = tuple(req.output_ids), []
        while len(draft) < k and seq in self.next:
            draft.append(self.next[seq])
            seq += (draft[-1],)
        return draft


def chi_square_p(a: list, b: list) -> float:
    """The p-value of a chi-square test that samples ``a`` and ``b`` come from one
    distribution; outcomes expected fewer than 5 times in either are pooled."""
    ca, cb = collections.Counter(a), collections.Counter(b)
    keys = sorted(set(ca) | set(cb))
    share = len(a) / (len(a) + len(b))
    common = [k for k in keys if min(share, 1 - share) * (ca[k] + cb[k]) >= 5]
    rare = [k for k in keys if k not in common]
    table = [[ca[k] for k in common], [cb[k] for k in common]]
    if rare:
        table[0].append(sum(ca[k] for k in rare))
        table[1].append(sum(cb[k] for k in rare))
    return float(stats.chi2_contingency(np.array(table)).pvalue)


@pytest.fixture(scope="module")
def plain():
    """``plain(penalties)``: N samples without speculation (seeds 0..N-1), made once."""
    made = {}

    def get(penalties: str) -> list[tuple[int, ...]]:
        if penalties not in made:
            out = sample(engine(False), range(N), penalties)
            assert len({s[0] for s in out}) == 4 and len(set(out)) > 20, collections.Counter(out)
            made[penalties] = out
        return made[penalties]

    return get


def speculative(plain: list, penalties: str) -> tuple[list[tuple[int, ...]], dict]:
    """N samples with speculation, seeds N..2N-1 (none shared with ``plain``)."""
    e = engine(True)
    e.drafter = Likeliest(plain)
    return sample(e, range(N, 2 * N), penalties), e.stats


@pytest.mark.parametrize("penalties", PENALTIES)
def test_speculative_samples_follow_the_distribution_without_speculation(plain, penalties):
    plain = plain(penalties)
    got, st = speculative(plain, penalties)
    assert st["spec_verifications"] == N  # every request verified one draft token
    accepted = st["spec_accepted_tokens"] / st["spec_draft_tokens"]
    assert 0.25 < accepted < 0.75, st  # both of the verify step's paths decide many samples
    p = chi_square_p(plain, got)
    assert p > ALPHA, p


def break_verify(monkeypatch, edit) -> None:
    """Make ``BatchBuilder.build`` hand verify steps ``edit(inputs, plan)``: the same
    inputs but for one array, the ``StepInputs`` of a broken builder."""
    build = BatchBuilder.build

    def broken(self, plan, *args, **kwargs):
        inputs = build(self, plan, *args, **kwargs)
        return edit(inputs, plan) if inputs.shape.verify else inputs

    monkeypatch.setattr(BatchBuilder, "build", broken)


def off_by_one(shift: int):
    """Verify steps that sample the token after draft token j (rows 1..k of an item with a
    k-token draft) from the logits row before it (``shift`` -1: the distribution before
    that draft token), or draft token j's own check (rows 0..k-1) from the row after it
    (``shift`` +1: a distribution that already saw the token it checks)."""

    def edit(inputs, plan):
        rows = np.array(inputs.sampling.last_rows)
        for row0, item in zip(inputs.sample_rows, plan.items):
            k = len(item.draft)
            moved = slice(row0 + 1, row0 + 1 + k) if shift < 0 else slice(row0, row0 + k)
            rows[moved] += shift
        return dataclasses.replace(inputs, sampling=dataclasses.replace(inputs.sampling, last_rows=rows))

    return edit


@pytest.mark.parametrize("shift", [-1, 1])
def test_an_off_by_one_verify_step_fails_the_test(plain, monkeypatch, shift):
    plain = plain("none")
    break_verify(monkeypatch, off_by_one(shift))
    got, st = speculative(plain, "none")
    assert st["spec_accepted_tokens"] > N // 5, st
    p = chi_square_p(plain, got)
    assert p < ALPHA, p


def counts_its_own_draft_token(inputs, plan):
    """Verify steps that penalise draft token j's check (row j) for draft tokens 0..j, itself
    included, not 0..j-1."""
    ids = np.array(inputs.penalty.draft_ids)
    for row0, item in zip(inputs.sample_rows, plan.items):
        for j, tok in enumerate(item.draft):
            ids[row0 + j, j] = tok
    return dataclasses.replace(inputs, penalty=dataclasses.replace(inputs.penalty, draft_ids=ids))


def test_penalising_a_draft_token_off_by_one_fails_the_test(plain, monkeypatch):
    plain = plain("penalties")
    break_verify(monkeypatch, counts_its_own_draft_token)
    got, st = speculative(plain, "penalties")
    assert st["spec_draft_tokens"] == N, st
    p = chi_square_p(plain, got)
    assert p < ALPHA, p
