"""Convert a Hugging Face (or GGUF) checkpoint to an orbax checkpoint for fast, sharded restore.

python -m hicache_jax.convert --model_path DIR --out OUT_DIR [--dtype bfloat16]
"""

from __future__ import annotations

import sys
import time

from absl import app, flags

from hicache_jax import progress

FLAGS = flags.FLAGS
flags.DEFINE_string(
    "model_path",
    None,
    "Hugging Face model directory (config.json + *.safetensors), GGUF file, or Hub id (org/name).",
)
flags.DEFINE_string("revision", None, "Hub branch, tag or commit for a --model_path model id.")
flags.DEFINE_string("out", None, "Output directory for the orbax checkpoint (must not exist).")
flags.DEFINE_enum("dtype", "auto", ["auto", "float32", "bfloat16", "float16"], "Parameter dtype.")
flags.mark_flags_as_required(["model_path", "out"])


def main(argv):
    del argv
    from hicache_jax.hub import resolve_model_path
    from hicache_jax.models import orbax_io
    from hicache_jax.models.loader import load_hf

    t0 = time.perf_counter()
    source = resolve_model_path(FLAGS.model_path, FLAGS.revision)  # a Hub id: its cached snapshot
    with progress.bar(total=2, desc="converting", unit="phase") as phases:
        print(f"loading {source} ...", file=sys.stderr)
        model = load_hf(source, dtype=FLAGS.dtype)
        t1 = time.perf_counter()
        phases.update()
        print(f"loaded in {t1 - t0:.2f}s; writing {FLAGS.out} ...", file=sys.stderr)
        orbax_io.save(model, FLAGS.out, source=source)
        phases.update()
    print(f"wrote {FLAGS.out} in {time.perf_counter() - t1:.2f}s", file=sys.stderr)


def run():
    app.run(main)


if __name__ == "__main__":
    run()
