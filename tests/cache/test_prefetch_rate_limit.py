"""``hicache_host_rate_limit``: the host rows L3 prefetches hold (reserved while reading,
brought but not yet used by a request) never pass the limit's share of the host pool, and
the limit never starves anyone: a refused prompt is schedulable at once, and rows free up
as requests use what was brought.

The store is faked (every page exists, reads finish at once); decisions are made on the
test's thread only (``Prefetcher.start``, ``decide``, ``apply``), so each trace runs the
same every time. Under ``wait_complete`` a request waits exactly while its task exists."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_jax.cache.host_pool import HostPool
from hicache_jax.cache.pool import IndexPool
from hicache_jax.cache.prefix_cache import PrefixCache
from hicache_jax.cache.storage_tier import StorageTier
from hicache_jax.request import Req
from hicache_jax.sampling_params import SamplingParams
from hicache_jax.scheduler.l3_prefetch import Prefetcher
from hicache_jax.storage.keys import Namespace
from hicache_jax.storage.ratelog import RateLimitedLog
from hicache_jax.storage.read_handle import PrefetchHandle
from tests.cache_rules import classic_rules

P = 4
HOST_PAGES = 40
LIMIT = 0.5


class Transfer:
    def read(self, kind, idx):
        return {"kv": np.zeros((len(idx), P), np.int64)}

    def write(self, kind, idx, arrays):
        pass


@dataclasses.dataclass
class ClientCfg:
    timeout_s: float = 60.0


class AllHitClient:
    """Every page is in L3; a read finishes before ``prefetch`` returns."""

    cfg = ClientCfg()
    batch_size = 8
    ratelog = RateLimitedLog(__import__("logging").getLogger(__name__))

    def reads_available(self):
        return True

    def exists(self, keys):
        return [True] * len(keys)

    def prefetch(self, keys, namespace=None):
        handle = PrefetchHandle(keys)
        for _ in keys:
            handle.add_page({"kv": np.ones(P, np.int64)})
        handle.finish()
        return handle

    def close(self, timeout=None):
        pass


def make_tier():
    rules = classic_rules(P)
    cache = PrefixCache(
        rules,
        {"full": IndexPool(64, "full pages")},
        host={"full": HostPool("full", HOST_PAGES, {"kv": ((P,), np.int64)})},
        transfer=Transfer(),
    )
    ns = Namespace(model_fingerprint="fake", kv_dtype="int64", page_size=P, layout_version=1)
    tier = StorageTier(AllHitClient(), ns, cache)
    prefetcher = Prefetcher(tier, cache, policy="wait_complete", threshold=P, host_rate_limit=LIMIT)
    return cache, tier, prefetcher


def start(prefetcher, key: str, tokens: list[int]) -> None:
    """A request with this prompt arrives (``Scheduler.add``)."""
    prefetcher.start(Req(rid=key, input_ids=tokens, sampling=SamplingParams(), prefetch_key=key))


def land(prefetcher):
    """Wait for the reads in flight (they finish without the store), then apply them as
    the scheduler does."""
    while prefetcher.reading():
        prefetcher.wait(1.0)
    decided = prefetcher.decide()
    prefetcher.apply(decided)
    assert not decided.waiting and not prefetcher.tasks


def waits(prefetcher, key: str) -> bool:
    """Whether the request of ``key`` is held by its prefetch (wait_complete: its task is
    in flight or landed but not yet applied)."""
    return key in prefetcher.tasks


def use(cache, tokens):
    """A request starts from its prompt's cached prefix: the pages come to the device."""
    match = cache.match(tokens, len(tokens))
    cache.lock(match.last)
    assert cache.load(match)
    cache.unlock(match.last)
    return match.end


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.integers(2, 16)),  # a prompt of this many pages (+1 token)
        st.tuples(st.just("land"), st.just(0)),
        st.tuples(st.just("use"), st.integers(0, 20)),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(ops=OPS)
def test_prefetches_hold_at_most_the_limit_and_nobody_starves(ops):
    cache, tier, prefetcher = make_tier()
    limit = LIMIT * HOST_PAGES
    prompts, refused = [], 0
    try:
        for op, arg in ops:
            if op == "arrive":
                k = len(prompts)
                tokens = [10_000 * (k + 1) + t for t in range(arg * P + 1)]  # no shared prefix
                prompts.append(tokens)
                # Rows held before, counted from the tasks and the tree, not by the tier.
                held = sum(t.rows for t in prefetcher.tasks.values()) + sum(
                    "full" in n.host for n in cache.nodes() if n.from_storage
                )
                before = prefetcher.counters["prefetch_refused_host_full"]
                start(prefetcher, str(k), tokens)
                was_refused = prefetcher.counters["prefetch_refused_host_full"] > before
                assert was_refused == (held + arg > limit), (held, arg, limit)
                refused += was_refused
                if was_refused:
                    assert not waits(prefetcher, str(k)), "a refused prefetch must not hold its request"
            elif op == "land":
                land(prefetcher)
            elif prompts:
                tokens = prompts[arg % len(prompts)]
                if not waits(prefetcher, str(arg % len(prompts))):
                    use(cache, tokens)
            assert prefetcher.prefetched_rows() <= limit
            cache.check_integrity()
        # Nobody starves: once everything landed and was used, every request is ready and
        # the whole allowance is free again.
        land(prefetcher)
        for k, tokens in enumerate(prompts):
            assert not waits(prefetcher, str(k))
            use(cache, tokens)
        assert prefetcher.prefetched_rows() == 0
        big = [7] * (int(limit) * P + 1)
        start(prefetcher, "big", big)
        assert "big" in prefetcher.tasks, "a prefetch of exactly the limit refused after all was used"
        land(prefetcher)
        assert use(cache, big) == int(limit) * P
        assert prefetcher.counters["prefetch_refused_host_full"] == refused
    finally:
        prefetcher.close()
        tier.close()


def test_a_prompt_larger_than_the_limit_is_never_prefetched_but_runs():
    cache, tier, prefetcher = make_tier()
    tokens = list(range(3, 3 + math.ceil(LIMIT * HOST_PAGES + 1) * P + 1))
    start(prefetcher, "a", tokens)
    assert not prefetcher.tasks and prefetcher.counters["prefetch_refused_host_full"] == 1
    assert not waits(prefetcher, "a")
    prefetcher.close()
    tier.close()
