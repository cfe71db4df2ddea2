"""What a configuration needs of each chip of a TPU slice, compiled without a chip:

    python -m hicache_jax.plan --model_path DIR --topology v6e:2x4 --tp_size 8 [--json out.json]

``DIR`` needs only ``config.json``. Every server flag is accepted (a server's flagfile
too); ``--topology`` names the slice; ``--depths auto`` plans from compiles at a few
depths, extrapolated in layers (minutes, not an hour, for a deep model). Exits 1, with one
line saying by how much, when the configuration does not fit. See ``hicache_jax/tpu/planner.py``.
"""

from __future__ import annotations

import json
import sys

from absl import app, flags

from hicache_jax import flags as server_flags

FLAGS = flags.FLAGS
flags.DEFINE_string("topology", "v6e:2x4", "TPU slice to compile for: v5e:2x2, v6e:2x4, v5p:2x2x1, ...")
flags.DEFINE_string("json", None, "Also write the figures to this JSON file.")
flags.DEFINE_integer(
    "decode_context", None, "Tokens per sequence for decode costs (default: pool / running)."
)
flags.DEFINE_string(
    "depths",
    None,
    "Compile at these depths and extrapolate in layers instead of compiling at full depth: "
    "'auto' (whole periods of the layer pattern) or 'D1,D2,D3' (fit, fit, check).",
)
flags.DEFINE_string(
    "memo",
    None,
    "JSON file keeping each compiled group of figures: a rerun (after a stop, or with "
    "another --decode_context) compiles only what is missing.",
)
server_flags.define_flags(FLAGS)


def main(argv):
    del argv
    from hicache_jax.models.loader import read_hf_config, resolve_dtype
    from hicache_jax.models.presets import preset_config
    from hicache_jax.models.registry import config_from_hf
    from hicache_jax.tpu import planner
    from hicache_jax.tpu.target import target

    try:
        cfg, _ = server_flags.configs_from_flags(FLAGS)
        if cfg.model_path:
            hf = read_hf_config(cfg.model_path)
            model_cfg, dtype = config_from_hf(hf, cfg.model_path), resolve_dtype(cfg.dtype, hf)
        else:
            model_cfg, dtype = preset_config(cfg.preset), resolve_dtype(cfg.dtype)
        tgt = target(FLAGS.topology)
        log = lambda line: print(line, file=sys.stderr, flush=True)
        depths = FLAGS.depths
        if depths and depths != "auto":
            depths = tuple(int(d) for d in depths.split(","))
        p = planner.plan(
            model_cfg,
            cfg,
            tgt,
            dtype=dtype,
            decode_context=FLAGS.decode_context,
            progress=log,
            depths=depths,
            memo=FLAGS.memo,
        )
    except planner.DoesNotFit as e:
        print(e)
        return 1
    except (ValueError, RuntimeError) as e:  # bad flag, config or topology; a failed compile
        print(f"error: {e}")
        return 2
    print(planner.format_plan(p, model_cfg, cfg, tgt))
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump(p.to_json(), f, indent=1)
    return 0


def run():
    app.run(lambda argv: sys.exit(main(argv)))


if __name__ == "__main__":
    run()
