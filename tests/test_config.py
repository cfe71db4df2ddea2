"""EngineConfig's validation table: every rule names a real field, and each one refuses a
bad value with a message naming the field and the value."""

import dataclasses

import pytest

from hicache_jax.config import COMBINATION_RULES, FIELD_RULES, ConfigError, EngineConfig

FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}

BAD = {  # one value per field that its rule must refuse (the other fields at their defaults)
    "page_size": 24,
    "chunked_prefill_size": 8,
    "max_running_requests": 0,
    "max_total_tokens": 1,
    "swa_full_tokens_ratio": 0.0,
    "dtype": "int8",
    "kv_cache_dtype": "float64",
    "attention_backend": "cuda",
    "ssd_backend": "triton",
    "tp_size": 0,
    "schedule_policy": "lifo",
    "dist_num_processes": 0,
    "dist_process_id": 3,
    "hicache_ratio": 0.0,
    "hicache_size_gb": -1.0,
    "hicache_layerwise_pages": -2,
    "hicache_write_policy": "write_sometimes",
    "hicache_storage_prefetch_policy": "eager",
    "hicache_storage_backend": "redis",
    "hicache_prefetch_threshold": -1,
    "hicache_host_rate_limit": 1.5,
    "hicache_storage_timeout_s": 0.0,
    "hicache_storage_write_queue_mb": 0,
    "hicache_storage_max_gb": -2.0,
    "hicache_storage_min_free_gb": -2.0,
    "hicache_storage_evict_ratio": 0.0,
    "hicache_storage_auth_key_file": "/nonexistent/l3.key",
    "max_queued_tokens": 0,
    "mamba_cache_slots": 1,
    "speculative_algorithm": "STANDALONE",
    "speculative_num_steps": 0,
    "speculative_num_draft_tokens": 1,
    "speculative_draft_model_path": "/models/draft",
    "speculative_ngram_min_match_window_size": 0,
    "speculative_ngram_max_match_window_size": 2,
    "speculative_verify_overhead_rows": -1.0,
    "disaggregation_mode": "both",
    "disaggregation_wait_s": 0.0,
}


def test_every_rule_names_a_field_and_the_defaults_pass():
    assert {name for name, _, _ in FIELD_RULES} <= FIELDS
    EngineConfig()


@pytest.mark.parametrize("name", sorted({name for name, _, _ in FIELD_RULES} - {"dist_coordinator"}))
def test_each_rule_refuses_naming_field_and_value(name):
    value = BAD[name]
    with pytest.raises(ConfigError, match=rf"^{name}={value!r}: must"):
        EngineConfig(**{name: value})


def test_messages_fill_in_the_bound_they_checked():
    with pytest.raises(ConfigError, match=r"multiple of page_size \(32\)"):
        EngineConfig(page_size=32, chunked_prefill_size=48)
    with pytest.raises(ConfigError, match=r"dist_coordinator=None: must be set"):
        EngineConfig(dist_num_processes=2, dist_process_id=1)


def test_kv_cache_dtype_takes_the_peers_names_and_refuses_4_bit_as_not_supported():
    from hicache_jax.config import KV_CACHE_DTYPES
    from hicache_jax.models import kv_quant

    assert set(KV_CACHE_DTYPES) == set(kv_quant.CHOICES)  # the flag's and the model side's
    for peer in ("fp8_e4m3", "fp8_e5m2", "fp8", "bf16"):
        EngineConfig(kv_cache_dtype=peer)
    for name in kv_quant.NOT_SUPPORTED:
        with pytest.raises(ConfigError, match=rf"^kv_cache_dtype={name!r}: is not supported"):
            EngineConfig(kv_cache_dtype=name)


def test_layerwise_loads_are_refused_over_several_processes():
    many = dict(dist_num_processes=2, dist_process_id=0, dist_coordinator="127.0.0.1:1234")
    EngineConfig(hicache_layerwise_pages=-1, **many)  # auto: none there
    with pytest.raises(ConfigError, match=r"^hicache_layerwise_pages=4: must be 0 or -1 over several"):
        EngineConfig(hicache_layerwise_pages=4, **many)


def test_contradictions_are_refused(tmp_path):
    assert len(COMBINATION_RULES) == 5
    key = tmp_path / "l3.key"
    key.write_bytes(b"0123456789abcdef0123")
    for kwargs, words in (
        ({"hicache_storage_backend": "tensorstore"}, "requires enable_hierarchical_cache"),
        ({"enable_hierarchical_cache": True, "disable_radix_cache": True}, "contradicts"),
        ({"hicache_storage_spec": "/tmp/x"}, "hicache_storage_backend is not"),
        ({"hicache_storage_auth_key_file": str(key)}, "hicache_storage_backend is not"),
        ({"disaggregation_mode": "prefill"}, "hands KV over through L3"),
    ):
        with pytest.raises(ConfigError, match=words):
            EngineConfig(**kwargs)


def test_disaggregation_needs_a_shared_l3_and_write_through_prefill():
    with pytest.raises(ConfigError, match=r"disaggregation_mode prefill or decode hands KV over through L3"):
        EngineConfig(disaggregation_mode="decode")
    l3 = dict(
        enable_hierarchical_cache=True, hicache_storage_backend="tensorstore", hicache_storage_spec="/tmp/x"
    )
    EngineConfig(disaggregation_mode="decode", hicache_write_policy="write_back", **l3)
    with pytest.raises(ConfigError, match=r"^disaggregation_mode='prefill': must.*write_through"):
        EngineConfig(disaggregation_mode="prefill", hicache_write_policy="write_back", **l3)
