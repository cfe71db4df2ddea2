"""Streaming text deltas and the Prometheus rendering, without a server."""

from __future__ import annotations

from hicache_jax.server import metrics
from hicache_jax.server.streaming import TextDelta


def test_deltas_concatenate_to_the_final_text():
    d = TextDelta()
    parts = [d.update(t, False) for t in ["He", "Hel", "Hello", "Hello w"]] + [d.update("Hello world", True)]
    assert "".join(parts) == "Hello world"


def test_cut_multibyte_characters_wait():
    d = TextDelta()
    assert d.update("caf\ufffd", False) == "caf"
    assert d.update("café", False) == "é"


def test_stop_strings_never_reach_the_client():
    d = TextDelta(stop=("END",))
    sent = d.update("abc EN", False)  # "EN" may become "END": held back
    sent += d.update("abc END and more", False)
    sent += d.update("abc ", True)  # the final text drops the stop string
    assert sent == "abc "


def test_metrics_types_and_names():
    text = metrics.render(
        {
            "generated_tokens": 5,
            "num_running_reqs": 2,
            "l3_writes": 3,
            "l3_pending_writes": 1,
            "new_thing": 1.5,
        }
    ).decode()
    types = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            types[name.removesuffix("_total")] = kind
    assert types["hicache_generated_tokens"] == "counter" and "hicache_generated_tokens_total 5.0" in text
    assert types["hicache_num_running_reqs"] == "gauge"
    assert types["hicache_l3_writes"] == "counter" and types["hicache_l3_pending_writes"] == "gauge"
    assert "hicache_new_thing 1.5" in text  # keys the server does not know are exported too
    assert 'hicache_cache_tier_hit_rate{tier="device"} 0.0' in text
