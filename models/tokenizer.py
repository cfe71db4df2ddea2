"""Text <-> token ids: ``tokenizer.json`` (or a GGUF file's tokenizer) through ``tokenizers``
when a model ships one, otherwise token ids in, token ids out."""

from __future__ import annotations

import functools
import json
import os


class Tokenizer:
    def __init__(self, path: str | None):
        """``path``: a model directory (or a tokenizer.json file, or a GGUF file or directory);
        None or no tokenizer.json means an ids-only tokenizer."""
        self._tok = None
        self.config: dict = {}
        if path is None:
            return
        from hicache_jax.models.gguf import gguf_file

        if gguf := gguf_file(path):  # vocabulary, special tokens and chat template in its metadata
            from hicache_jax.models.gguf.tokenizer import build_tokenizer

            self._tok, self.config = build_tokenizer(gguf)
            return
        file = path if path.endswith(".json") else os.path.join(path, "tokenizer.json")
        if os.path.isfile(file):
            from tokenizers import Tokenizer as HFTokenizer

            try:
                self._tok = HFTokenizer.from_file(file)
            except Exception as e:  # tokenizers raises plain Exception subclasses
                raise ValueError(f"{file}: unreadable tokenizer ({e})") from e
        cfg = os.path.join(os.path.dirname(file), "tokenizer_config.json")
        if os.path.isfile(cfg):
            with open(cfg) as f:
                self.config = json.load(f)
        # Checkpoints saved by transformers >= 4.43 (gpt-oss's among them) keep the chat
        # template in its own file; as in transformers, it wins over tokenizer_config.json's.
        template = os.path.join(os.path.dirname(file), "chat_template.jinja")
        if os.path.isfile(template):
            with open(template, encoding="utf-8") as f:
                self.config = {**(self.config or {}), "chat_template": f.read()}

    @property
    def has_text(self) -> bool:
        return self._tok is not None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Thread-safe, and other threads run meanwhile: ``encode_batch`` releases the GIL while
        it tokenizes, where ``encode`` holds it throughout (a 3 MB text held an event loop for
        2.8 s; through ``encode_batch`` its longest pause was 10 ms; tokenizers 0.23)."""
        if self._tok is None:
            raise ValueError("this model has no tokenizer.json: send input_ids instead of text")
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str | None:
        if self._tok is None:
            return None
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str | None:
        """One token's text (for logprob triples), None without a tokenizer."""
        return None if self._tok is None else self._tok.decode([token_id], skip_special_tokens=False)

    @functools.cached_property
    def max_token_bytes(self) -> int | None:
        """An upper bound on the UTF-8 bytes of text one token covers: the longest entry of
        the vocabulary as written (byte-level and byte-fallback entries spell a byte with one
        to six characters, so they over-count). None without a tokenizer."""
        if self._tok is None:
            return None
        return max(len(piece.encode("utf-8", "surrogatepass")) for piece in self._tok.get_vocab())

    def to_json(self) -> str | None:
        """The tokenizer as ``tokenizer.json`` text (for llguidance), None without one."""
        return None if self._tok is None else self._tok.to_str()

    @property
    def vocab_size(self) -> int | None:
        return None if self._tok is None else self._tok.get_vocab_size()
