"""Prefill/decode disaggregation behind the real sglang-router (``--pd-disaggregation``), the
KV handed over through the L3 both servers share (server/disaggregation.py), every tier on.

- Each family (dense, sliding-window, Gemma 3, MoE, Mamba2, GDN): concurrent requests through
  the router, one streamed and one through the OpenAI API, answer what one ordinary server
  does (the decode server itself under another ``cache_salt``, which no tier holds),
  the decode server reading each prompt from L3 up to its last page (its last chunk for the
  recurrent families) after a handover.
- Faults, on a dense fleet (two prefill servers, one decode server with a short wait): a
  request whose prefill server is SIGKILLed mid-prompt still completes with the reference
  output (the router retries the pair on the other prefill server; the abandoned decode copy
  falls back once its wait passes, counted); a decode server waiting for a marker no prefill
  server publishes computes the prompt itself; a decode server SIGKILLed mid-request leaves
  the prefill server holding nothing, and its marker behind until the sweep takes it.
- The S3 L3 (SeaweedFS) through the router, once per routing policy the router offers in PD mode:
  the fault fleet's L3 (a router per policy in front of its servers, before any is killed).

A family's reference comes from its decode server, so each family costs two server starts.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hicache_jax
from hicache_jax.storage.handover import HANDOVER, HandoverBoard
from hicache_jax.storage.tensorstore_store import TensorStoreL3
from tests.reliability.weed import Weed, require_weed
from tests.server.conftest import PAGE_SIZE, TEST_FLAGS, Server
from tests.server.router import Router
from tests.waits import wait

pytest.importorskip("sglang_router")

# Two prefill step shapes, not three (token_buckets(16 + 8) == [16, 24], the 24 only for a
# chunk beside decodes): the decode server loads the 16 from the compilation cache the prefill
# server filled. A recurrent family's state is kept per chunk.
CHUNK = 16
FLAGS = (*TEST_FLAGS, f"--chunked_prefill_size={CHUNK}")
RECURRENT = {"nemotron_h", "qwen3_5"}
GEN = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
SALT = "reference"  # the single-server reference: a namespace no tier holds
FAULT_WAIT_S = 6  # the fault fleet's --disaggregation_wait_s
POLICIES = ("random", "round_robin", "cache_aware", "power_of_two")
TOKENIZER = os.path.join(os.path.dirname(hicache_jax.__file__), "assets", "tiny_tokenizer.json")
CHAT_TEMPLATE = (  # the dense model's: its chat goes through /v1/chat/completions
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)
WORDS = "alpha bravo cobalt delta ember fjord granite harbor indigo juniper kelp lumen maple nectar".split()


# ---- servers --------------------------------------------------------------------------------
def model_dir(checkpoint: str, dest, chat_template: str | None = None) -> str:
    """``checkpoint`` (shared by the session, left as it is) with the tiny preset's
    tokenizer beside it, so that text reaches the model: the router's ``/v1/completions``
    takes a string prompt, not token ids."""
    os.makedirs(dest)
    for name in os.listdir(checkpoint):
        os.symlink(os.path.join(checkpoint, name), os.path.join(dest, name))
    shutil.copy(TOKENIZER, os.path.join(dest, "tokenizer.json"))
    if chat_template is not None:
        with open(os.path.join(dest, "chat_template.jinja"), "w") as f:
            f.write(chat_template)
    return str(dest)


def start(tmp_path, l3_spec: str, model: list[str], roles: list[tuple[str, ...]]) -> list[Server]:
    """One server per ``roles`` entry (its extra flags), all on ``l3_spec``, started together;
    the ones up are closed if another fails."""
    base = ("hicache_l3_cpu.flags", *FLAGS, *model, f"--hicache_storage_spec={l3_spec}")
    with ThreadPoolExecutor(len(roles)) as pool:
        futures = [
            pool.submit(Server, *base, *extra, log_path=str(tmp_path / f"server{i}.log"))
            for i, extra in enumerate(roles)
        ]
        up = [f.result() for f in futures if f.exception() is None]
        errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        for s in up:
            s.close()
        raise errors[0]
    return up


PREFILL = ("--disaggregation_mode=prefill",)


def decode_role(wait_s: float = 60) -> tuple[str, ...]:
    return ("--disaggregation_mode=decode", f"--disaggregation_wait_s={wait_s}")


def pd_counters(server: Server) -> dict[str, float]:
    m = server.metrics()
    return {k.removeprefix("hicache_pd_").removesuffix("_total"): v for k, v in m.items() if "_pd_" in k}


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after}


def summed(servers: list[Server]) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in servers:
        for k, v in pd_counters(s).items():
            out[k] = out.get(k, 0) + v
    return out


def markers(l3_spec: str | dict) -> list[str]:
    """The rooms of the handover markers in an L3 (a directory or a kvstore spec)."""
    store = TensorStoreL3(l3_spec)
    try:
        return sorted(k.removeprefix(HANDOVER) for k in store.list_keys(HANDOVER))
    finally:
        store.close()


# ---- requests -------------------------------------------------------------------------------
def ids_prompt(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(3, 500, size=n).tolist()


def streamed(router: Router, body: dict) -> dict:
    """A streamed ``/generate``: its last event (it holds the whole output)."""
    with router.client.stream("POST", "/generate", json=dict(body, stream=True)) as r:
        assert r.status_code == 200, r.read()
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) >= 3, events  # tokens came one by one
    return json.loads(events[-2])


def reference(decode: Server, input_ids: list[int]) -> dict:
    ref = decode.generate(input_ids=input_ids, sampling_params=GEN, cache_salt=SALT)
    assert ref["meta_info"]["cached_tokens"] == 0, ref["meta_info"]  # computed whole
    return ref


def openai_request(server: Server, text: str) -> tuple[str, dict]:
    """The OpenAI route and body that send ``text``: chat where the model has a template."""
    info = server.client.get("/model_info").json()
    body = {"model": info["served_model_name"], "max_tokens": GEN["max_new_tokens"], "temperature": 0}
    body["ignore_eos"] = True
    if info["has_chat_template"]:
        return "/v1/chat/completions", dict(body, messages=[{"role": "user", "content": text}])
    return "/v1/completions", dict(body, prompt=text)


def openai_text(response: dict) -> str:
    choice = response["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def assert_handover(meta: dict, input_len: int, max_uncached: int) -> None:
    assert meta["disaggregation"]["status"] == "handover", meta
    assert meta["cached_tokens_details"]["storage"] >= input_len - max_uncached, meta


def serve_through(
    router: Router, prefills: list[Server], decode: Server, max_uncached: int, seed: int
) -> None:
    """Four concurrent requests through the router, distinct prompts of several pages: two
    plain ``/generate``, one streamed, one through the OpenAI API (chat where the model has a
    template, else ``/v1/completions``). Each equals the decode server's own answer under
    another salt and was handed over (every marker published by a prefill server, each
    consumed by the decode server)."""
    rng = np.random.default_rng(seed)
    prompts = [ids_prompt(rng, n) for n in (3 * PAGE_SIZE + 5, 4 * PAGE_SIZE, 5 * PAGE_SIZE + 11)]
    text = f"{seed}: " + " ".join(rng.choice(WORDS, size=40))
    route, body = openai_request(decode, text)
    before_p, before_d = summed(prefills), pd_counters(decode)
    with ThreadPoolExecutor(4) as pool:
        plain = [
            pool.submit(router.post, "/generate", {"input_ids": p, "sampling_params": GEN})
            for p in prompts[::2]
        ]
        stream = pool.submit(streamed, router, {"input_ids": prompts[1], "sampling_params": GEN})
        completion = pool.submit(router.post, route, body)
        outs = [plain[0].result(), stream.result(), plain[1].result()]
        completion = completion.result()
    # The references after the handovers (the decode server's prefill program is compiled by
    # then), all four at once (one decode step shape).
    with ThreadPoolExecutor(2) as pool:
        refs = pool.submit(decode.generate, input_ids=prompts, sampling_params=GEN, cache_salt=SALT)
        ref_completion = pool.submit(decode.client.post, route, json=dict(body, cache_salt=SALT))
        refs, r = refs.result(), ref_completion.result()
    for p, out, ref in zip(prompts, outs, refs):
        assert ref["meta_info"]["cached_tokens"] == 0, ref["meta_info"]  # computed whole
        assert out["output_ids"] == ref["output_ids"], out["meta_info"]
        assert_handover(out["meta_info"], len(p), max_uncached)
    assert r.status_code == 200, r.text
    assert openai_text(completion) == openai_text(r.json()), (completion, r.json())
    usage = completion["usage"]
    assert (
        usage["prompt_tokens_details"]["cached_tokens_details"]["storage"]
        >= usage["prompt_tokens"] - max_uncached
    )
    got_d, got_p = delta(pd_counters(decode), before_d), delta(summed(prefills), before_p)
    assert got_d["handovers"] == 4 and got_d["fallbacks"] == 0, got_d
    assert got_p["markers_published"] == 4 and got_p["markers_failed"] == 0, got_p


# ---- every family -----------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["gpt_oss", "gemma3", "qwen3_moe", "nemotron_h", "qwen3_5"])
def test_family_through_router(checkpoint_dir, tmp_path, family):
    l3 = tmp_path / "l3"
    model = [f"--model_path={model_dir(checkpoint_dir(family), tmp_path / 'model')}", "--dtype=float32"]
    servers = start(tmp_path, str(l3), model, [PREFILL, decode_role()])
    router = None
    try:
        router = Router.pd([servers[0].url], [servers[1].url], str(tmp_path / "router.log"))
        serve_through(router, servers[:1], servers[1], CHUNK if family in RECURRENT else PAGE_SIZE, seed=11)
        assert markers(str(l3)) == []  # each consumed by the decode server
    finally:
        if router is not None:
            router.close()
        for s in servers:
            s.close()


# ---- a dense fleet on the S3 L3: two prefill servers, one decode server ---------------------------
class Fleet:
    def __init__(self, prefills: list[Server], decode: Server, router: Router, l3: dict, tmp):
        self.prefills, self.decode, self.router, self.l3, self.tmp = prefills, decode, router, l3, tmp

    def live_prefill(self) -> Server:
        return next(p for p in self.prefills if p.proc.poll() is None)


def dense_model(checkpoint_dir, dest) -> list[str]:
    path = model_dir(checkpoint_dir("llama"), dest, CHAT_TEMPLATE)
    return [f"--model_path={path}", "--dtype=float32"]


def weed_and_dense_model(checkpoint_dir, tmp) -> tuple[Weed, list[str]]:
    """SeaweedFS started while the dense checkpoint is written (each waits on its own)."""
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(Weed, str(tmp / "weed"))
        try:
            model = dense_model(checkpoint_dir, tmp / "model")
        except BaseException:
            if starting.exception() is None:
                starting.result().kill()
            raise
        return starting.result(), model


@pytest.fixture(scope="module")
def fleet(checkpoint_dir, tmp_path_factory):
    """The dense fleet on SeaweedFS' S3 (the decode server with the short wait the faults
    need), behind a router with the default policy."""
    require_weed()
    tmp = tmp_path_factory.mktemp("fleet")
    servers: list[Server] = []
    router = weed = None
    with pytest.MonkeyPatch.context() as mp:  # the keys, for the servers and this process
        mp.setenv("AWS_ACCESS_KEY_ID", "hicache-test")  # any key: weed runs without auth
        mp.setenv("AWS_SECRET_ACCESS_KEY", "hicache-test")
        try:
            weed, model = weed_and_dense_model(checkpoint_dir, tmp)
            spec = weed.spec_at("pd")
            roles = [PREFILL, PREFILL, decode_role(FAULT_WAIT_S)]
            servers = start(tmp, json.dumps(spec), model, roles)
            # The prefill program compiled (by one, loaded from the compilation cache by the
            # other) before any handover is timed: a first compile outlasts the decode
            # server's wait.
            warm = ids_prompt(np.random.default_rng(0), 40)
            for s in servers[:2]:
                s.generate(input_ids=warm, sampling_params=dict(GEN, max_new_tokens=1))
            # A killed prefill server leaves the rotation within seconds (the defaults keep it
            # for minutes, and each retry of the pair could pick it again).
            health = ("--health-check-interval-secs", "1", "--health-failure-threshold", "2")
            health += ("--health-check-timeout-secs", "20")  # a busy server is not a dead one
            prefills, decode = [s.url for s in servers[:2]], [servers[2].url]
            router = Router.pd(prefills, decode, str(tmp / "router.log"), extra=health)
            yield Fleet(servers[:2], servers[2], router, spec, tmp)
        finally:
            if router is not None:
                router.close()
            for s in servers:
                s.close()
            if weed is not None:
                weed.kill()


def test_dense_family_through_router(fleet):
    serve_through(fleet.router, fleet.prefills, fleet.decode, PAGE_SIZE, seed=12)
    assert markers(fleet.l3) == []


def test_each_policy_on_s3(fleet):
    """A router per policy in front of the fleet (S3 L3): each request is handed over and
    answers what one server does. Before the faults: every server is up."""
    routers = {}
    try:
        prefills, decodes = [p.url for p in fleet.prefills], [fleet.decode.url]
        for policy in POLICIES:
            log = str(fleet.tmp / f"router-{policy}.log")
            routers[policy] = Router.pd(prefills, decodes, log, policy=policy)
        rng = np.random.default_rng(16)
        before = summed(fleet.prefills)
        for policy, router in routers.items():
            p = ids_prompt(rng, 4 * PAGE_SIZE + 7)
            out = router.post("/generate", {"input_ids": p, "sampling_params": GEN})
            assert_handover(out["meta_info"], len(p), PAGE_SIZE)
            assert out["output_ids"] == reference(fleet.decode, p)["output_ids"], policy
    finally:
        for router in routers.values():
            router.close()
    assert delta(summed(fleet.prefills), before)["markers_published"] == len(POLICIES)
    assert HandoverBoard(TensorStoreL3(fleet.l3)).scan() == {}  # each consumed


EXAMPLES = itertools.count()


@settings(max_examples=4, deadline=None)
@given(pages=st.integers(1, 6), offset=st.sampled_from([-1, 0, 1]), seed=st.integers(0, 2**16))
def test_prompt_ends_around_a_page(fleet, pages, offset, seed):
    """Whatever page position a prompt ends at, the decode server reads it from L3 up to its
    last page and answers what one server does."""
    # Never a prefix of an earlier example's prompt (a device hit, not a handover).
    p = ids_prompt(np.random.default_rng([seed, next(EXAMPLES)]), pages * PAGE_SIZE + offset)
    out = fleet.router.post("/generate", {"input_ids": p, "sampling_params": GEN})
    assert_handover(out["meta_info"], len(p), PAGE_SIZE)
    assert out["output_ids"] == reference(fleet.decode, p)["output_ids"]


def test_decode_falls_back_without_a_prefill(fleet):
    """A room no prefill server serves: the decode server waits it out and computes the prompt."""
    p = ids_prompt(np.random.default_rng(13), 5 * PAGE_SIZE + 3)
    before = pd_counters(fleet.decode)
    t0 = time.monotonic()
    out = fleet.decode.generate(input_ids=p, sampling_params=GEN, bootstrap_room=random.getrandbits(64))
    took = time.monotonic() - t0
    pd = out["meta_info"]["disaggregation"]
    assert pd["status"] == "fallback" and "no handover marker" in pd["reason"], pd
    assert took >= pd["wait_s"] >= FAULT_WAIT_S, (took, pd)
    assert out["meta_info"]["cached_tokens"] == 0, out["meta_info"]
    assert out["output_ids"] == reference(fleet.decode, p)["output_ids"]
    got = delta(pd_counters(fleet.decode), before)
    assert got["fallbacks"] == 1 and got["handovers"] == 0, got


def busy(server: Server) -> bool:
    m = server.metrics()
    return m["hicache_num_running_reqs"] + m["hicache_num_waiting_reqs"] > 0


def test_prefill_killed_mid_request(fleet):
    """SIGKILL the prefill server computing a long prompt: the router retries the pair on the
    other prefill server and the client gets the reference output; the abandoned decode copy
    falls back once its wait passes, counted in /metrics."""
    p = ids_prompt(np.random.default_rng(14), 1900)
    ref = reference(fleet.decode, p)
    before = pd_counters(fleet.decode)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(fleet.router.post, "/generate", {"input_ids": p, "sampling_params": GEN})
        deadline = time.monotonic() + wait(60)
        victim = None
        while victim is None and time.monotonic() < deadline and not pending.done():
            victim = next((s for s in fleet.prefills if busy(s)), None)
            if victim is None:
                time.sleep(0.02)  # the prefill takes seconds; a tighter loop only slows it down
        assert victim is not None, "no prefill server took the prompt"
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(30)
        out = pending.result()
    assert out["output_ids"] == ref["output_ids"], out["meta_info"]
    deadline = time.monotonic() + FAULT_WAIT_S + wait(60)
    while (got := delta(pd_counters(fleet.decode), before))["fallbacks"] < 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert got["fallbacks"] >= 1, got
    print(f"after the kill: {out['meta_info']['disaggregation']}, decode counters {got}")


def pool_used(server: Server) -> dict[str, float]:
    return {
        k: v for k, v in server.metrics().items() if k.startswith("hicache_pool_") and k.endswith("_used")
    }


def test_decode_killed_mid_request(fleet):
    """SIGKILL the decode server while it waits for a prompt's marker: the prefill server
    still finishes, holds nothing afterwards and publishes the marker, which stays in L3
    (nobody consumed it) until a sweep past the markers' age bound deletes it."""
    prefill, decode = fleet.live_prefill(), fleet.decode
    assert prefill.client.post("/flush_cache").json()["success"] is True
    idle = pool_used(prefill)
    before = pd_counters(prefill)
    room = random.getrandbits(64)
    p = ids_prompt(np.random.default_rng(15), 1200)
    body = {"input_ids": p, "sampling_params": dict(GEN, max_new_tokens=64), "bootstrap_room": room}
    with ThreadPoolExecutor(2) as pool:
        doomed = pool.submit(decode.client.post, "/generate", json=body)
        answer = pool.submit(prefill.client.post, "/generate", json=body)
        deadline = time.monotonic() + wait(60)
        while not busy(prefill) and not answer.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        decode.proc.send_signal(signal.SIGKILL)
        decode.proc.wait(30)
        r = answer.result()
        assert doomed.exception() is not None  # its connection died with it
    assert r.status_code == 200, r.text
    pd = r.json()["meta_info"]["disaggregation"]
    assert pd["room"] == room and pd["status"] == "done" and pd["end"] >= len(p) - PAGE_SIZE, pd
    got = delta(pd_counters(prefill), before)
    assert got["markers_published"] == 1 and got["markers_failed"] == 0, got
    assert not busy(prefill)
    assert prefill.client.post("/flush_cache").json()["success"] is True  # no page still held
    assert pool_used(prefill) == idle

    assert markers(fleet.l3) == [str(room)]
    board = HandoverBoard(TensorStoreL3(fleet.l3))
    marker = board.read(room)
    assert marker is not None and marker.end == pd["end"] and marker.input_len == len(p), marker
    assert board.sweep() == 0 and markers(fleet.l3) == [str(room)]  # young: kept
    assert board.sweep(now=marker.written + board.max_age_s + 1) == 1
    assert markers(fleet.l3) == []
