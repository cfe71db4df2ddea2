"""Per-tensor scales of quantized KV pages in every layer that writes pages (issue 46).

- A step over quantized pages equals the same model, never given a scale, over float32
  pages holding their dequantized values (``kv_quant.dequantize``; its own writes dropped):
  the scales folded into the softmax scale, the output, the indexer's weights and DeepSeek
  V4's per-source merge read exactly what the pages mean. Dense and sliding attention,
  sinks, MLA latent rows, DSA indexer keys, DeepSeek V4's window, compressed entries and
  compressed indexer keys, with int8 (scales from the prompt's own amax) and, for two of
  them, float8_e4m3fn.
- The quantized step's prompt argmax agrees with the unquantized model's (a measured bound).
- Unit scales leave the programs as they were (the same jaxpr); power-of-two scales fold
  back bit for bit through the Pallas kernels.
- Calibration is deterministic and covers a drafting block's cache layer (MTP, EAGLE-3).
- Through the engine: greedy tokens leave the unquantized ones only at near-ties; the L3
  namespace names the scale scheme.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hicache_jax.models import kv_calibrate, kv_quant
from hicache_jax.models.cache import join, layer_specs, parts
from hicache_jax.models.presets import build_preset

FP8, INT8 = "float8_e4m3fn", "int8"
PROMPT = 40  # tokens: past tiny-dsv4's window (20) and a few of its compressed entries
# Calibration over fewer tokens than the engine's: the tests need scales, not good ones.
CALIBRATION = 64
# Folding a scale into the softmax scale instead of multiplying the keys: float32 rounding
# (~3e-6 measured on the tiny presets; the logits' scale is ~1).
FOLD_ATOL = 5e-5
# The prompt's next-token argmax agreeing with unquantized KV on these random-weight tiny
# models (unit-scale activations, logits ~1 apart: far touchier than real weights), over
# 40 positions, measured: int8 0.83-1.0, float8_e4m3fn 0.75-0.94. Bounds a little under.
MIN_ARGMAX_AGREEMENT = {INT8: 0.75, FP8: 0.65}

# One preset per kind of paged layer; the MTP presets' drafting layer is a cache layer too.
FAMILIES = ["tiny", "tiny-gpt-oss", "tiny-mla-mtp", "tiny-dsa", "tiny-dsv4"]


@functools.cache
def _model(name: str):
    """One build per preset for the module (tests set the pages' dtype and scales each step)."""
    model = build_preset(name)
    if model.cfg.nextn is not None or model.cfg.v4_blocks:  # as ``build.attach_drafter``
        model.cfg = dataclasses.replace(model.cfg, mtp_cache_layers=1)
    return model


def _scales(model, kv_dtype: str, pages=None):
    """int8: calibrated (``pages``: from a float32 cache already written, no second compile)."""
    if kv_dtype != INT8:
        return None
    if pages is not None:
        return kv_calibrate.scales_from_amax(kv_calibrate.cache_amax(model.cfg, pages))
    ids = kv_calibrate.calibration_ids(model.cfg.vocab_size, n=CALIBRATION)
    return kv_calibrate.calibrate(model, ids)


def _dequantized(cache, cfg, scales):
    """Every page field as float32 numbers (``dequantize`` with its scale)."""
    out = []
    for i, (specs, entry) in enumerate(zip(layer_specs(cfg), cache, strict=True)):
        if not specs:
            out.append(entry)
            continue
        fields = []
        for j, (spec, e) in enumerate(zip(specs, parts(entry, specs), strict=True)):
            if spec.dtype is not None:  # compressor state: its own dtype, never scaled
                fields.append(e)
                continue
            own = None if scales is None else scales.per_layer[i]
            sc = kv_quant.field_scales(own, j, len(e))
            fields.append(type(e)(*(kv_quant.dequantize(a, s) for a, s in zip(e, sc, strict=True))))
        out.append(join(fields, specs))
    return tuple(out)


def _step(model, ids, kv_dtype, scales):
    """The prompt as one step from empty pages of ``kv_dtype``: (new cache, logits, batch)."""
    model.kv_dtype = jnp.dtype(kv_dtype)
    model.set_kv_scales(scales)
    cache, batch = model.full_batch(ids)
    cache, logits = model(cache, batch)
    return cache, logits, batch


CASES = [(name, INT8) for name in FAMILIES] + [("tiny-gpt-oss", FP8), ("tiny-mla-mtp", FP8)]


@pytest.mark.parametrize("name,kv_dtype", CASES, ids=[f"{n}-{d}" for n, d in CASES])
def test_quantized_step_reads_what_its_pages_mean(name, kv_dtype):
    """(float8 pages scale by 1: their reference is a cast, so two families suffice.)"""
    model = _model(name)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, model.cfg.vocab_size, PROMPT), jnp.int32)[None]
    plain_pages, plain, _ = _step(model, ids, "float32", None)
    scales = _scales(model, kv_dtype, plain_pages)  # the prompt's own amax: saturates at 127
    pages, got, batch = _step(model, ids, kv_dtype, scales)
    if scales is not None:  # every quantized field of every main layer (the step writes no
        # drafting layer: ``test_calibration_...`` covers that)
        n = model.cfg.num_layers
        for specs, layer in zip(layer_specs(model.cfg)[:n], scales.per_layer[:n], strict=True):
            for spec, fields in zip(specs, layer, strict=True):
                assert all(s != 1.0 for s in fields) or spec.dtype is not None, (spec, fields)
    # The reference: no scales anywhere, float32 pages holding the dequantized values,
    # its own writes dropped (every slot -1), so it reads exactly those.
    ref_cache = _dequantized(pages, model.cfg, scales)
    nowrite = {g: jnp.full_like(s, -1) for g, s in batch.slot_mappings.items()}
    model.kv_dtype = jnp.dtype("float32")
    model.set_kv_scales(None)
    _, want = model(ref_cache, dataclasses.replace(batch, slot_mappings=nowrite))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=FOLD_ATOL, err_msg=kv_dtype)
    assert not np.allclose(np.asarray(got), np.asarray(plain), atol=1e-4), "pages not quantized?"
    agree = float(jnp.mean(got.argmax(-1) == plain.argmax(-1)))
    assert agree >= MIN_ARGMAX_AGREEMENT[kv_dtype], (kv_dtype, agree)


