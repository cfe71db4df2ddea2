"""A process that rewrites and reads shared pages of one file store (for the two-process test).

Usage: python -m tests.storage._rw_worker STORE_DIR WRITER_ID SECONDS
Both workers start together (each marks itself ready, then waits for the other: start-up
time under load must not eat the run), then run for SECONDS and at least MIN_ROUNDS rounds.
Prints one JSON line: reads, missing, corrupt, torn, foreign (pages written by the other).
"""

import json
import os
import sys
import time

import numpy as np

from hicache_jax.storage.codec import CorruptPage, decode_page, encode_page
from hicache_jax.storage.tensorstore_store import TensorStoreL3

FP = "00112233445566aa"
KEYS = [f"{i:064x}.kv" for i in range(6)]
PAGE_ELEMS = 64 * 1024  # 256 KiB of float32: big enough that writes take a while
WRITERS = (1, 2)
MIN_ROUNDS = 5


def wait_for_each_other(store_dir: str, writer_id: int, timeout: float = 300.0) -> None:
    open(f"{store_dir}.ready{writer_id}", "w").close()
    deadline = time.time() + timeout
    while not all(os.path.exists(f"{store_dir}.ready{w}") for w in WRITERS):
        if time.time() > deadline:
            raise SystemExit("the other worker never became ready")
        time.sleep(0.01)


def main() -> None:
    store_dir, writer_id, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    store = TensorStoreL3(store_dir)
    counts = dict(reads=0, missing=0, corrupt=0, torn=0, foreign=0, writes=0)
    version = 0
    wait_for_each_other(store_dir, writer_id)
    deadline = time.time() + seconds
    while time.time() < deadline or version < MIN_ROUNDS:
        version += 1
        stamp = float(writer_id * 1_000_000 + version)
        # force=True: overwrite the same keys the other process writes.
        store.put(
            [(k, encode_page({"x": np.full(PAGE_ELEMS, stamp, np.float32)}, FP, k)) for k in KEYS],
            force=True,
        )
        counts["writes"] += len(KEYS)
        for key, value in zip(KEYS, store.get(KEYS), strict=True):
            if value is None:
                counts["missing"] += 1
                continue
            try:
                x = decode_page(value, FP, key)["x"]
            except CorruptPage:
                counts["corrupt"] += 1
                continue
            counts["reads"] += 1
            # A torn value would mix two stamps even if it somehow passed the checksum.
            if x.min() != x.max():
                counts["torn"] += 1
            if int(x[0]) // 1_000_000 != writer_id:
                counts["foreign"] += 1
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
