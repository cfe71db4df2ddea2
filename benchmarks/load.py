"""Weight loading: Hugging Face safetensors vs a converted orbax checkpoint, ~100M params.

    python benchmarks/load.py [--dir /tmp/hicache_load_bench] [--repeats 3]

Makes a random-weight ~100M-parameter MistralForCausalLM with ``transformers``, converts it
with ``hicache_jax.convert``'s API, then times both load paths, each with the page cache
dropped first (``posix_fadvise(DONTNEED)`` on every file) and warm.
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


def timed(fn, path: str, cold: bool) -> float:
    if cold:
        drop_cache(path)
    t0 = time.perf_counter()
    model = fn(path)
    jax.block_until_ready(jax.tree_util.tree_leaves(__import__("flax").nnx.state(model)))
    return time.perf_counter() - t0


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
    for cold in (True, False):
        hf = min(timed(load_hf, hf_dir, cold) for _ in range(args.repeats))
        ob = min(timed(load_model, orbax_dir, cold) for _ in range(args.repeats))
        kind = "cold" if cold else "warm"
        print(f"{kind}: safetensors {hf:.2f}s, orbax {ob:.2f}s, orbax/safetensors {ob / hf:.2f}")


if __name__ == "__main__":
    main()
