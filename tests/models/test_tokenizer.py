"""tokenizer.json when the model has one; token ids in and out when it does not."""

import os
import shutil

import pytest

from hicache_jax import LLM
from hicache_jax.models.presets import TOKENIZER
from hicache_jax.models.tokenizer import Tokenizer
from hicache_jax.sampling_params import InvalidRequest


def test_tokenizer_json_round_trip(tmp_path):
    shutil.copy(TOKENIZER, tmp_path / "tokenizer.json")
    tok = Tokenizer(str(tmp_path))
    assert tok.has_text
    text = "Pages flow from L1 to L2 to L3, ünïcode too."
    ids = tok.encode(text)
    assert ids and all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == text


def test_without_tokenizer_ids_in_ids_out(checkpoint_dir):
    path = checkpoint_dir("llama")  # transformers saved no tokenizer here
    tok = Tokenizer(path)
    assert not tok.has_text and tok.decode([1, 2]) is None
    llm = LLM(model_path=path, dtype="float32")
    out = llm.generate(input_ids=[[5, 6, 7]], sampling_params={"max_new_tokens": 3, "ignore_eos": True})[0]
    assert out["text"] is None and len(out["output_ids"]) == 3
    with pytest.raises(InvalidRequest, match="no tokenizer.json"):
        llm.generate(prompts=["hello"])


def test_preset_generates_text():
    out = LLM().generate(prompts=["The cache"], sampling_params={"max_new_tokens": 4, "ignore_eos": True})[0]
    assert isinstance(out["text"], str) and len(out["output_ids"]) == 4


def test_encoding_lets_other_threads_run():
    """Issue 39, finding 3: ``encode`` held the GIL for as long as it tokenized (an event loop
    stalled 2.8 s on 3 MB); the server tokenizes on a worker thread, which is only worth it if
    the event loop runs meanwhile. Its longest pause must be a fraction of the work."""
    import asyncio
    import time

    tok = Tokenizer(TOKENIZER)
    with open(os.path.join(os.path.dirname(__file__), "..", "data", "english.txt")) as f:
        text = f.read()
    big = (text * (1_500_000 // len(text) + 1))[:1_500_000]

    async def longest_pause() -> tuple[float, float, list[int]]:
        work = asyncio.ensure_future(asyncio.to_thread(tok.encode, big))
        t0 = last = time.perf_counter()
        worst = 0.0
        while not work.done():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            worst, last = max(worst, now - last), now
        return worst, time.perf_counter() - t0, work.result()

    worst, total, ids = asyncio.run(longest_pause())
    assert worst < 0.5 * total, (worst, total)
    assert ids == tok._tok.encode(big).ids  # the same ids as the plain call
