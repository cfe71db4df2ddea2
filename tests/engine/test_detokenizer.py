"""The incremental detokenizer against ``tokenizer.decode`` of the whole output: byte-level BPE
(the tiny preset's tokenizer) and a SentencePiece-style one (Metaspace, byte fallback)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_jax.engine.detokenizer import REPLACEMENT, IncrementalDetokenizer
from hicache_jax.models.presets import TOKENIZER
from hicache_jax.models.tokenizer import Tokenizer

CHARS = ["a", "b", " ", "\n", "é", "世", "界", "😀", "€", "ab"]  # 1- to 4-byte characters
SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def byte_level() -> Tokenizer:
    return Tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory) -> Tokenizer:
    """Llama-style: '▁' for spaces, unknown characters spelled as <0xNN> byte tokens."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", "a", "b", "é", "▁a", "▁b", "ab", "▁ab", "世"]:
        vocab[piece] = len(vocab)
    spec = {
        "version": "1.0",
        "added_tokens": [
            {"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False}
            | {"normalized": False, "special": True}
            for i, c in enumerate(["<unk>", "<s>", "</s>"])
        ],
        "normalizer": {
            "type": "Sequence",
            "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
            ],
        },
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0},
            ],
        },
        "model": {
            "type": "BPE",
            "unk_token": "<unk>",
            "fuse_unk": True,
            "byte_fallback": True,
            "vocab": vocab,
            "merges": ["▁ a", "▁ b", "a b", "▁a b"],
        },
    }
    path = tmp_path_factory.mktemp("sp") / "tokenizer.json"
    path.write_text(json.dumps(spec))
    return Tokenizer(str(path))


def stream(tok, ids, chunks, *, skip=True, stop=(), matched=None) -> list[str]:
    """Feed ``ids`` in pieces of the given sizes; the texts returned, the last by finish."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip, stop=stop)
    out, i = [], 0
    for n in chunks:
        if i >= len(ids):
            break
        out.append(detok.push(ids[i : i + n]))
        i += n
    out.append(detok.push(ids[i:]))
    out.append(detok.finish(matched))
    return out


sizes = st.lists(st.integers(1, 4), max_size=80)


@SETTINGS
@given(ids=st.lists(st.integers(0, 499), max_size=60), chunks=sizes, skip=st.booleans())
def test_any_ids_join_to_the_whole_decode(byte_level, ids, chunks, skip):
    """Random ids: invalid UTF-8 and special tokens included."""
    assert "".join(stream(byte_level, ids, chunks, skip=skip)) == byte_level.decode(
        ids, skip_special_tokens=skip
    )


@SETTINGS
@given(text=st.lists(st.sampled_from(CHARS), max_size=30).map("".join), chunks=sizes)
@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece"])
def test_text_never_streams_a_cut_character(request, kind, text, chunks):
    tok = request.getfixturevalue(kind)
    ids = tok.encode(text, add_special_tokens=False)
    parts = stream(tok, ids, chunks)
    assert not any(REPLACEMENT in p for p in parts)
    assert "".join(parts) == tok.decode(ids) == text


@SETTINGS
@given(
    text=st.lists(st.sampled_from(CHARS), max_size=30).map("".join),
    stops=st.lists(
        st.lists(st.sampled_from(CHARS), min_size=1, max_size=3).map("".join), min_size=1, max_size=2
    ),
    chunks=sizes,
)
def test_stop_strings_are_held_back_and_dropped(byte_level, text, stops, chunks):
    """Whatever stop string ended the request (or none), what was streamed before the end
    is a prefix of the final text, which is cut before the stop string."""
    ids = byte_level.encode(text, add_special_tokens=False)
    full = byte_level.decode(ids)
    for matched in [None, *stops]:
        final = full if matched is None or matched not in full else full[: full.find(matched)]
        parts = stream(byte_level, ids, chunks, stop=stops, matched=matched)
        assert "".join(parts[:-1]) == final[: len("".join(parts[:-1]))]
        assert "".join(parts) == final


def test_a_split_character_waits_for_its_last_byte(byte_level):
    ids = byte_level.encode("a😀", add_special_tokens=False)
    assert len(ids) >= 3 and byte_level.token_text(ids[-1]) == REPLACEMENT  # spelled in bytes
    detok = IncrementalDetokenizer(byte_level)
    got = [detok.push([i]) for i in ids]
    assert got[0] == "a" and got[-1] == "😀" and all(g == "" for g in got[1:-1])


def test_window_stays_short(byte_level):
    """The cost per token is a decode of a few tokens, whatever the output's length."""
    ids = byte_level.encode("the cache 世界 😀 " * 200, add_special_tokens=False)
    detok = IncrementalDetokenizer(byte_level)
    longest = 0
    for i in ids:
        detok.push([i])
        longest = max(longest, len(detok._window))
    assert longest <= 8
