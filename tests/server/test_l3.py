"""The acceptance test over HTTP: a 16-page random prompt, flush, and the same prompt again
is served from L3 (storage); /clear_storage then empties L3, and only of this project's keys."""

from __future__ import annotations

import os

import numpy as np

from tests.server.conftest import PAGE_SIZE

GEN4 = {"max_new_tokens": 4, "temperature": 0}


def test_two_pass_l3_then_clear_storage(server):
    ids = np.random.default_rng(1234).integers(3, 500, size=16 * PAGE_SIZE).tolist()
    first = server.generate(input_ids=ids, sampling_params=GEN4)
    assert server.client.post("/flush_cache").json()["success"] is True
    second = server.generate(input_ids=ids, sampling_params=GEN4)
    meta = second["meta_info"]
    assert meta["cached_tokens"] >= len(ids) - PAGE_SIZE, meta
    assert meta["cached_tokens_details"]["storage"] > 0, meta
    assert second["output_ids"] == first["output_ids"]  # greedy, cached or not
    # Where its time to first token went: the L3 read's parts, then admission, then the L2 load.
    t = meta["timing"]
    assert set(t) == {"loop_wait_s", "l3_probe_s", "l3_read_s", "l3_landed_s", "admitted_s", "l2_load_s"}, t
    assert 0 <= t["loop_wait_s"] < 60, t
    assert 0 < t["l3_probe_s"] + t["l3_read_s"] <= t["l3_landed_s"] <= t["admitted_s"] <= meta["ttft"], t
    cold = first["meta_info"]["timing"]  # probed L3, found nothing: no read, no load
    assert cold["l3_read_s"] == 0 and "l2_load_s" not in cold and cold["admitted_s"] > 0, cold

    r = server.client.post("/clear_storage")
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert server.client.post("/flush_cache").json()["success"] is True
    third = server.generate(input_ids=ids, sampling_params=GEN4)
    assert third["meta_info"]["cached_tokens"] == 0, third["meta_info"]
    m = server.metrics()
    assert m["hicache_cached_tokens_storage_total"] >= len(ids) - PAGE_SIZE


def test_clear_storage_deletes_only_this_projects_keys(server):
    """Issue 39, finding 1: ``POST /clear_storage`` deleted every file under the store's
    directory. Foreign files survive it, with or without ``all_namespaces``; a GET changes
    nothing."""
    ids = np.random.default_rng(99).integers(3, 500, size=4 * PAGE_SIZE).tolist()
    foreign = {
        "userdata/notes.txt": b"x\n",
        "pages/README": b"not a page\n",
        "meta/journal/notes": b"mine\n",
    }
    for name, data in foreign.items():
        path = os.path.join(server.l3_dir, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    for body in (None, {"all_namespaces": True}):
        server.generate(input_ids=ids, sampling_params=GEN4)
        assert server.client.post("/flush_cache").json()["success"] is True  # its pages are in L3
        assert server.client.get("/clear_storage").status_code == 405
        r = server.client.post("/clear_storage", json=body)
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        again = server.generate(input_ids=ids, sampling_params=GEN4)
        assert again["meta_info"]["cached_tokens_details"]["storage"] == 0, again["meta_info"]
        for name, data in foreign.items():
            with open(os.path.join(server.l3_dir, name), "rb") as f:
                assert f.read() == data, name
        assert server.client.post("/flush_cache").json()["success"] is True
