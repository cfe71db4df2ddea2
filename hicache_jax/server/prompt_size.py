"""Refusing, before any work, what cannot fit; tokenizing off the event loop and the engine.

Two bounds come from the model and the server's flags, so nothing a client sends costs more
than what could be served:

- **A request body** is at most ``BODY_BYTES_PER_TOKEN`` bytes per token the waiting queue
  can hold (``--max_queued_tokens``), within [``MIN_BODY_BYTES``, 64 MiB]: a larger body
  holds more prompt than the queue could ever take. Parsing JSON holds the GIL (pydantic
  parsed 63 MB of token ids in 0.8 s here), so the bound is also what keeps ``/health``
  answering while a large body is parsed.
- **A prompt's text** is refused before it is tokenized when its UTF-8 bytes exceed
  ``context length x the longest vocabulary entry's bytes``: no tokenization of it can fit
  the context (each token covers at most that many bytes; a normalizer that shrinks text,
  which no served family has, is the one way around it).

Tokenization runs on a worker thread and releases the GIL (``Tokenizer.encode``), so neither
the event loop nor the engine thread waits for it; texts reach the engine as token ids.
"""

from __future__ import annotations

import asyncio

from hicache_jax.sampling_params import InvalidRequest

BODY_BYTES_PER_TOKEN = 32  # JSON of a token id is ~7 bytes; of text, ~4-24 (escapes)
MIN_BODY_BYTES = 1 << 20
MAX_BODY_BYTES = 64 << 20


def body_limit(queued_tokens: int) -> int:
    """The largest request body a server whose queue holds ``queued_tokens`` accepts."""
    return min(MAX_BODY_BYTES, max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * queued_tokens))


def text_limit(context_len: int, tokenizer) -> int | None:
    """The most UTF-8 bytes of text a prompt may have (None: the model takes no text)."""
    longest = tokenizer.max_token_bytes if tokenizer.has_text else None
    return None if longest is None else context_len * longest


def utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def check_text(nbytes: int, limit: int | None, field: str) -> None:
    """InvalidRequest naming ``field`` when ``nbytes`` of text cannot fit the context."""
    if limit is not None and nbytes > limit:
        raise InvalidRequest(
            f"{field} is {nbytes} bytes of text, more than the context could hold "
            f"({limit} bytes: context length x the longest token); it was not tokenized"
        )


async def tokenize_texts(requests: list[dict], tokenizer, limit: int | None) -> None:
    """Replace each engine request's ``text`` by its ``input_ids`` (the engine's own
    tokenization, done here on a worker thread); a request of several prompts names each."""
    many = len(requests) > 1
    done: dict[str, list[int]] = {}  # the n choices of a prompt share its text: tokenized once
    for i, req in enumerate(requests):
        text = req.get("text")
        if not isinstance(text, str) or req.get("input_ids") is not None or not tokenizer.has_text:
            continue  # the engine refuses what is malformed, with its own message
        if text not in done:
            check_text(utf8_len(text), limit, f"text[{i}]" if many else "text")
            done[text] = await asyncio.to_thread(tokenizer.encode, text)
        req["input_ids"] = done[text]
        del req["text"]
