"""A server-like process that writes and re-reads page chains into one capped L3 (for the
two-process eviction tests). Page j of chain c holds ``c * 1000 + j``, so a reader can check
every page it is served against a recompute.

Usage: python -m tests.storage._evict_worker SPEC_JSON WORKER_ID CHAINS CAP_BYTES
Prints one JSON line: the client's eviction counters.
"""

import json
import sys

from hicache_jax.storage.capacity import CapacityConfig
from hicache_jax.storage.client import StorageClient
from hicache_jax.storage.tensorstore_store import TensorStoreL3
from tests.storage.test_capacity import NS, chain, pages

PAGES_PER_CHAIN = 4


def chain_id(worker: int, c: int) -> int:
    return worker * 1000 + c


def main() -> None:
    spec, worker, chains, cap = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    cfg = CapacityConfig(max_bytes=cap, low_watermark=0.8, tick_s=0.2, lease_ttl_s=1.0, timeout_s=5.0)
    client = StorageClient(TensorStoreL3(spec, timeout_s=5.0), NS, capacity=cfg)
    for c in range(chains):
        client.write_async(pages(chain_id(worker, c), PAGES_PER_CHAIN))
        client.flush(10)
        if c % 3 == 2:  # a later request reuses an earlier prefix: it is read (touched) again
            client.prefetch(chain(chain_id(worker, c - 2), PAGES_PER_CHAIN)).result(10)
    client.close()
    print(json.dumps(client.stats()))


if __name__ == "__main__":
    main()
