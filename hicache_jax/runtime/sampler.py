"""Sampling and logprobs on device, for a whole batch in one jitted call.

Each sequence row carries its own settings; a row's random key is
``fold_in(PRNGKey(seed), number of tokens it has generated)``, so a request produces the
same tokens whether it runs alone, in a crowd, or after being retracted and resumed.
Logprobs are those of the model's raw distribution (``log_softmax(logits)``), as SGLang
reports them, whatever temperature or filters the sampling uses.

Tokens are chosen without sorting the vocabulary, and are the same tokens for the same keys
as the definition in ``sampler_reference.py``, whose cuts search the whole vocabulary (the
tests hold the two together):

- Greedy rows (temperature < 1e-5) take the argmax of the logits (penalised, when a row has
  a penalty: ``sample``'s ``penalty``). A batch of greedy rows only runs nothing else
  (``lax.cond``).
- Every other row divides by its temperature and reads its top-k and top-p cut off its
  C + 1 largest values (``lax.top_k``; C = ``CANDIDATES``, at most V - 1). Together the two
  cuts are one threshold: ``x < thr`` is masked, then min-p and the draw run on the whole
  [V] vector with the reference's own code, O(V) each. The same filtered vector and the same
  key give the same ``categorical`` draw, ``argmax(x + gumbel(key, [V]))``: the Gumbel noise
  covers the whole vocabulary, as in the reference.
- Rows with neither top-k (-1, or >= V) nor top-p (1) need no candidates: pure temperature
  and min-p-only sampling need no cut.
- The C + 1 values settle a row's cut exactly when
    * top_k is off or in 1..C;
    * top-p, when on, stops inside the candidates: always with top_k in 1..C; with top_k
      off, when the C largest probabilities sum to at least top_p;
    * no value tied with the top-k cut (top-k off: the top-p cut) lies outside the
      candidates (value C + 1 is below it);
    * no live candidate's cumulative probability is within ``TOP_P_MARGIN`` of top_p. The
      bounded sums differ from the reference's whole-vocabulary ones by float32 rounding
      only, so a row that close might cut one token apart.
  Any other row (top_k in C+1..V-1, a flat distribution under top-p, a tie at the cut)
  gets the reference's cuts, for that row alone (a ``while_loop`` over the flagged
  rows, behind a ``lax.cond``): it costs what every row cost before.
- Vocabularies under ``REFERENCE_BELOW`` (8 C) draw with the reference as it is (behind the same
  all-greedy ``lax.cond``): there the reference is cheap, and the bounded program takes about
  twice as long to compile (the tests' tiny models would pay that on every step shape).
- On TPU, ``lax.approx_max_k`` would be a cheaper candidate step, but it may miss values,
  so value C + 1 no longer bounds the rest and the checks above say nothing; swap it in
  only where approximate top-k/top-p is acceptable.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hicache_jax.runtime import penalties
from hicache_jax.runtime import sampler_reference as reference

CANDIDATES = 256  # C: top-k up to C and top-p nuclei of up to C tokens skip the reference
TOP_P_MARGIN = 4e-6  # a cumulative probability this close to top_p sends the row to it
REFERENCE_BELOW = 8 * CANDIDATES  # smaller vocabularies use the reference: cheap, half the compile
ROW_BLOCK = 64  # logits rows whose float32 log-softmax is live at once (``_row_logprobs``)


@dataclasses.dataclass(frozen=True)
class SamplingInputs:
    last_rows: jax.Array  # [S] int32: logits row of each sequence's last token
    temperature: jax.Array  # [S] float32 (0: greedy)
    top_p: jax.Array  # [S] float32
    top_k: jax.Array  # [S] int32 (-1: off)
    min_p: jax.Array  # [S] float32
    seeds: jax.Array  # [S] uint32
    counters: jax.Array  # [S] int32: tokens generated so far
    targets: jax.Array  # [R] int32: token whose logprob each row reports (-1: none)
    # Structured output (``hicache_jax/grammar``): a row's allowed tokens as a bitmask (bit
    # t % 32 of word t // 32) and whether the row is constrained at all. None: no masking.
    allowed: jax.Array | None = None  # [S, ceil(V / 32)] int32
    constrained: jax.Array | None = None  # [S] bool


jax.tree_util.register_dataclass(
    SamplingInputs,
    data_fields=[f.name for f in dataclasses.fields(SamplingInputs)],
    meta_fields=[],
)


@dataclasses.dataclass(frozen=True)
class SamplingOutputs:
    next_ids: jax.Array  # [S] int32
    next_logprobs: jax.Array  # [S] float32
    next_top_ids: jax.Array  # [S, K]
    next_top_logprobs: jax.Array  # [S, K]
    target_logprobs: jax.Array  # [R] float32
    row_top_ids: jax.Array  # [R, K]
    row_top_logprobs: jax.Array  # [R, K]
    drafts: jax.Array | None = None  # [S, k] int32: the step's MTP drafts (``mtp_drafts.py``)


jax.tree_util.register_dataclass(
    SamplingOutputs,
    data_fields=[f.name for f in dataclasses.fields(SamplingOutputs)],
    meta_fields=[],
)


def row_keys(s: SamplingInputs) -> jax.Array:
    """[S] keys: ``fold_in(PRNGKey(seed), tokens generated so far)`` per row."""
    return jax.vmap(lambda seed, n: jax.random.fold_in(jax.random.PRNGKey(seed), n))(s.seeds, s.counters)


def _threshold(x: jax.Array, s: SamplingInputs, c: int) -> tuple[jax.Array, jax.Array]:
    """x [S, V] tempered logits -> (thr [S], full [S]): the reference's top-k and
    top-p cut (mask ``x < thr``) read off the c + 1 largest values, and whether the row is
    one the candidates cannot settle (see the module docstring)."""
    V = x.shape[-1]
    vals = jax.lax.top_k(x, c + 1)[0]  # [S, c+1] descending; vals[:, c] bounds the rest
    # XLA:CPU folds a slice of top_k's values into a slice of a full sort (30x slower at
    # V = 32000); the barrier keeps TopK whole.
    vals = jax.lax.optimization_barrier(vals)
    m = vals[:, :1]
    k_on = (s.top_k > 0) & (s.top_k < V)
    k_in = k_on & (s.top_k <= c)
    kth = jnp.take_along_axis(vals, jnp.clip(s.top_k - 1, 0, c)[:, None], axis=-1)[:, 0]
    kth = jnp.where(k_in, kth, -jnp.inf)
    live = vals >= kth[:, None]  # [S, c+1]
    e = jnp.where(live, jnp.exp(vals - m), 0.0)
    # top-p normaliser: the top-k survivors, or with top-k off the whole vocabulary (O(V)).
    z = jnp.where(k_in, e[:, :c].sum(-1), jnp.exp(x - m).sum(-1))
    p = e / z[:, None]
    before = jnp.cumsum(p, axis=-1) - p  # as the reference computes it (a matmul: 3x the error)
    p_on = s.top_p < 1
    keep = before < s.top_p[:, None]
    last = c - jnp.argmax(keep[:, ::-1], axis=-1)  # last kept candidate
    p_thr = jnp.where(p_on, jnp.take_along_axis(vals, last[:, None], axis=-1)[:, 0], -jnp.inf)
    thr = jnp.maximum(kth, p_thr)
    # A value tied with the top-k cut outside the candidates would change the kept set and
    # the top-p normaliser; with top-k off, one tied with the top-p cut, the kept set.
    tie_at = jnp.where(k_in, kth, thr)
    full = (
        (k_on & ~k_in)  # top-k past the candidates
        | (p_on & ~k_in & keep[:, c])  # top-p wants more mass than the candidates hold
        | ((tie_at > -jnp.inf) & (vals[:, c] >= tie_at))  # ties past the candidates
        | (p_on & (live & (jnp.abs(before - s.top_p[:, None]) < TOP_P_MARGIN)).any(-1))
    )
    return thr, full


def _reference_rows(logits_s: jax.Array, s: SamplingInputs, x: jax.Array, full: jax.Array) -> jax.Array:
    """Rows flagged ``full`` get the reference's filtered logits, one row at a time: the
    loop runs once per flagged row, so only those rows pay its whole-vocabulary search. The
    ``cond`` matters: with one row the slices are the whole arrays, and XLA hoists the
    loop-invariant search out of the loop, where it would run every step."""

    def one(v, r):
        return jax.lax.dynamic_slice_in_dim(v, r, 1)  # row r as a batch of one

    def body(carry):
        x, todo = carry
        r = jnp.argmax(todo)
        settings = (logits_s, s.temperature, s.top_p, s.top_k, s.min_p)
        row = reference.filtered_logits(*(one(v, r) for v in settings))  # [1, V]
        return jax.lax.dynamic_update_slice_in_dim(x, row, r, 0), todo.at[r].set(False)

    def loop(x, full):
        return jax.lax.while_loop(lambda carry: carry[1].any(), body, (x, full))[0]

    return jax.lax.cond(full.any(), loop, lambda x, _: x, x, full)


def filtered_logits(logits_s: jax.Array, s: SamplingInputs, candidates: int = CANDIDATES) -> jax.Array:
    """logits_s [S, V] -> [S, V]: the reference's ``filtered_logits`` for every row that
    is not greedy (greedy rows' entries are left unspecified), from its candidates."""
    greedy_row = s.temperature < 1e-5
    c = max(min(candidates, logits_s.shape[-1] - 1), 0)
    x = logits_s / jnp.maximum(s.temperature, 1e-5)[:, None]
    thr, full = _threshold(x, s, c)
    x = reference.min_p_mask(jnp.where(x < thr[:, None], -jnp.inf, x), s.min_p)
    return _reference_rows(logits_s, s, x, full & ~greedy_row)


def _draw(keys: jax.Array, x: jax.Array) -> jax.Array:
    """keys [S]; x [S, V] -> [S]: ``vmap(jax.random.categorical)(keys, x)``, the same tokens
    (the same Gumbel noise, ties to the first index) about 3x faster on XLA:CPU, whose fused
    argmax reduce evaluates the noise's logs unvectorised."""
    V = x.shape[-1]
    y = jax.vmap(lambda k: jax.random.gumbel(k, (V,), x.dtype))(keys) + x
    top = y.max(axis=-1, keepdims=True)
    return jnp.min(jnp.where(y == top, jnp.arange(V), V - 1), axis=-1)  # NaN logits: V - 1


def next_tokens(logits_s: jax.Array, s: SamplingInputs, keys: jax.Array) -> jax.Array:
    """logits_s [S, V]; keys [S] -> [S] int32: the reference's tokens for the same keys."""
    greedy_row = s.temperature < 1e-5
    greedy = jnp.argmax(logits_s, axis=-1).astype(jnp.int32)

    def draw():
        if logits_s.shape[-1] < REFERENCE_BELOW:
            return reference.next_tokens(logits_s, s, keys)
        drawn = _draw(keys, filtered_logits(logits_s, s)).astype(jnp.int32)
        return jnp.where(greedy_row, greedy, drawn)

    return jax.lax.cond(greedy_row.all(), lambda: greedy, draw)


def masked(x: jax.Array, allowed: jax.Array, constrained: jax.Array) -> jax.Array:
    """x [S, V] with the tokens a constrained row's bitmask does not allow set to -inf. A
    batch without a constrained row returns ``x`` untouched (``lax.cond``): unconstrained
    steps pay one predicate."""

    def apply(x):
        S, V = x.shape
        bits = (allowed[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [S, W, 32]
        ok = bits.reshape(S, -1)[:, :V] != 0
        return jnp.where(constrained[:, None] & ~ok, -jnp.inf, x)

    return jax.lax.cond(constrained.any(), apply, lambda x: x, x)


def _row_logprobs(logits: jax.Array, targets: jax.Array, K: int):
    """Per logits row: the target token's logprob and the K largest logprobs, ``ROW_BLOCK``
    rows at a time. A step that reports every prompt row's logprobs then holds [ROW_BLOCK, V]
    float32 log-softmax at once, not [R, V]: 0.5 GiB of temporaries per copy at R = 544 and
    V = 262,208 (Gemma 3), more than a quarter of a chip's KV pool."""

    def one(row: jax.Array, target: jax.Array):
        lp = jax.nn.log_softmax(row)  # [V]
        return (lp[jnp.maximum(target, 0)], *(jax.lax.top_k(lp, K) if K else ()))

    R = logits.shape[0]
    out = jax.lax.map(lambda a: one(*a), (logits, targets), batch_size=min(R, ROW_BLOCK))
    if not K:  # (lax.map cannot batch zero-size outputs)
        out = (*out, jnp.zeros((R, 0), jnp.float32), jnp.zeros((R, 0), jnp.int32))
    return out


@jax.named_scope("sampling")  # a profile's name for it (POST /start_profile)
def sample(
    logits: jax.Array,
    s: SamplingInputs,
    top_logprobs: int,
    rows_sharding=None,
    out_sharding=None,
    penalty: tuple[penalties.PenaltyInputs, jax.Array] | None = None,
) -> SamplingOutputs:
    """logits: [R, V] float32 for the batch's logits rows (under a mesh, split by vocabulary);
    ``rows_sharding``: where the S sampled rows go, ``out_sharding`` where the outputs go.

    Under a mesh the sampled rows stay split by vocabulary as the logits are: the maxima,
    sums, top-k candidates and Gumbel noise (``jax_threefry_partitionable``: the same values
    however they are split) are computed per shard and combined across devices, so no
    device holds a [S, V] row block whole (64 rows of Gemma 3 in float32: 64 MiB, moved
    several times a step). The outputs are replicated: every device has the same tokens.

    ``penalty``: the rows' penalty settings and the device's penalty counts
    (``penalties.py``); tokens are then chosen from the penalised logits, while logprobs
    stay those of the raw ones. A constrained row (``s.allowed``) chooses among the tokens
    its grammar allows; its logprobs too stay those of the raw distribution."""
    logits_s = logits[s.last_rows]  # [S, V]
    if rows_sharding is not None:
        logits_s = jax.lax.with_sharding_constraint(logits_s, rows_sharding)
    logp_s = jax.nn.log_softmax(logits_s, axis=-1)
    chosen_from = logits_s
    if penalty is not None:
        chosen_from = penalties.penalised(logits_s, *penalty, s.counters)
        if rows_sharding is not None:  # split as the logits are (a cond's output is left free)
            chosen_from = jax.lax.with_sharding_constraint(chosen_from, rows_sharding)
    if s.allowed is not None:
        chosen_from = masked(chosen_from, s.allowed, s.constrained)
        if rows_sharding is not None:
            chosen_from = jax.lax.with_sharding_constraint(chosen_from, rows_sharding)
    next_ids = next_tokens(chosen_from, s, row_keys(s))
    next_lp = jnp.take_along_axis(logp_s, next_ids[:, None], axis=-1)[:, 0]
    target_lp, row_top_lp, row_top_ids = _row_logprobs(logits, s.targets, top_logprobs)
    out = SamplingOutputs(
        next_ids=next_ids,
        next_logprobs=next_lp,
        next_top_ids=row_top_ids[s.last_rows],
        next_top_logprobs=row_top_lp[s.last_rows],
        target_logprobs=target_lp,
        row_top_ids=row_top_ids,
        row_top_logprobs=row_top_lp,
    )
    if out_sharding is None:
        return out
    return jax.tree_util.tree_map(lambda x: jax.lax.with_sharding_constraint(x, out_sharding), out)