def test_unit_scales_leave_the_program_as_it_was():
    """Scale 1 (what 8-bit floats use) adds no op: the step's jaxpr is the unscaled one."""
    model = _model("tiny-gpt-oss")
    model.kv_dtype = jnp.dtype(FP8)
    model.set_kv_scales(None)
    cache, batch = model.full_batch(jnp.zeros((1, 8), jnp.int32))

    def program():
        return str(jax.make_jaxpr(lambda c, b: model(c, b))(cache, batch))

    before = program()
    ones = tuple(tuple((1.0,) * 2 for _ in specs) for specs in layer_specs(model.cfg))
    model.set_kv_scales(kv_quant.KVScales(ones))
    assert program() == before
    model.set_kv_scales(
        kv_quant.KVScales(tuple(tuple((0.5, 2.0) for _ in s) for s in layer_specs(model.cfg)))
    )
    assert program() != before  # (the comparison sees scales)
    model.set_kv_scales(None)


def test_calibration_is_deterministic_and_fills_the_int8_range():
    model = _model("tiny-mla-mtp")
    ids = kv_calibrate.calibration_ids(model.cfg.vocab_size, n=CALIBRATION)
    first = kv_calibrate.calibrate(model, ids)
    again = kv_calibrate.calibrate(model, ids)
    assert first == again and first.digest() == again.digest()
    assert kv_quant.scheme(jnp.int8, first) == f"tensor-{first.digest()}"
    # The drafting block's layer is calibrated over its own pass (not left at 1.0).
    assert len(first.per_layer) == model.cfg.num_layers + 1
    assert first.per_layer[-1][0][0] != 1.0
    assert model.mtp[0].layer.mixer.kv_scales is None  # calibrate sets nothing
    # Pages written over the calibration sequence with its scales reach 127 / HEADROOM.
    pages, _, _ = _step(model, jnp.asarray(ids)[None], INT8, first)
    assert model.mtp[0].layer.mixer.kv_scales == first.per_layer[-1]
    # (Exactly in the first layer; later ones see quantized inputs, so about.)
    want = round(kv_quant.INT8_MAX / kv_calibrate.HEADROOM)
    tops = [int(jnp.max(jnp.abs(e.c.astype(jnp.int32)))) for e in pages[: model.cfg.num_layers]]
    assert tops[0] == want and all(abs(t - want) <= 3 for t in tops), tops


def test_scheme_names_the_scales():
    assert kv_quant.scheme(jnp.float32, None) is None
    assert kv_quant.scheme(jnp.bfloat16, None) is None
    assert kv_quant.scheme(jnp.float8_e4m3fn, None) == kv_quant.scheme(jnp.float8_e5m2, None) == "tensor-1"
    a = kv_quant.KVScales((((0.1, 0.2),),))
    b = kv_quant.KVScales((((0.1, 0.3),),))
    assert kv_quant.scheme(jnp.int8, a) != kv_quant.scheme(jnp.int8, b)


