"""A tree per cache_salt is dropped when it empties: a stream of one-off salts must not
leave a tree behind each (the salt is an unbounded user value)."""

from hicache_jax.config import EngineConfig
from hicache_jax.engine.engine import Engine
from tests.cache.test_prefix_cache import make
from tests.reliability.workload import _tokens


def test_lookups_make_no_tree_and_emptied_trees_go():
    c = make(pages=8)
    for i in range(20_000):  # a lookup under a new salt stores nothing
        assert c.match(list(range(9)), 9, salt=f"tenant-{i}").end == 0
    assert len(c.trees) == 0
    for i in range(2_000):  # each insert evicts an older tenant's pages, and its tree
        salt = f"tenant-{i}"
        pages = {"full": c.alloc("full", 2)}
        node, _ = c.insert(list(range(8)), None, 2, pages, salt=salt)
        assert c.salt_of(node) == salt
        assert len(c.trees) <= 4, len(c.trees)  # 8 pages hold at most 4 tenants of 2
    c.check_integrity()
    c.flush()
    assert c.trees == {}


def test_engine_with_many_salts_keeps_few_trees():
    cfg = EngineConfig(
        preset="tiny",
        page_size=16,
        chunked_prefill_size=64,
        max_running_requests=4,
        max_total_tokens=128,
        enable_hierarchical_cache=True,
        hicache_ratio=1.0,
    )
    engine = Engine(cfg)
    prompt = _tokens(7, 40)
    outs = []
    for i in range(24):
        rid = engine.add_request(input_ids=prompt, sampling_params={"max_new_tokens": 2}, cache_salt=f"s{i}")
        while engine.has_unfinished():
            engine.step()
        outs.append(engine.pop_output(rid))
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in outs), "salts never share pages"
    # 8 device + 8 host pages, 2-3 pages per tenant: only the last few tenants still have a tree.
    assert len(engine.prefix_cache.trees) <= 8, len(engine.prefix_cache.trees)
    engine.check_integrity()
    assert engine.flush_cache().success
    assert engine.prefix_cache.trees == {}
