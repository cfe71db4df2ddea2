"""The planner: a configuration whose weights exceed HBM is refused before compiling, and a
plan from compiles at a few depths (extrapolated in layers) agrees with one compiled at full
depth."""

import dataclasses
import re

import pytest

from hicache_jax.config import EngineConfig
from hicache_jax.models.presets import preset_config
from hicache_jax.tpu import planner
from hicache_jax.tpu.configs import real_config
from hicache_jax.tpu.target import target


def test_weights_past_hbm_are_refused_before_compiling(monkeypatch):
    """DeepSeek V4 Flash in bfloat16 on v6e:2x4 at tp 8: its weights alone (67.6 GiB per
    chip, 80 GiB with the multi-token-prediction block) exceed 31.25 GiB (the compiler
    would refuse each program, after minutes at full depth)."""

    def no_compile(*a, **k):
        raise AssertionError("compiled a program for a configuration that cannot fit")

    monkeypatch.setattr(planner, "_temporaries", no_compile)
    cfg = EngineConfig(tp_size=8, dtype="bfloat16", page_size=128)
    over = r"weights ([\d.]+), cache [\d.]+, before temporaries\), v6e has ([\d.]+) GiB: [\d.]+ GiB over"
    with pytest.raises(planner.DoesNotFit, match=over) as refusal:
        planner.plan(real_config("deepseek-v4-flash"), cfg, target("v6e:2x4"), progress=lambda _: None)
    weights, hbm = map(float, re.search(over, str(refusal.value)).groups())
    assert weights > hbm


def test_first_layers_cuts_every_per_layer_list():
    full = real_config("deepseek-v4-flash")
    cut = planner.first_layers(full, 5)
    assert cut.layer_kinds == full.layer_kinds[:5]
    assert cut.sparse_layers == tuple(i for i in full.sparse_layers if i < 5)
    assert cut.dsv4.hash_layers == tuple(i for i in full.dsv4.hash_layers if i < 5)
    assert planner.layer_signatures(cut) == planner.layer_signatures(full)[:5]
    with pytest.raises(ValueError, match="depth 44"):
        planner.first_layers(full, 44)


def test_pattern_depths_step_by_whole_periods():
    # V4 Flash: swa, swa, csa (the 3 hash-routed layers), then (hca, csa) to the 43rd.
    d1, d2, d3 = planner.pattern_depths(real_config("deepseek-v4-flash"))
    sig = planner.layer_signatures(real_config("deepseek-v4-flash"))
    assert (d1, d2, d3) == (3, 5, 7)
    assert all(sig[i] == sig[i + 2] for i in range(d1, len(sig) - 2))
    assert sig[d1 - 1] != sig[d1 + 1]  # the hash layers end there: no earlier start
    # A 5:1 local:global interleave steps by 6 layers; a 4-layer model gains nothing.
    assert planner.pattern_depths(real_config("gemma-3-27b")) == (1, 7, 13)
    assert planner.pattern_depths(preset_config("tiny")) is None


def test_extrapolated_plan_matches_full_depth(tmp_path, monkeypatch):
    """A 6-layer local/global model planned from compiles at 2 and 4 layers against the same
    model compiled at 6: weights and pool exact, compiled figures close. The line checks at
    6 too, reading the full-depth figures from the memo both plans share (each depth's
    programs compiled once: the check is then the comparison this test makes). Costed at the
    smallest decode batch and one past the engine's buckets (64 > 8 running) only: each
    batch is one more program at each of the 3 depths (a tiny model's TPU compile is mostly
    a fixed cost per program, 5-10 s here), and the line treats every batch alike."""
    monkeypatch.setattr(planner, "DECODE_BATCHES", (1, 64))
    tiny = preset_config("tiny")
    model = dataclasses.replace(tiny, layer_kinds=tiny.layer_kinds + tiny.layer_kinds[:2])
    cfg = EngineConfig(
        tp_size=1,
        dtype="bfloat16",
        page_size=16,
        max_total_tokens=4096,
        max_running_requests=8,
        chunked_prefill_size=64,
    )
    tgt = target("v5e:2x2")
    quiet = lambda _: None
    memo = str(tmp_path / "memo.json")
    full = planner.plan(model, cfg, tgt, progress=quiet, memo=memo)
    line = planner.plan(model, cfg, tgt, progress=quiet, depths=(2, 4, 6), memo=memo)
    assert line.depths == (2, 4, 6) and full.depths is None
    assert (line.weights_bytes, line.kv_pool_bytes) == (full.weights_bytes, full.kv_pool_bytes)
    assert line.temp_program == full.temp_program
    assert line.temp_bytes == pytest.approx(full.temp_bytes, rel=0.1)
    assert [s.name for s in full.steps] == ["decode x1", "decode x64", "prefill 64"]
    for a, b in zip(line.steps, full.steps, strict=True):
        assert a.name == b.name
        assert a.flops == pytest.approx(b.flops, rel=0.01), a.name
        assert a.hbm_bytes == pytest.approx(b.hbm_bytes, rel=0.05), a.name
    assert 0 <= line.check_error < 0.1
    # Confirmed on the line, conservatively: the pool is at most the full-depth one.
    assert line.fit_confirmed
    assert cfg.max_total_tokens < line.max_total_tokens_that_fit <= full.max_total_tokens_that_fit
    text = planner.format_plan(line, model, cfg, tgt)
    assert "EXTRAPOLATED" in text and "first 2 and 4 layers" in text and "to 6" in text
