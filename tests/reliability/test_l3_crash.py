"""Crash safety: ``kill -9`` a process while its engine writes L3, then restart on the same
L3. No torn page is ever served (every stored value decodes whole or is rejected by the
codec), and a new process gets storage hits whose output equals the recompute."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np

from hicache_jax.storage.codec import CorruptPage, decode_page
from hicache_jax.storage.keys import parse_key
from hicache_jax.storage.tensorstore_store import TensorStoreL3
from tests.cache.l3_helpers import P, assert_same_as_recompute, prompt, run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Serves prompt after prompt; after each one waits for its L3 writes (flush_cache), then
# reports it. Killed while a later prompt's pages are being written.
CHILD = textwrap.dedent(
    """
    import json, sys
    from tests.cache.l3_helpers import hicache_llm, logprobs, prompt, run
    llm = hicache_llm(sys.argv[1], preset="tiny")
    for seed in range(100, 200):
        out = run(llm, prompt(seed=seed))
        assert llm.flush_cache()
        print(json.dumps({"seed": seed, "ids": out["output_ids"], "lp": logprobs(out).tolist()}), flush=True)
    """
)


def _files(path) -> int:
    return sum(len(files) for _, _, files in os.walk(path))


def _lines(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line)


def test_kill_9_while_writing_l3_then_restart(make_llm, tmp_path):
    spec = tmp_path / "l3"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    with open(tmp_path / "child.log", "w") as err:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(spec)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=_lines, args=(child.stdout, lines), daemon=True).start()
        try:
            done = [json.loads(lines.get(timeout=240)) for _ in range(2)]
            # Kill as soon as the next prompt's pages start landing in L3.
            before, deadline = _files(spec), time.monotonic() + 60
            while _files(spec) <= before and lines.empty() and time.monotonic() < deadline:
                time.sleep(0.002)
            os.kill(child.pid, signal.SIGKILL)
        finally:
            child.kill()
            child.wait()
    while not lines.empty():
        line = lines.get()
        if line.strip():
            done.append(json.loads(line))
    killed_seed = done[-1]["seed"] + 1

    llm = make_llm(spec)  # the restart, on the same L3
    fingerprint = llm.engine.storage.namespace.fingerprint
    store = TensorStoreL3(str(spec))
    keys = store.list_keys()
    whole = rejected = 0
    for key, value in zip(keys, store.get(keys)):
        parse_key(key)  # nothing but page keys is visible in the store
        try:
            decode_page(value, fingerprint, expected_key=key)
            whole += 1
        except CorruptPage:
            rejected += 1  # a torn page would land here: a miss, never served
    # The file driver renames whole files into place, so no page may be torn at all.
    assert whole >= 2 * 16 and rejected == 0, (whole, rejected)

    for rec in done:  # prompts the killed process finished: served from L3, same output
        out = run(llm, prompt(seed=rec["seed"]))
        assert out["meta_info"]["cached_tokens_details"]["storage"] >= 16 * P - P, rec["seed"]
        assert out["output_ids"] == rec["ids"]
        r = np.array([x[0] for x in out["meta_info"]["output_token_logprobs"]]) - np.array(rec["lp"])
        assert (np.exp(r) - 1 - r).max() <= 1e-6
    # The prompt it was writing when killed: whatever part of it reached L3, the output
    # equals a recompute on an empty cache.
    partial = run(llm, prompt(seed=killed_seed))
    ref = run(make_llm(tmp_path / "empty"), prompt(seed=killed_seed))
    assert ref["meta_info"]["cached_tokens"] == 0
    assert_same_as_recompute(partial, ref)
    assert llm.engine.metrics()["l3_checksum_failures"] == 0
