"""Convert a Hugging Face checkpoint to an orbax checkpoint for fast, sharded restore.

python -m hicache_jax.convert --model_path DIR --out OUT_DIR [--dtype bfloat16]
"""

from __future__ import annotations

import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model_path", None, "Hugging Face model directory (config.json + *.safetensors).")
flags.DEFINE_string("out", None, "Output directory for the orbax checkpoint (must not exist).")
flags.DEFINE_enum("dtype", "auto", ["auto", "float32", "bfloat16", "float16"], "Parameter dtype.")
flags.mark_flags_as_required(["model_path", "out"])


def main(argv):
    del argv
    from hicache_jax.models import orbax_io
    from hicache_jax.models.loader import load_hf

    t0 = time.perf_counter()
    print(f"loading {FLAGS.model_path} ...", file=sys.stderr)
    model = load_hf(FLAGS.model_path, dtype=FLAGS.dtype)
    t1 = time.perf_counter()
    print(f"loaded in {t1 - t0:.2f}s; writing {FLAGS.out} ...", file=sys.stderr)
    orbax_io.save(model, FLAGS.out, source=FLAGS.model_path)
    print(f"wrote {FLAGS.out} in {time.perf_counter() - t1:.2f}s", file=sys.stderr)


def run():
    app.run(main)


if __name__ == "__main__":
    run()
