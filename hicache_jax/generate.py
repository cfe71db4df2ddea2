"""Generate from a prompt, offline.

    python -m hicache_jax.generate --prompt "Hello" [--model_path DIR] [--max_new_tokens 16]

With no ``--model_path`` the built-in tiny preset (random weights) is used, so the output
is gibberish, but every piece of the stack runs.
"""

from __future__ import annotations

import json
import sys

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model_path", None, "HF or orbax model directory; default: the tiny preset.")
flags.DEFINE_string("preset", "tiny", "Built-in preset when --model_path is not given.")
flags.DEFINE_string("prompt", "The hierarchical cache", "Prompt text.")
flags.DEFINE_list("input_ids", None, "Prompt token ids (comma-separated), instead of --prompt.")
flags.DEFINE_integer("max_new_tokens", 16, "Tokens to generate.")
flags.DEFINE_float("temperature", 0.0, "Sampling temperature (0: greedy).")
flags.DEFINE_integer("seed", 0, "Sampling seed.")


def main(argv):
    del argv
    from hicache_jax.llm import LLM
    from hicache_jax.sampling_params import InvalidRequest

    llm = LLM(model_path=FLAGS.model_path, preset=FLAGS.preset)
    sampling = {"max_new_tokens": FLAGS.max_new_tokens, "temperature": FLAGS.temperature, "seed": FLAGS.seed}
    try:
        if FLAGS.input_ids:
            ids = [int(t) for t in FLAGS.input_ids]
            out = llm.generate(input_ids=[ids], sampling_params=sampling)[0]
        else:
            out = llm.generate(prompts=[FLAGS.prompt], sampling_params=sampling)[0]
    except (InvalidRequest, ValueError) as e:  # bad input: one line, not a traceback
        sys.exit(f"generate: {e}")
    finally:
        llm.close()
    print(json.dumps(out, indent=2))


def run():
    app.run(main)


if __name__ == "__main__":
    run()
