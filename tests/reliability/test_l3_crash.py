"""Crash safety: ``kill -9`` a server while its engine writes L3, then restart a server on
the same L3. No torn page is ever served (every stored value decodes whole or is rejected
by the codec), and the new process gets storage hits whose output equals the recompute."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import numpy as np

from hicache_jax.storage.codec import CorruptPage, decode_page
from hicache_jax.storage.layout import parse_page_path
from hicache_jax.storage.tensorstore_store import TensorStoreL3
from tests.server.conftest import PAGE_SIZE

GEN4 = {"max_new_tokens": 4, "temperature": 0}


def _ids(seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, size=16 * PAGE_SIZE).tolist()


def _files(path) -> int:
    return sum(len(files) for _, _, files in os.walk(path))


def _logprobs(out: dict) -> np.ndarray:
    return np.array([x[0] for x in out["meta_info"]["output_token_logprobs"]])


def _same_as_recompute(out: dict, ref: dict) -> None:
    """Same tokens, and per-token KL (exp(r) - 1 - r, r the logprob gap) <= 1e-6."""
    assert out["output_ids"] == ref["output_ids"]
    r = _logprobs(out) - _logprobs(ref)
    assert (np.exp(r) - 1 - r).max() <= 1e-6, r


def _serve_until_killed(server, done: list) -> None:
    """Prompt after prompt; each one's L3 writes are waited for (flush) before it counts."""
    for seed in range(100, 200):
        try:
            out = server.generate(input_ids=_ids(seed), sampling_params=GEN4, return_logprob=True)
            if not server.client.post("/flush_cache").json()["success"]:
                return
        except httpx.HTTPError:
            return  # killed
        done.append((seed, out))


def test_kill_9_while_writing_l3_then_restart(start_server, tmp_path):
    spec = tmp_path / "l3"
    victim = start_server(spec, name="victim")
    done: list[tuple[int, dict]] = []
    client = threading.Thread(target=_serve_until_killed, args=(victim, done), daemon=True)
    client.start()
    deadline = time.monotonic() + 240
    while len(done) < 2 and client.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(done) >= 2, victim.log_tail()
    # Kill as soon as the next prompt's pages start landing in L3.
    before, deadline = _files(spec), time.monotonic() + 60
    while _files(spec) <= before and len(done) == 2 and time.monotonic() < deadline:
        time.sleep(0.002)
    os.kill(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait()
    client.join(30)
    killed_seed = done[-1][0] + 1

    # Every value in the store: whole (checksum, length and key agree) or rejected.
    store = TensorStoreL3(str(spec))
    keys = store.list_keys("pages/")
    whole, rejected, namespaces = 0, 0, set()
    for key, value in zip(keys, store.get(keys)):
        assert parse_page_path(key) is not None, key  # nothing but page keys under pages/
        namespaces.add(value[8:16].hex())
        try:
            decode_page(value, value[8:16].hex(), expected_key=key)
            whole += 1
        except CorruptPage:
            rejected += 1  # a torn page would land here: a miss, never served
    # The file driver renames whole files into place, so no page may be torn at all.
    assert whole >= 2 * 16 and rejected == 0 and len(namespaces) == 1, (whole, rejected, namespaces)

    restarted = start_server(spec, name="restarted")
    for seed, theirs in done:  # prompts the killed server finished: served from L3
        out = restarted.generate(input_ids=_ids(seed), sampling_params=GEN4, return_logprob=True)
        assert out["meta_info"]["cached_tokens_details"]["storage"] >= 15 * PAGE_SIZE, seed
        _same_as_recompute(out, theirs)
    # The prompt it was writing when killed: whatever part of it reached L3, the output
    # equals a recompute (a salted request shares no cached page with anyone).
    ids = _ids(killed_seed)
    partial = restarted.generate(input_ids=ids, sampling_params=GEN4, return_logprob=True)
    ref = restarted.generate(input_ids=ids, sampling_params=GEN4, return_logprob=True, cache_salt="fresh")
    assert ref["meta_info"]["cached_tokens"] == 0
    _same_as_recompute(partial, ref)
    assert restarted.metrics()["hicache_l3_checksum_failures_total"] == 0
