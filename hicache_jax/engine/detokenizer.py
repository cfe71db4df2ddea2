"""Token ids -> text a few tokens at a time, for streaming.

Decoding the whole output again for every new token costs O(output length) per token. This
keeps two offsets into the output instead (as Hugging Face's and vLLM's incremental
detokenizers do) and decodes only a short window of recent tokens:

    output ids  ... | context: already text | new: not yet text |
                    ^ prefix offset         ^ read offset       ^ end
                    '------------- window (self._window) -------'

    text of the new tokens = decode(window)[len(decode(context)):]

The context is decoded again with the new tokens so that whatever depends on a neighbour (a
word's leading space in SentencePiece, a character whose UTF-8 bytes are spread over several
byte-level BPE tokens) comes out as it does in the whole text. A window whose text ends in
U+FFFD is a character still being spelled: it waits for more tokens. One that does not ends
on a whole character, so the text so far can no longer change: the read offset moves there.

Exact for byte-level BPE whatever the ids (invalid UTF-8 included) and for SentencePiece
style tokenizers (Metaspace, byte fallback) on valid UTF-8. Byte fallback turns a whole run
of byte tokens into one U+FFFD per byte once the run turns out invalid, so there a model that
emits broken UTF-8 may stream a character that the whole text shows as U+FFFD.

Stop strings: text that is, or could still grow into, a stop string is held back, because the
final text drops the stop string and all that follows (SGLang's rule, ``outputs.output_text``).
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache_jax.models.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """One request's output text, fed token ids with ``push`` and closed with ``finish``.

    The concatenation of everything returned equals ``tokenizer.decode(all ids)`` (cut before
    the matched stop string, if one ended the request). Each call decodes only the window, so
    its cost does not grow with the output."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True, stop: Sequence[str] = ()):
        if not tokenizer.has_text:
            raise ValueError("incremental detokenizing needs a tokenizer with text (tokenizer.json)")
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stop = tuple(s for s in stop if s)
        self._window: list[int] = []  # output ids from the prefix offset on
        self._read = 0  # window[:read] is context, window[read:] is not text yet
        self._context = ""  # decode(window[:read])
        self._held = ""  # text not returned yet: it may be (the start of) a stop string
        self._after_stop: list[str] = []  # a whole stop string was seen: everything waits for finish
        self.finished = False

    def push(self, ids: Sequence[int]) -> str:
        """Text completed by ``ids`` (the next output tokens); '' while a character or a
        possible stop string is unfinished."""
        if self.finished:
            raise RuntimeError("push() after finish()")
        self._window.extend(ids)
        return self._release(self._advance())

    def finish(self, matched_stop: str | None = None) -> str:
        """The rest of the text, held back or unfinished. ``matched_stop``: the stop string
        that ended the request; it and what follows are dropped."""
        if self.finished:
            raise RuntimeError("finish() called twice")
        self.finished = True
        tail = self._decode(self._window)[len(self._context) :] if len(self._window) > self._read else ""
        text = "".join([self._held, *self._after_stop, tail])
        self._held, self._after_stop, self._window = "", [], []
        if matched_stop:
            cut = text.find(matched_stop)
            if cut >= 0:
                text = text[:cut]
        return text

    # ---- helpers -------------------------------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip) or ""

    def _advance(self) -> str:
        """Turn the new tokens (or as many as are final) into text and slide the window."""
        if len(self._window) == self._read:
            return ""
        text = self._decode(self._window)
        if text.endswith(REPLACEMENT):
            return ""  # a character still being spelled (or invalid bytes that never end one)
        new = text[len(self._context) :]
        # The tokens just turned into text are the next context; older ones are dropped.
        self._window = self._window[self._read :]
        self._read = len(self._window)
        self._context = self._decode(self._window)
        return new

    def _release(self, text: str) -> str:
        """The part of ``text`` that cannot belong to a stop string; the rest is held."""
        if not self._stop or not text:
            return text
        if self._after_stop:
            self._after_stop.append(text)
            return ""
        held = self._held + text  # no whole stop string before: a match ends in ``text``
        starts = [i for i in (held.find(s) for s in self._stop) if i >= 0]
        if starts:
            cut = min(starts)
            # A longer stop string that began before ``cut`` may still complete ("aba" while
            # "b" matched in "ab"): everything from its start waits for finish too.
            open_ = [
                i for s in self._stop for i in range(cut) if len(held) - i < len(s) and s.startswith(held[i:])
            ]
            cut = min([cut, *open_])
            self._held, out = "", held[:cut]
            self._after_stop.append(held[cut:])
            return out
        keep = max((_overlap(held, s) for s in self._stop), default=0)
        self._held = held[len(held) - keep :]
        return held[: len(held) - keep]


def _overlap(text: str, stop: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``stop``."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
