"""The L3 tier on TensorStore's s3 driver against a real S3 server (SeaweedFS): the two-pass
test, two servers sharing one bucket prefix, and eviction under a cap, all through engines."""

import json
import time

from hicache_jax.storage.tensorstore_store import TensorStoreL3
from tests.cache.l3_helpers import P, assert_same_as_recompute, hicache_llm, prompt, run, two_pass
from tests.storage.test_capacity import stored_bytes

CAP_PROMPTS = 2.5  # the cap, in prompts' worth of pages: two prompts fit, a third does not


def _capped(spec: str, cap_bytes: int = 0):
    # 8-page prompts (cheap): prefetch hits from 64 tokens up.
    return hicache_llm(
        spec, preset="tiny", hicache_storage_max_gb=cap_bytes / 1e9, hicache_prefetch_threshold=64
    )


def test_two_pass_sharing_and_eviction_on_s3(weed):
    spec = json.dumps(weed.spec_at(f"tier-{time.monotonic_ns()}"))
    a = _capped(spec, cap_bytes=10**9)  # a cap far away: tracked, nothing evicted yet
    x, y, z = (prompt(seed=s, pages=8) for s in (1, 2, 3))
    first, second = two_pass(a, x)  # flush_cache keeps L3: the second pass reads S3
    assert second["meta_info"]["cached_tokens_details"]["storage"] >= len(x) - P
    cap_bytes = int(CAP_PROMPTS * a.engine.storage.client.stats()["bytes_written"])  # a wrote x once

    b = _capped(spec, cap_bytes=cap_bytes)  # a second server on the same bucket prefix
    shared = run(b, x)
    assert shared["meta_info"]["cached_tokens_details"]["storage"] >= len(x) - P
    assert_same_as_recompute(shared, first)
    a.close()  # a's last tick hands the evictor lease over; b now keeps the cap
    outs = {}
    for ids in (y, z):
        outs[id(ids)] = run(b, ids)
        assert b.flush_cache().success
    cap = b.engine.storage.client.capacity
    cap.tick()
    stats = b.engine.metrics()
    assert stats["l3_evicted_pages"] > 0 and cap.index.total_bytes <= cap_bytes, stats
    assert stored_bytes(TensorStoreL3(json.loads(spec))) <= cap_bytes  # what S3 really holds
    # x was used least recently: its pages went first. Served again, it equals a recompute
    # from whatever unbroken prefix is left in S3 (maybe none).
    again = run(b, x)
    assert again["meta_info"]["cached_tokens_details"]["storage"] < len(x) - P
    assert_same_as_recompute(again, first)
    assert b.flush_cache().success
    z_again = run(b, z)  # the most recent prompt is still whole in S3
    assert z_again["meta_info"]["cached_tokens_details"]["storage"] >= len(z) - P
    assert_same_as_recompute(z_again, outs[id(z)])
    b.close()
