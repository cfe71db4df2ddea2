"""A ``tokenizers.Tokenizer`` from a GGUF file's ``tokenizer.ggml.*`` metadata.

GGUF has no ``tokenizer.json``: it stores the vocabulary, merges (or scores), token types
and special ids, and names the tokenizer's family in ``tokenizer.ggml.model``:

- ``gpt2``: byte-level BPE with merges; ``tokenizer.ggml.pre`` names how text is split first;
- ``llama``: SentencePiece BPE with byte fallback; merges, when absent, follow from the scores.

The chat template and special tokens become the ``tokenizer_config.json`` dict that
``Tokenizer.config`` holds for a Hugging Face directory, so chat works unchanged.
"""

from __future__ import annotations

import json
import logging
import os

from hicache_jax.models.gguf.reader import field, open_gguf
from hicache_jax.models.hf.safetensors_io import CheckpointError

log = logging.getLogger(__name__)

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types
SPACE = "\u2581"  # SentencePiece's visible space

# tokenizer.ggml.pre -> the split applied before byte-level BPE (llama.cpp's pre-tokenizers).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGITS_THEN_GPT2 = "digits+gpt2"  # SmolLM: every digit alone, then GPT-2's split
SPLITS = {
    "default": _GPT2_SPLIT,
    "gpt2": _GPT2_SPLIT,
    "smollm": _DIGITS_THEN_GPT2,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
}


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (printable Latin-1 bytes map to themselves,
    the rest to code points from 256 up, in byte order)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _meta(reader, path: str) -> dict:
    g = lambda key, default=None: field(reader, f"tokenizer.{key}", default, path=path)  # noqa: E731
    tokens = g("ggml.tokens")
    if not tokens:
        raise CheckpointError(f"{path}: GGUF metadata has no tokenizer.ggml.tokens (no tokenizer)")
    return dict(
        model=g("ggml.model"),
        pre=g("ggml.pre", "default"),
        tokens=list(tokens),
        types=list(g("ggml.token_type", []) or []),
        scores=list(g("ggml.scores", []) or []),
        merges=g("ggml.merges"),
        bos=g("ggml.bos_token_id"),
        eos=g("ggml.eos_token_id"),
        unk=g("ggml.unknown_token_id"),
        pad=g("ggml.padding_token_id"),
        add_bos=g("ggml.add_bos_token"),
        add_eos=g("ggml.add_eos_token", False),
        add_space_prefix=g("ggml.add_space_prefix"),
        chat_template=g("chat_template"),
        arch=field(reader, "general.architecture", path=path),
    )


def _byte_level(m: dict, path: str):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    table = byte_alphabet()
    alphabet = set(table.values())
    # Tokens outside the byte alphabet (a mislabelled special token) are spelled through it,
    # so the vocabulary keeps one entry per id.
    spelled = [t if set(t) <= alphabet else "".join(table[b] for b in t.encode()) for t in m["tokens"]]
    merges = [tuple(x.split(" ", 1)) for x in (m["merges"] or [])]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(spelled)}, merges=merges, fuse_unk=False))
    split = SPLITS.get(m["pre"])
    if split is None:
        log.warning("%s: pre-tokenizer %r is unknown here; splitting as GPT-2 does", path, m["pre"])
        split = _GPT2_SPLIT
    steps = []
    if split == _DIGITS_THEN_GPT2:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
        split = _GPT2_SPLIT
    steps += [
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    return tok, spelled


def sentencepiece_merges(tokens: list[str], rank: dict[str, float]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece BPE vocabulary: every split of a token into two
    tokens, best ``rank`` (higher first) of the merged token first."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for t in tokens:
        pieces = [
            (vocab[t[:k]], vocab[t[k:]], t[:k], t[k:])
            for k in range(1, len(t))
            if t[:k] in vocab and t[k:] in vocab
        ]
        found += [(-rank[t], a, b, left, right) for a, b, left, right in sorted(pieces)]
    found.sort(key=lambda x: x[0])  # stable: a token's own splits keep their id order
    return [(left, right) for _, _, _, left, right in found]


def _sentencepiece(m: dict, path: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens = list(m["tokens"])
    gemma = str(m["arch"]).startswith("gemma")
    if gemma:  # Gemma stores whitespace-only tokens with real spaces; the model sees SPACE
        tokens = [SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
    if m["merges"]:
        merges = [tuple(x.split(" ", 1)) for x in m["merges"]]
    else:
        # Gemma's scores do not follow its merge order; its token order does.
        rank = (
            {t: -i for i, t in enumerate(tokens)}
            if gemma or not m["scores"]
            else dict(zip(tokens, m["scores"]))
        )
        merges = sentencepiece_merges(tokens, rank)
    unk = tokens[m["unk"]] if m["unk"] is not None else None
    tok = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=merges,
            unk_token=unk,
            byte_fallback=True,
            fuse_unk=True,
        )
    )
    prefix = m["add_space_prefix"] if m["add_space_prefix"] is not None else not gemma
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPACE, prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok, tokens


def build_tokenizer(path: str):
    """``(tokenizers.Tokenizer, tokenizer_config dict)`` for the GGUF file at ``path``
    (``(None, {})`` when it has no vocabulary)."""
    from tokenizers import AddedToken, processors

    reader = open_gguf(path)
    if "tokenizer.ggml.tokens" not in reader.fields:
        return None, {}  # no vocabulary: an ids-only model, as a directory without tokenizer.json
    m = _meta(reader, path)
    if m["model"] == "gpt2":
        tok, spelled = _byte_level(m, path)
    elif m["model"] == "llama":
        tok, spelled = _sentencepiece(m, path)
    else:
        raise CheckpointError(f"{path}: tokenizer.ggml.model {m['model']!r} is not supported (gpt2, llama)")
    types = m["types"]
    alphabet = set(byte_alphabet().values()) if m["model"] == "gpt2" else None
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(spelled, types)
        if kind == CONTROL and (alphabet is None or set(t) <= alphabet)
    ]
    tok.add_special_tokens(special)
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in zip(spelled, types) if k == USER_DEFINED]
    )

    def text(i):
        return spelled[i] if i is not None and 0 <= i < len(spelled) else None

    add_bos = m["add_bos"] if m["add_bos"] is not None else m["model"] == "llama"
    bos, eos = text(m["bos"]), text(m["eos"])
    single, pairs = "$A", []
    if add_bos and bos is not None:
        single, pairs = f"{bos} $A", [(bos, m["bos"])]
    if m["add_eos"] and eos is not None:
        single, pairs = f"{single} {eos}", [*pairs, (eos, m["eos"])]
    if pairs:
        tok.post_processor = processors.TemplateProcessing(
            single=single, special_tokens=list(dict.fromkeys(pairs))
        )
    config = {
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": text(m["unk"]),
        "pad_token": text(m["pad"]),
        "add_bos_token": bool(add_bos),
        "add_eos_token": bool(m["add_eos"]),
    }
    if m["chat_template"]:
        config["chat_template"] = m["chat_template"]
    return tok, config


def write_tokenizer_files(path: str, out_dir: str) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` for a GGUF, so a converted orbax
    directory serves text without the GGUF beside it."""
    tok, config = build_tokenizer(path)
    if tok is None:
        return
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