def test_an_eagle3_drafts_cache_layer_is_calibrated_and_scaled():
    """The EAGLE-3 draft in the drafting block's place (as ``build.attach_drafter`` puts it):
    its attention pages are calibrated over its own pass and it gets their scales."""
    from flax import nnx

    from hicache_jax.models.causal_lm import CausalLM
    from hicache_jax.models.layers.eagle3 import Eagle3Config, Eagle3Draft
    from tests.models.test_eagle3 import TARGET, draft_config

    target = dataclasses.replace(TARGET, layer_kinds=("attention",) * 5)
    model = CausalLM(target, rngs=nnx.Rngs(0))
    draft = Eagle3Draft(
        Eagle3Config.from_hf(draft_config(shared_head=True)), dtype=jnp.float32, rngs=nnx.Rngs(1)
    )
    model.mtp = nnx.data(nnx.List([draft]))
    aux = draft.cfg.aux_boundaries(target.num_layers)
    model.cfg = dataclasses.replace(model.cfg, mtp_cache_layers=1, eagle3_aux=aux)
    model.kv_dtype = jnp.dtype(INT8)
    scales = _scales(model, INT8)
    assert len(scales.per_layer) == 6 and all(s != 1.0 for s in scales.per_layer[-1][0])
    model.set_kv_scales(scales)
    assert draft.attn.kv_scales == scales.per_layer[-1]
    assert model.layers[0].mixer.kv_scales == scales.per_layer[0]


# Where greedy decoding with 8-bit pages first leaves the unquantized engine's tokens, the
# unquantized top two must be this close (logprob): 8-bit KV moves the tiny preset's logits
# by up to ~0.15 (int8) and ~0.3 (float8_e4m3fn), so only a near-tie may flip (measured
# gaps at the first difference: int8 <= 0.026, float8_e4m3fn <= 0.077).
NEAR_TIE = 0.3


def test_engine_greedy_and_l3_namespace_per_dtype(tmp_path):
    """``--kv_cache_dtype`` through the engine (``build.set_kv_dtype`` calibrates int8): the
    greedy tokens leave the unquantized ones only at near-ties, and the L3 namespace names
    the scale scheme (unquantized: no field, the digest of a store from before it)."""
    from hicache_jax import LLM

    prompts = [np.random.RandomState(s).randint(3, 500, 24 + 8 * s).tolist() for s in range(4)]
    sampling = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    outs, spaces = {}, {}
    for kv_dtype in ("auto", INT8, FP8):
        llm = LLM(
            preset="tiny",
            kv_cache_dtype=kv_dtype,
            page_size=16,
            max_running_requests=4,
            enable_hierarchical_cache=True,
            hicache_storage_backend="tensorstore",
            hicache_storage_spec=str(tmp_path / "l3"),
        )
        try:
            outs[kv_dtype] = llm.generate(
                input_ids=prompts, sampling_params=sampling, return_logprob=True, top_logprobs_num=2
            )
            ns = spaces[kv_dtype] = llm.engine.storage.namespace
            assert ns.kv_scales == kv_quant.scheme(llm.engine.model.kv_dtype, llm.engine.model.kv_scales)
            if kv_dtype == INT8:
                assert ns.kv_scales == f"tensor-{llm.engine.model.kv_scales.digest()}"
        finally:
            llm.close()
    assert spaces["auto"].kv_scales is None and b"kv_scales" not in spaces["auto"].canonical_bytes()
    assert spaces[FP8].kv_scales == "tensor-1"
    assert len({ns.digest for ns in spaces.values()}) == 3
    gaps = {}
    for kv_dtype in (INT8, FP8):
        for ref, got in zip(outs["auto"], outs[kv_dtype], strict=True):
            a, b = ref["output_ids"], got["output_ids"]
            k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if k is not None:
                top = ref["meta_info"]["output_top_logprobs"][k]
                gaps.setdefault(kv_dtype, []).append(round(top[0][0] - top[1][0], 3))
    assert all(g < NEAR_TIE for v in gaps.values() for g in v), gaps


def test_scales_fold_exactly_in_the_pallas_kernels_path():
    """Float32 pages with power-of-two scales hold ``x / s`` exactly, so a step that folds
    the scales on read equals the unscaled step bit for bit: the Pallas kernels (interpret
    mode) of DSA's latent attention, its row attention over the indexer's picks and the
    index scores. (The same check on tiny-dsv4's window and compressed sources, 66 s here,
    was run by hand: equal.)"""
    from hicache_jax.models.kernels.backend import KernelConfig

    model = build_preset("tiny-dsa", kernels=KernelConfig(attention="pallas", interpret=True))
    ids = jnp.asarray(np.random.default_rng(1).integers(0, model.cfg.vocab_size, 64), jnp.int32)[None]
    plain_pages, plain, _ = _step(model, ids, "float32", None)
    pow2 = iter([0.25, 2.0, 4.0, 0.5, 2.0, 0.25])
    scales = kv_quant.KVScales(
        tuple(
            tuple(tuple(next(pow2) for _ in s.entry._fields) for s in specs)
            for specs in layer_specs(model.cfg)
        )
    )
    pages, got, _ = _step(model, ids, "float32", scales)
    model.set_kv_scales(None)
    # The writes divided (layer 0: latent rows by 0.25, indexer keys by 2) ...
    np.testing.assert_array_equal(np.asarray(pages[0][0].c), np.asarray(plain_pages[0][0].c) * 4.0)
    np.testing.assert_array_equal(np.asarray(pages[0][1].k), np.asarray(plain_pages[0][1].k) * 0.5)
    # ... and the reads folded them back.
    np.testing.assert_array_equal(np.asarray(got), np.asarray(plain))
