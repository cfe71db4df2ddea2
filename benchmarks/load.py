"""Weight loading: Hugging Face safetensors vs a converted orbax checkpoint, ~100M params.

    python benchmarks/load.py [--dir /tmp/hicache_load_bench] [--repeats 3]

Makes a random-weight ~100M-parameter MistralForCausalLM with ``transformers``, converts it
with ``hicache_jax.convert``'s API, then times both load paths, each with the page cache
dropped first (``posix_fadvise(DONTNEED)`` on every file) and warm.

It also prices the weights fingerprint (L3 namespace): ``safetensors first`` is a load with
no digest remembered (every weight byte is hashed alongside the load), ``safetensors`` a
load that finds them in the sidecar; ``fingerprint`` times the hash alone and a remembered
look-up.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time

import jax


def make_checkpoint(path: str) -> None:
    import torch
    import transformers as tf

    cfg = tf.MistralConfig(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        sliding_window=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = tf.MistralForCausalLM(cfg)
    print(f"checkpoint: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    model.save_pretrained(path)


def drop_cache(path: str) -> None:
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timed(fn, path: str, cold: bool, before=None) -> float:
    if before is not None:
        before()
    if cold:
        drop_cache(path)
    t0 = time.perf_counter()
    model = fn(path)
    jax.block_until_ready(jax.tree_util.tree_leaves(__import__("flax").nnx.state(model)))
    return time.perf_counter() - t0


def forget_digests(path: str) -> None:
    from hicache_jax.models import file_digest

    file_digest.forget(path)


def fingerprint_times(path: str, cold: bool, repeats: int) -> tuple[float, float]:
    """(hash every byte, look up the remembered digests) in seconds, best of ``repeats``."""
    from hicache_jax.models import file_digest
    from hicache_jax.models.fingerprint import checkpoint_fingerprint

    first, again = [], []
    for _ in range(repeats):
        forget_digests(path)
        if cold:
            drop_cache(path)
        t0 = time.perf_counter()
        fp = checkpoint_fingerprint(path)
        t1 = time.perf_counter()
        file_digest.forget()  # a new process: only the sidecar remembers
        assert checkpoint_fingerprint(path) == fp
        first.append(t1 - t0)
        again.append(time.perf_counter() - t1)
    return min(first), min(again)


def main():
    from hicache_jax.models import orbax_io
    from hicache_jax.models.loader import load_hf, load_model

    p = argparse.ArgumentParser()
    p.add_argument("--dir", default="/tmp/hicache_load_bench")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    hf_dir, orbax_dir = os.path.join(args.dir, "hf"), os.path.join(args.dir, "orbax")
    if not os.path.exists(hf_dir):
        make_checkpoint(hf_dir)
    shutil.rmtree(orbax_dir, ignore_errors=True)
    t0 = time.perf_counter()
    orbax_io.save(load_hf(hf_dir), orbax_dir, source=hf_dir)
    print(f"convert: {time.perf_counter() - t0:.2f}s")
    shards = [n for n in os.listdir(hf_dir) if n.endswith(".safetensors")]
    weights = sum(os.path.getsize(os.path.join(hf_dir, n)) for n in shards)
    for cold in (True, False):
        hf = min(timed(load_hf, hf_dir, cold) for _ in range(args.repeats))
        first = min(
            timed(load_hf, hf_dir, cold, before=lambda: forget_digests(hf_dir)) for _ in range(args.repeats)
        )
        ob = min(timed(load_model, orbax_dir, cold) for _ in range(args.repeats))
        fp, again = fingerprint_times(hf_dir, cold, args.repeats)
        kind = "cold" if cold else "warm"
        print(
            f"{kind}: safetensors {hf:.2f}s (first {first:.2f}s, {first - hf:+.2f}s), orbax {ob:.2f}s, "
            f"orbax/safetensors {ob / hf:.2f}; fingerprint alone {fp:.2f}s "
            f"({weights / fp / 1e9:.2f} GB/s), remembered {again * 1e3:.1f} ms"
        )


if __name__ == "__main__":
    main()
