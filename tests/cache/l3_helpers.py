"""Shared pieces of the L2/L3 tests: the two-pass workload and its checks."""

import threading
import time

import numpy as np

from hicache_jax import LLM

P = 16
SAMPLING = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


def prompt(seed=0, pages=16):
    """16 pages of seeded random token ids (256 tokens: a multiple of the page size, the
    case SGLang's prefetch bug hit)."""
    return np.random.RandomState(seed).randint(3, 500, pages * P).tolist()


def hicache_llm(spec, **kw):
    base = dict(
        page_size=P,
        chunked_prefill_size=64,
        max_running_requests=4,
        enable_hierarchical_cache=True,
        hicache_storage_backend="tensorstore",
        hicache_storage_spec=str(spec),
        hicache_storage_prefetch_policy="wait_complete",
    )
    return LLM(**(base | kw))


def run(llm, ids, **kw):
    return llm.generate(input_ids=[ids], sampling_params=SAMPLING, return_logprob=True, **kw)[0]


def logprobs(out):
    return np.array([x[0] for x in out["meta_info"]["output_token_logprobs"]])


def assert_same_as_recompute(out, ref):
    """Same tokens, and per-token KL (exp(r) - 1 - r, r the logprob gap) <= 1e-6."""
    assert out["output_ids"] == ref["output_ids"]
    r = logprobs(out) - logprobs(ref)
    assert (np.exp(r) - 1 - r).max() <= 1e-6, r


def two_pass(llm, ids):
    first = run(llm, ids)
    assert first["meta_info"]["cached_tokens"] == 0
    assert llm.flush_cache().success
    llm.engine.check_integrity()
    for pool in llm.engine.prefix_cache.pools.values():
        assert pool.num_used == 0
    for pool in llm.engine.prefix_cache.host.values():
        assert pool.index.num_used == 0, "flush_cache must clear L2"
    second = run(llm, ids)
    assert_same_as_recompute(second, first)
    llm.engine.check_integrity()
    return first, second


class ReadGate:
    """Holds every L3 prefetch read of ``engine`` until ``release()``: the probes run, the
    reads start only when the test says so (a gate, not a race against the steps)."""

    def __init__(self, engine, monkeypatch):
        self.engine = engine
        self._open = threading.Event()
        client = engine.storage.client
        real = client.prefetch

        def gated(keys, namespace=None):
            self._open.wait(60)  # bounded: a failed test must not leave a thread behind for good
            return real(keys, namespace)

        monkeypatch.setattr(client, "prefetch", gated)

    def close(self):
        self._open.clear()

    def open(self):
        self._open.set()

    def release(self, timeout=60.0):
        """Open the gate and wait until no prefetch is reading (they have landed)."""
        self.open()
        deadline = time.monotonic() + timeout
        prefetch = self.engine.scheduler.prefetch
        while prefetch.reading():
            assert time.monotonic() < deadline, "prefetch still reading after the gate opened"
            prefetch.wait(0.1)
