"""Why a request finished: SGLang's ``meta_info.finish_reason`` (JAX-free).

A finish reason travels as a plain dict, the shape SGLang's ``/generate`` returns and its
clients read: ``{"type": "stop", "matched": <token id, string or None>}``, ``{"type":
"length", "length": <tokens>}`` or ``{"type": "abort", "message": <why>}``. Every place that
ends a request builds it with one of the functions here, and readers compare its ``type``
with ``Finish`` members (equal to the plain strings), so the vocabulary lives in one file.
"""

from __future__ import annotations

import enum


class Finish(enum.StrEnum):
    STOP = "stop"  # a stop token, EOS, a stop string, or a grammar that cannot continue
    LENGTH = "length"  # max_new_tokens, or the context length
    ABORT = "abort"  # the client, a failed row, a grammar dead end, a flush or a lost engine


def stop(matched: int | str | None) -> dict:
    """Stopped on ``matched``: a token id, a stop string, or None (a completed grammar)."""
    return {"type": Finish.STOP, "matched": matched}


def length(tokens: int) -> dict:
    """Stopped after ``tokens`` output tokens (the limit reached)."""
    return {"type": Finish.LENGTH, "length": tokens}


def abort(message: str) -> dict:
    """Ended early, for the reason ``message`` names."""
    return {"type": Finish.ABORT, "message": message}


def kind(reason: dict | None) -> Finish | None:
    """The type of a finish reason (None while the request runs)."""
    return None if reason is None else Finish(reason["type"])
