"""/generate (SGLang's API) and the admin and info routes, over HTTP."""

from __future__ import annotations

import json

import numpy as np

from tests.server.conftest import CONTEXT

GREEDY = {"max_new_tokens": 4, "temperature": 0}


def test_text_and_input_ids(server):
    out = server.generate(text="The hierarchical cache", sampling_params=GREEDY)
    assert isinstance(out["text"], str) and len(out["output_ids"]) == 4
    meta = out["meta_info"]
    assert meta["completion_tokens"] == 4 and meta["finish_reason"]["type"] == "length"
    assert set(meta["cached_tokens_details"]) == {"device", "host", "storage"}
    again = server.generate(input_ids=[1, 5, 9, 17, 33], sampling_params=GREEDY, rid="my-rid")
    assert again["meta_info"]["id"] == "my-rid" and again["meta_info"]["prompt_tokens"] == 5


def test_batch_keeps_order_and_rids(server):
    outs = server.generate(
        input_ids=[[3, 4, 5], [6, 7, 8, 9]],
        sampling_params=[GREEDY, {"max_new_tokens": 2, "temperature": 0}],
        rid=["a", "b"],
    )
    assert [o["meta_info"]["id"] for o in outs] == ["a", "b"]
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [3, 4]
    assert [len(o["output_ids"]) for o in outs] == [4, 2]


def test_logprobs(server):
    out = server.generate(
        input_ids=[1, 2, 3, 4, 5, 6],
        sampling_params=GREEDY,
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=2,
    )
    meta = out["meta_info"]
    assert len(meta["output_token_logprobs"]) == 4 and len(meta["input_token_logprobs"]) == 6
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    # Greedy: the chosen token is the top-1 candidate.
    assert [t[1] for t in meta["output_token_logprobs"]] == out["output_ids"]


def test_stream_matches_non_stream(server):
    body = {"input_ids": [11, 12, 13, 14, 15], "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    whole = server.generate(**body)
    events = []
    with server.client.stream("POST", "/generate", json=dict(body, stream=True)) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) >= 2  # tokens arrive as they are made
    assert chunks[-1]["output_ids"] == whole["output_ids"] and chunks[-1]["text"] == whole["text"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_device_hit_moves_metrics(server):
    before = server.metrics()
    ids = np.random.default_rng(7).integers(3, 500, size=5 * 16).tolist()
    server.generate(input_ids=ids, sampling_params=GREEDY)
    second = server.generate(input_ids=ids, sampling_params=GREEDY)
    assert second["meta_info"]["cached_tokens"] >= len(ids) - 16
    after = server.metrics()
    for name in (
        "hicache_requests_finished_total",
        "hicache_prompt_tokens_total",
        "hicache_generated_tokens_total",
    ):
        assert after[name] > before[name], name
    assert after["hicache_cached_tokens_total"] >= before["hicache_cached_tokens_total"] + len(ids) - 16
    moved = sum(
        after[f"hicache_cached_tokens_{t}_total"] - before[f"hicache_cached_tokens_{t}_total"]
        for t in ("device", "host", "storage")
    )
    assert moved >= len(ids) - 16
    for name in (
        "hicache_num_running_reqs",
        "hicache_num_waiting_reqs",
        "hicache_gen_throughput",
        "hicache_cache_hit_rate",
    ):
        assert name in after, name
    assert 'hicache_cache_tier_hit_rate{tier="storage"}' in after


def test_info_routes(server):
    info = server.client.get("/get_model_info").json()
    assert info["vocab_size"] == 512 and info["context_length"] == CONTEXT and info["is_generation"]
    sinfo = server.client.get("/get_server_info").json()
    assert sinfo["engine_config"]["enable_hierarchical_cache"] is True
    assert sinfo["server_config"]["host"] == "127.0.0.1"  # the default bind
    assert "num_running_reqs" in sinfo["metrics"]
    models = server.client.get("/v1/models").json()
    assert models["data"][0]["id"] == "tiny"


def test_flush_cache(server):
    ids = list(range(100, 100 + 48))
    server.generate(input_ids=ids, sampling_params=GREEDY)
    r = server.client.post("/flush_cache")
    assert r.status_code == 200 and r.json()["success"] is True
    out = server.generate(input_ids=ids, sampling_params=GREEDY)
    assert out["meta_info"]["cached_tokens_details"]["device"] == 0  # L1 is empty after a flush
