"""Ragged paged attention: the Pallas kernel (interpret mode) against the plain-JAX reference,
and the reference against a naive numpy oracle.

Every batch is poisoned: pool pages no sequence owns, slots past ``kv_len`` and slots before
the earliest window start of a sequence hold NaN; page-table entries outside the needed range
point at NaN pages or are out-of-range ids; padding query rows are NaN. Any NaN in the output
fails, and padding rows must come out zero.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from hicache_jax.models.kernels.ragged_paged_attention import kernel, kv_write, reference

# (q_len, kv_len) per sequence; all kinds share one set of shapes so each config compiles once.
BATCHES = {
    "prefill": [(40, 40), (64, 64), (7, 7)],
    "decode": [(1, 50), (1, 17), (1, 150), (1, 1), (1, 64)],
    "mixed": [(1, 70), (30, 30), (20, 150), (1, 33)],  # (20, 150): a chunk resuming at 130
}
SEQ_SLOTS = 6  # more than any batch has: the spare slots carry garbage
NUM_TOKENS = 120  # more than any batch has: the tail rows are padding
MAX_KV = 150
HEAD_DIM = 32
NUM_KV_HEADS = 2
TOL = {"float32": 1e-5, "bfloat16": 2e-2}


@dataclasses.dataclass(frozen=True)
class Config:
    page_size: int
    window: int | None
    group: int  # query heads per KV head
    dtype: str
    soft_cap: float | None = None
    q_block: int | None = 8  # None: the kernel's plan()
    kv_block_pages: int | None = None
    head_dim: int = HEAD_DIM
    num_kv_heads: int = NUM_KV_HEADS
    sinks: bool = False  # a learned logit per query head in the denominator (gpt-oss)

    def __str__(self):
        parts = [f"ps{self.page_size}", f"w{self.window}", f"g{self.group}", self.dtype]
        if self.soft_cap:
            parts.append(f"cap{self.soft_cap}")
        if self.sinks:
            parts.append("sinks")
        if self.q_block != 8 or self.kv_block_pages:
            parts.append(f"qb{self.q_block}kb{self.kv_block_pages}")
        if (self.head_dim, self.num_kv_heads) != (HEAD_DIM, NUM_KV_HEADS):
            parts.append(f"d{self.head_dim}h{self.num_kv_heads}")
        return "-".join(parts)


# Every window with both page sizes; GQA ratio, dtype, soft cap and tiling hints rotate
# through them rather than multiply (a full product would compile ~10x more kernels).
CONFIGS = [
    Config(16, None, 1, "float32"),
    Config(16, 1, 4, "float32"),
    Config(16, 17, 1, "bfloat16"),
    Config(16, 64, 4, "float32", q_block=4, kv_block_pages=3, sinks=True),
    Config(16, 100, 4, "bfloat16"),
    Config(64, None, 4, "bfloat16", sinks=True),
    Config(64, 1, 1, "float32"),
    Config(64, 17, 4, "float32", soft_cap=1.0),
    Config(64, 64, 1, "bfloat16"),
    Config(64, 100, 1, "float32", q_block=16, kv_block_pages=1),
]


def make_case(cfg: Config, kind: str, seed: int = 0, spare_pages: int = 2) -> dict:
    rng = np.random.default_rng(seed)
    ps, W, Hkv = cfg.page_size, cfg.window, cfg.num_kv_heads
    Hq, D = Hkv * cfg.group, cfg.head_dim
    dtype = ml_dtypes.bfloat16 if cfg.dtype == "bfloat16" else np.float32
    seqs = BATCHES[kind]
    max_pages = -(-MAX_KV // ps) + spare_pages  # trailing entries no sequence reaches
    num_pages = SEQ_SLOTS * max_pages + 4
    physical = iter(rng.permutation(num_pages))

    k_pages = np.full((num_pages, ps, Hkv, D), np.nan, np.float32)
    v_pages = np.full_like(k_pages, np.nan)
    page_tables = rng.integers(num_pages, 10 * num_pages, (SEQ_SLOTS, max_pages))
    kv_lens = np.full(SEQ_SLOTS, 10**4)  # garbage for the spare slots
    cu_q_lens = np.zeros(SEQ_SLOTS + 1, np.int64)
    for s, (q_len, kv_len) in enumerate(seqs):
        kv_lens[s] = kv_len
        cu_q_lens[s + 1] = cu_q_lens[s] + q_len
        lo = max(0, kv_len - q_len - W + 1) if W else 0  # earliest key any query sees
        for lp in range(max_pages):
            needed = lo // ps <= lp < -(-kv_len // ps)
            if needed or lp % 2 == 0:  # else: leave an out-of-range id
                page_tables[s, lp] = next(physical)
            if needed:
                pos = lp * ps + np.arange(ps)
                live = (pos >= lo) & (pos < kv_len)  # the rest of the page stays NaN
                page = page_tables[s, lp]
                k_pages[page, live] = rng.standard_normal((live.sum(), Hkv, D))
                v_pages[page, live] = rng.standard_normal((live.sum(), Hkv, D))
    cu_q_lens[len(seqs) + 1 :] = cu_q_lens[len(seqs)]
    q = np.full((NUM_TOKENS, Hq, D), np.nan, np.float32)
    n = cu_q_lens[len(seqs)]
    q[:n] = rng.standard_normal((n, Hq, D))
    # Sinks from far below the scores (no effect) to far above (the keys' weights vanish).
    extra = {"sinks": (rng.standard_normal(Hq) * 3).astype(np.float32)} if cfg.sinks else {}
    return extra | dict(
        q=q.astype(dtype),
        k_pages=k_pages.astype(dtype),
        v_pages=v_pages.astype(dtype),
        kv_lens=kv_lens.astype(np.int32),
        page_tables=page_tables.astype(np.int32),
        cu_q_lens=cu_q_lens.astype(np.int32),
        num_seqs=np.int32(len(seqs)),
    )


def static_args(cfg: Config) -> dict:
    return dict(
        sm_scale=cfg.head_dim**-0.5,
        sliding_window=cfg.window,
        soft_cap=cfg.soft_cap,
        q_block=cfg.q_block,
        kv_block_pages=cfg.kv_block_pages,
    )


def naive_attention(case: dict, cfg: Config, with_lse: bool = False):
    """Per sequence: gather its pages, then a dense masked softmax per query, in float64
    (``with_lse``: and each row's log-sum-exp, the sink included; -inf for padding rows)."""
    f64 = {k: np.asarray(v, np.float64) for k, v in case.items() if k in ("q", "k_pages", "v_pages")}
    q, kp, vp = f64["q"], f64["k_pages"], f64["v_pages"]
    G = q.shape[1] // kp.shape[2]
    out = np.zeros_like(q)
    lse = np.full(q.shape[:2], -np.inf)
    cu, kv_lens, ps = case["cu_q_lens"], case["kv_lens"], cfg.page_size
    for s in range(int(case["num_seqs"])):
        kv_len, q_len = kv_lens[s], cu[s + 1] - cu[s]
        n_pages = -(-kv_len // ps)
        # Entries before the window may be out-of-range ids; no query reads what they give.
        ids = case["page_tables"][s, :n_pages]
        k = np.take(kp, ids, axis=0, mode="clip").reshape(-1, *kp.shape[2:])[:kv_len]
        v = np.take(vp, ids, axis=0, mode="clip").reshape(-1, *vp.shape[2:])[:kv_len]
        for row in range(q_len):
            p = kv_len - q_len + row
            lo = max(0, p - cfg.window + 1) if cfg.window else 0
            kk = np.repeat(k[lo : p + 1], G, axis=1)  # [keys, Hq, D]
            vv = np.repeat(v[lo : p + 1], G, axis=1)
            scores = np.einsum("hd,khd->hk", q[cu[s] + row], kk) * cfg.head_dim**-0.5
            if cfg.soft_cap:
                scores = cfg.soft_cap * np.tanh(scores / cfg.soft_cap)
            sink = np.asarray(case["sinks"], np.float64)[:, None] if cfg.sinks else -np.inf
            top = np.maximum(scores.max(axis=-1, keepdims=True), sink)
            w = np.exp(scores - top)
            denominator = w.sum(-1, keepdims=True) + np.exp(sink - top)  # the sink: no value
            out[cu[s] + row] = np.einsum("hk,khd->hd", w / denominator, vv)
            lse[cu[s] + row] = top[:, 0] + np.log(denominator[:, 0])
    return (out, lse) if with_lse else out


def check(out, expected, case: dict, cfg: Config):
    out = np.asarray(jnp.asarray(out, jnp.float32))
    assert not np.isnan(out).any(), "NaN leaked into the output"
    n = case["cu_q_lens"][case["num_seqs"]]
    assert not out[n:].any(), "padding rows must be zero"
    np.testing.assert_allclose(out, np.asarray(expected, np.float32), atol=TOL[cfg.dtype], rtol=0)


@pytest.mark.parametrize("kind", list(BATCHES))
@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_reference_matches_naive(cfg: Config, kind: str):
    case = make_case(cfg, kind)
    out = reference.ragged_paged_attention(**case, **static_args(cfg))
    check(out, naive_attention(case, cfg), case, cfg)


@pytest.mark.parametrize("kind", list(BATCHES))
@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_kernel_matches_reference(cfg: Config, kind: str):
    case = make_case(cfg, kind, seed=1)
    expected = reference.ragged_paged_attention(**case, **static_args(cfg))
    out = kernel.ragged_paged_attention(**case, **static_args(cfg), interpret=True)
    check(out, expected, case, cfg)


# DeepSeek V4's window: one K=V head of 512 (bf16: whole rows), a sink, the log-sum-exp out.
LSE_CONFIGS = [
    Config(16, 17, 4, "float32", sinks=True),
    Config(16, 20, 2, "bfloat16", head_dim=512, num_kv_heads=1, q_block=1),
]


@pytest.mark.parametrize("cfg", LSE_CONFIGS, ids=str)
def test_log_sum_exp(cfg: Config):
    """``return_lse``: reference against the naive one, kernel against the reference."""
    case = make_case(cfg, "mixed", seed=2)
    out, lse = reference.ragged_paged_attention(**case, **static_args(cfg), return_lse=True)
    want_out, want_lse = naive_attention(case, cfg, with_lse=True)
    check(out, want_out, case, cfg)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=TOL[cfg.dtype], rtol=0)
    k_out, k_lse = kernel.ragged_paged_attention(**case, **static_args(cfg), interpret=True, return_lse=True)
    check(k_out, out, case, cfg)
    np.testing.assert_allclose(np.asarray(k_lse), np.asarray(lse), atol=TOL[cfg.dtype], rtol=0)


# Real models' head dims (Gemma's 256; 128) with several KV heads: pages are read as rows of
# 128 lanes, a head's chunks at a stride; bf16 as 32-bit pairs of rows (chunk c of two heads),
# a lone bf16 head as whole rows. Slow in interpret mode: the mixed batch only (prefill
# chunks, decodes, a chunk resuming mid-sequence).
WIDE_CONFIGS = [
    Config(16, None, 2, "float32", head_dim=256, num_kv_heads=4),
    Config(16, 17, 1, "bfloat16", head_dim=256, num_kv_heads=4),
    Config(64, None, 2, "bfloat16", head_dim=256, num_kv_heads=2, q_block=None),  # plan()'s tiles
    Config(16, 100, 2, "bfloat16", head_dim=256, num_kv_heads=1, q_block=1),
    Config(64, None, 1, "float32", head_dim=256, num_kv_heads=1, soft_cap=1.0),
    Config(16, None, 4, "bfloat16", head_dim=128, num_kv_heads=4),
    Config(16, 64, 1, "float32", head_dim=128, num_kv_heads=2, q_block=4, kv_block_pages=3),
    Config(16, 100, 8, "bfloat16", head_dim=64, num_kv_heads=8, q_block=None, sinks=True),  # gpt-oss's heads
    # One KV head wider than 128 lanes but not a multiple of them, read as whole rows: MLA's
    # latent (512 + 64 wide, every query head sharing it), here 128 + 32.
    Config(16, None, 8, "bfloat16", head_dim=160, num_kv_heads=1, q_block=None),
    Config(16, None, 4, "float32", head_dim=160, num_kv_heads=1, q_block=1),
]


@pytest.mark.parametrize("cfg", WIDE_CONFIGS, ids=str)
def test_kernel_matches_reference_at_wide_heads(cfg: Config):
    case = make_case(cfg, "mixed", seed=10)
    expected = reference.ragged_paged_attention(**case, **{**static_args(cfg), "q_block": cfg.q_block or 8})
    check(kernel.ragged_paged_attention(**case, **static_args(cfg), interpret=True), expected, case, cfg)


@pytest.mark.parametrize("window", [17, None])
def test_page_table_left_in_hbm(window: int | None, monkeypatch):
    """A page table past ``TABLE_SMEM_SHARE`` of SMEM stays in HBM, and each block copies
    the entries it reads from a 128-aligned offset (here 72-entry rows, 6 of them); TPU
    interpret mode checks the copies' bounds and races."""
    monkeypatch.setattr(kernel, "TABLE_SMEM_SHARE", 0.0)
    cfg = Config(16, window, 4, "float32", kv_block_pages=2)
    # A fresh function: jit would otherwise reuse a trace with the table in SMEM.
    fn = jax.jit(
        lambda *a, **kw: kernel.ragged_paged_attention.__wrapped__(*a, **kw),
        static_argnames=[*static_args(cfg), "interpret"],
    )
    case = make_case(cfg, "mixed", seed=9, spare_pages=60)
    expected = reference.ragged_paged_attention(**case, **static_args(cfg))
    params = pltpu.InterpretParams(detect_races=True, out_of_bounds_reads="raise")
    try:
        check(fn(**case, **static_args(cfg), interpret=params), expected, case, cfg)
    finally:
        races = kernel_races()
        pltpu.reset_tpu_interpret_mode_state()
    assert not races


@pytest.mark.parametrize(
    "shapes, match",
    [
        (dict(num_q_heads=6, num_kv_heads=3, head_dim=256, dtype="bfloat16"), "num_kv_heads=3"),
        (dict(num_q_heads=8, num_kv_heads=2, head_dim=192, dtype="float32"), "head_dim=192"),
        (dict(num_q_heads=8, num_kv_heads=2, head_dim=128, dtype="float16"), "dtype=float16"),
        (dict(num_q_heads=6, num_kv_heads=4, head_dim=128, dtype="float32"), "num_q_heads=6"),
    ],
)
def test_check_shapes_names_the_value(shapes: dict, match: str):
    with pytest.raises(ValueError, match=match):
        kernel.check_shapes(**shapes)


def test_check_shapes_takes_the_model_families():
    for head_dim in (64, 128, 256):
        for num_kv_heads in (1, 2, 4, 8):
            for dtype in ("float32", "bfloat16"):
                kw = dict(num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
                assert kernel.unsupported_reason(num_q_heads=8 * num_kv_heads, **kw) is None
    # MLA's latent: one KV head of 512 + 64, every query head (16 to 128 per chip) reading it.
    for dtype in ("float32", "bfloat16"):
        assert kernel.unsupported_reason(num_q_heads=128, num_kv_heads=1, head_dim=576, dtype=dtype) is None
    # Odd KV heads read one at a time in float32.
    assert kernel.unsupported_reason(num_q_heads=3, num_kv_heads=3, head_dim=256, dtype="float32") is None


def test_plan_halves_tiles_into_the_budget(monkeypatch):
    """KV steps halve first (down to 128 tokens), then query blocks (down to 8 rows), then
    KV steps (down to a page); past that the shapes are refused, naming the budget."""
    shapes = kernel.Shapes(2048, 1, 8, 8, 256, 16, 4096, jnp.float32, jnp.float32)
    q_full, kbp_full = kernel.plan(shapes)
    steps = []
    for budget in (8 << 20, 4 << 20, 2 << 20, 1 << 20):
        monkeypatch.setattr(kernel.vmem, "tile_budget", lambda budget=budget: budget)
        q_block, kbp = kernel.plan(shapes)
        assert kernel.vmem_bytes(shapes, q_block, kbp) <= budget
        assert q_block < q_full or kbp < kbp_full
        assert q_block == q_full or kbp * 16 <= 128 or kbp == 1  # queries shrink only after KV
        steps.append((q_block, kbp))
    assert steps == sorted(steps, reverse=True)
    monkeypatch.setattr(kernel.vmem, "tile_budget", lambda: 1)
    with pytest.raises(ValueError, match="over the 1-byte budget"):
        kernel.plan(shapes)


def test_empty_sequences_and_single_row_blocks():
    """A sequence with no new rows in the middle of a batch, q_block=1, and an empty batch."""
    cfg = Config(16, 17, 4, "float32", q_block=1)
    case = make_case(cfg, "mixed", seed=5)
    cu = case["cu_q_lens"]
    cu[2:] -= cu[2] - cu[1]  # sequence 1 keeps its KV but brings no queries this step
    expected = reference.ragged_paged_attention(**case, **static_args(cfg))
    check(kernel.ragged_paged_attention(**case, **static_args(cfg), interpret=True), expected, case, cfg)
    check(expected, naive_attention(case, cfg), case, cfg)
    case["num_seqs"] = np.int32(0)
    out = kernel.ragged_paged_attention(**case, **static_args(cfg), interpret=True)
    assert not np.asarray(out).any()


# One-row blocks (what a decode-only step uses) take their own dots in the reference (block-
# diagonal queries against the pages as gathered): every batch kind, windows, soft cap, GQA.
SINGLE_ROW_CONFIGS = [
    Config(16, 17, 1, "bfloat16", soft_cap=1.0, q_block=1),
    Config(64, 100, 4, "float32", q_block=1, kv_block_pages=1),
]


@pytest.mark.parametrize("cfg", SINGLE_ROW_CONFIGS, ids=str)
def test_single_row_blocks_match_naive(cfg: Config):
    for kind in BATCHES:
        case = make_case(cfg, kind, seed=6)
        out = reference.ragged_paged_attention(**case, **static_args(cfg))
        check(out, naive_attention(case, cfg), case, cfg)


@pytest.mark.parametrize(
    "budget, cfg",
    [(1, Config(16, 17, 4, "float32")), (1 << 40, Config(16, None, 4, "float32", q_block=1))],
    ids=["one-block-per-step", "all-blocks-in-one-step"],
)
def test_any_blocks_per_step_match_naive(budget: int, cfg: Config, monkeypatch):
    """Blocks walk their KV a few per step (cache-sized on CPU, all at once elsewhere); the
    extremes give the same result."""
    monkeypatch.setattr(reference, "kv_bytes_per_step", lambda: budget)
    # A fresh function: jit would otherwise reuse the trace of the module's default tiling.
    fn = jax.jit(
        lambda *a, **kw: reference.ragged_paged_attention.__wrapped__(*a, **kw),
        static_argnames=list(static_args(cfg)),
    )
    case = make_case(cfg, "mixed", seed=7)
    check(fn(**case, **static_args(cfg)), naive_attention(case, cfg), case, cfg)


def test_fewest_tokens_fit_the_blocks():
    """As few tokens as sequences (one each, more sequence slots than tokens): the
    ``ceil(T / q_block) + min(S, T)`` blocks still hold every sequence."""
    cfg = Config(16, None, 4, "float32")
    case = make_case(cfg, "decode", seed=8)
    case["q"] = case["q"][: case["cu_q_lens"][case["num_seqs"]]]
    check(reference.ragged_paged_attention(**case, **static_args(cfg)), naive_attention(case, cfg), case, cfg)


def test_kernel_reads_only_needed_pages_and_waits_for_copies():
    """TPU interpret mode raises on an out-of-bounds page id, runs each copy only when it is
    waited on, and watches for reads that race a copy: skipped page-table entries (many hold
    ids past the pool) are never read, and double buffering is sound."""
    cfg = Config(16, 17, 4, "float32", kv_block_pages=2)
    case = make_case(cfg, "mixed", seed=2)
    expected = reference.ragged_paged_attention(**case, **static_args(cfg))
    params = pltpu.InterpretParams(detect_races=True, out_of_bounds_reads="raise")
    try:
        out = kernel.ragged_paged_attention(**case, **static_args(cfg), interpret=params)
        check(out, expected, case, cfg)
    finally:
        races = kernel_races()
        pltpu.reset_tpu_interpret_mode_state()
    assert not races


def kernel_races() -> bool:
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call  # no public accessor

    state = interpret_pallas_call.races
    return bool(state and state.races_found)


@pytest.mark.parametrize("page_dtype", ["float32", "bfloat16"])
def test_write_kv_matches_reference(page_dtype: str):
    rng = np.random.default_rng(3)
    num_pages, ps, Hkv, D, T = 24, 16, 2, 8, 300  # T > one kernel step of 256 tokens
    dtype = ml_dtypes.bfloat16 if page_dtype == "bfloat16" else np.float32
    k_pages = np.full((num_pages, ps, Hkv, D), np.nan, np.float32).astype(dtype)
    v_pages = rng.standard_normal((num_pages, ps, Hkv, D)).astype(dtype)
    k = rng.standard_normal((T, Hkv, D)).astype(np.float32)  # cast to the page dtype
    v = rng.standard_normal((T, Hkv, D)).astype(np.float32)
    slots = rng.permutation(num_pages * ps)[:T].astype(np.int32)
    slots[rng.random(T) < 0.2] = -1  # padding tokens write nothing
    args = [jnp.asarray(x) for x in (k_pages, v_pages, k, v, slots)]
    expected = reference.write_kv(*args)  # not jitted: wants jax arrays
    got = kv_write.write_kv(*args, interpret=True)
    for e, g in zip(expected, got, strict=True):
        assert g.dtype == e.dtype
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(e, np.float32))


def test_write_kv_tpu_interpret():
    """The in-place write under TPU interpret mode (aliasing, semaphores, bounds)."""
    rng = np.random.default_rng(4)
    k_pages = rng.standard_normal((4, 16, 1, 8)).astype(np.float32)
    v_pages = rng.standard_normal((4, 16, 1, 8)).astype(np.float32)
    k = rng.standard_normal((5, 1, 8)).astype(np.float32)
    v = rng.standard_normal((5, 1, 8)).astype(np.float32)
    slots = np.array([0, 17, -1, 63, 40], np.int32)
    args = [jnp.asarray(x) for x in (k_pages, v_pages, k, v, slots)]
    expected = reference.write_kv(*args)
    try:
        got = kv_write.write_kv(*args, interpret=pltpu.InterpretParams())
    finally:
        pltpu.reset_tpu_interpret_mode_state()
    for e, g in zip(expected, got, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(e))
