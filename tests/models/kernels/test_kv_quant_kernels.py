"""Quantized KV pages (``--kv_cache_dtype`` float8_e4m3fn, float8_e5m2, int8) in the Pallas
kernels, interpret mode: each kernel reads the 8-bit pages, widens them in VMEM and equals
its plain-JAX reference on the same pages. The batches are poisoned as in the unquantized
tests: NaN in 8-bit floats; int8 has no NaN, so there the poison is 127 (the largest
value: a leak shows as a wrong output)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from hicache_jax.models import kv_quant
from hicache_jax.models.kernels.ragged_paged_attention import kernel, kv_write, reference
from tests.models.kernels.test_ragged_paged_attention import Config, check, make_case, static_args

INT8_STEP = 1 / 32  # int8 pages hold round(x * 32): about 5 bits of a standard normal


def quantize_pages(case: dict, kv_dtype: str) -> tuple[dict, float]:
    """The case's pages stored in ``kv_dtype`` (``kv_quant.store``); the key scale the
    caller folds into ``sm_scale`` and multiplies the output by (1 for 8-bit floats)."""
    scale = INT8_STEP if kv_dtype == "int8" else 1.0
    out = dict(case)
    for name in ("k_pages", "v_pages"):
        x = jnp.asarray(np.asarray(case[name], np.float32))
        if kv_dtype == "int8":
            x = jnp.where(jnp.isnan(x), kv_quant.INT8_MAX * scale, x)  # the poison: 127
        out[name] = kv_quant.quantize(x, jnp.dtype(kv_dtype), scale)
    return out, scale


# Every dtype; windows, sinks, the query dtype, head widths (rows of < 128 lanes, strided
# 128-lane chunks of several heads, one head of whole rows) rotate through them.
CASES = [
    ("float8_e4m3fn", "prefill", Config(16, None, 4, "bfloat16")),
    ("float8_e4m3fn", "decode", Config(16, 17, 1, "float32", sinks=True)),
    ("float8_e5m2", "mixed", Config(64, 100, 4, "bfloat16", soft_cap=1.0)),
    ("int8", "mixed", Config(16, 64, 2, "float32", q_block=4, kv_block_pages=3)),
    ("float8_e4m3fn", "mixed", Config(16, None, 2, "bfloat16", head_dim=128, num_kv_heads=4, q_block=None)),
    ("int8", "decode", Config(16, 100, 4, "bfloat16", head_dim=256, num_kv_heads=1, q_block=1)),
]


@pytest.mark.parametrize("kv_dtype, kind, cfg", CASES, ids=lambda x: str(x))
def test_attention_reads_quantized_pages(kv_dtype: str, kind: str, cfg: Config):
    case, scale = quantize_pages(make_case(cfg, kind, seed=3), kv_dtype)
    static = static_args(cfg) | {"sm_scale": cfg.head_dim**-0.5 * scale}
    expected = reference.ragged_paged_attention(**case, **{**static, "q_block": cfg.q_block or 8})
    out = kernel.ragged_paged_attention(**case, **static, interpret=True)
    assert out.dtype == case["q"].dtype
    # Outputs are in page units (the caller multiplies by the value scale): tolerances too.
    check(out * scale, expected * scale, case, cfg)


@pytest.mark.parametrize("kv_dtype", list(kv_quant.QUANTIZED))
def test_write_kv_writes_quantized_pages(kv_dtype: str):
    """The Pallas write stores ``kv_quant.store`` of the new rows, as the reference does,
    and leaves every other slot as it was."""
    rng = np.random.default_rng(4)
    dtype = jnp.dtype(kv_dtype)
    pages = kv_quant.store(jnp.asarray(rng.standard_normal((6, 16, 2, 128)) * 20, jnp.float32), dtype)
    k = jnp.asarray(rng.standard_normal((9, 2, 128)) * 300, jnp.bfloat16)  # some saturate
    v = jnp.asarray(rng.standard_normal((9, 2, 128)) * 3, jnp.bfloat16)
    slots = jnp.asarray([3, 17, -1, 40, 41, 95, -1, 0, 64], jnp.int32)
    want = reference.write_kv(pages, pages, k, v, slots)
    got = kv_write.write_kv(pages, pages, k, v, slots, interpret=True)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)))
    written = np.asarray(got[0].reshape(-1, 2, 128)[3].astype(jnp.float32))
    assert not np.isnan(written).any()  # saturated, not overflowed to NaN


def test_check_shapes_takes_quantized_pages():
    shapes = dict(num_q_heads=12, num_kv_heads=3, head_dim=256)  # odd heads: no bf16 pair rule
    for name in kv_quant.QUANTIZED:
        assert kernel.unsupported_reason(**shapes, dtype=name) is None
    assert "float16" in kernel.unsupported_reason(**shapes, dtype="float16")


def test_planned_vmem_counts_the_widened_pages():
    s = kernel.Shapes(64, 8, 32, 8, 128, 16, 256, jnp.bfloat16, jnp.float8_e4m3fn)
    wide = dataclasses.replace(s, kv_dtype=jnp.float32)
    narrow = kernel.vmem_bytes(s, 8, 8)
    # Double-buffered 8-bit pages plus one float32 step: 6 bytes a value against 8.
    assert narrow - kernel.vmem_bytes(dataclasses.replace(s, kv_dtype=jnp.int8), 8, 8) == 0
    kv32 = 2 * 2 * 8 * 16 * 8 * 128 * 4
    assert kernel.vmem_bytes(wide, 8, 8) - narrow == kv32 - kv32 * 6 // 8


@pytest.mark.parametrize("kv_dtype, q_dtype", [("float8_e4m3fn", "bfloat16"), ("int8", "float32")])
def test_row_attention_reads_quantized_rows(kv_dtype: str, q_dtype: str):
    """DeepSeek V4's window and compressed rows, MLA's picked rows: 8-bit rows are copied
    with their three packing partners (NaN in 8-bit floats) and widened in VMEM."""
    from hicache_jax.models.kernels.paged_row_attention import kernel as rows_kernel
    from hicache_jax.models.kernels.paged_row_attention import reference as rows_reference
    from tests.models.kernels.test_paged_row_attention import D, batch
    from tests.models.kernels.test_paged_row_attention import check as rows_check

    q, pool, table, seq, idx = batch("float32", seed=2)
    scale = INT8_STEP if kv_dtype == "int8" else 1.0
    if kv_dtype == "int8":
        pool = jnp.where(jnp.isnan(pool), kv_quant.INT8_MAX * scale, pool)
    args = (q.astype(q_dtype), kv_quant.quantize(pool, jnp.dtype(kv_dtype), scale), table, seq, idx)
    want_o, want_lse = rows_reference.paged_row_attention(*args, sm_scale=D**-0.5 * scale)
    got_o, got_lse = rows_kernel.paged_row_attention(*args, sm_scale=D**-0.5 * scale, interpret=True)
    rows_check(got_o * scale, got_lse, want_o * scale, want_lse, q_dtype)


@pytest.mark.parametrize("kv_dtype", ["float8_e5m2", "int8"])
def test_index_scores_read_quantized_keys(kv_dtype: str):
    """Indexer keys in 8 bits meet bfloat16 queries in bfloat16 (``meet_dtype``), as the
    reference does; the rows a token sees and its top-k are the reference's."""
    from hicache_jax.models.kernels.index_scores import kernel as index_kernel
    from hicache_jax.models.kernels.index_scores import reference as index_reference
    from tests.models.kernels.test_index_scores import ROWS, batch

    q, w, keys, table, seq, last = batch("float32", seed=3)
    scale = INT8_STEP if kv_dtype == "int8" else 1.0
    if kv_dtype == "int8":
        keys = jnp.where(jnp.isnan(keys), kv_quant.INT8_MAX * scale, keys)
    args = (q.astype(jnp.bfloat16), w, kv_quant.quantize(keys, jnp.dtype(kv_dtype), scale), table, seq, last)
    got = index_kernel.index_scores(*args, block_q=4, block_rows=2 * ROWS, interpret=True)
    want = index_reference.index_scores(*args)
    seen = np.isfinite(np.asarray(want))
    np.testing.assert_array_equal(np.isfinite(np.asarray(got)), seen)
    np.testing.assert_allclose(np.asarray(got)[seen], np.asarray(want)[seen], rtol=1e-5, atol=1e-5 / scale)
