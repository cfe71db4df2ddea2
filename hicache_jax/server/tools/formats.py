"""The tool-call formats we parse, their names on SGLang's and vLLM's ``--tool-call-parser``
flag (so a launch command carries over unchanged), and guessing the format from a model's
chat template when no flag names it."""

from __future__ import annotations

import enum


class ToolFormat(enum.StrEnum):
    LLAMA3_JSON = "llama3_json"  # Llama 3.1-3.3 (and 4's JSON mode): bare {"name", "parameters"}
    MISTRAL = "mistral"  # [TOOL_CALLS][...] (v3) or [TOOL_CALLS]name[ARGS]{...} (v11+)
    HERMES = "hermes"  # Hermes, Qwen 2.5 / 3: <tool_call>{...}</tool_call> blocks
    HARMONY = "harmony"  # gpt-oss: messages to=functions.NAME on the commentary channel


PARSER_NAMES: dict[str, ToolFormat] = {
    # SGLang
    "llama3": ToolFormat.LLAMA3_JSON,
    "mistral": ToolFormat.MISTRAL,
    "qwen": ToolFormat.HERMES,
    "qwen25": ToolFormat.HERMES,
    "gpt-oss": ToolFormat.HARMONY,
    # vLLM
    "llama3_json": ToolFormat.LLAMA3_JSON,
    "llama4_json": ToolFormat.LLAMA3_JSON,
    "hermes": ToolFormat.HERMES,
    "openai": ToolFormat.HARMONY,
    # ours
    "qwen3": ToolFormat.HERMES,
    "harmony": ToolFormat.HARMONY,
}


def from_name(name: str) -> ToolFormat:
    """A ``--tool-call-parser`` value -> its format; an unknown name lists the known ones, since
    the usual mistake is another server's spelling or a family we do not parse."""
    try:
        return PARSER_NAMES[name]
    except KeyError:
        known = ", ".join(sorted(PARSER_NAMES))
        raise ValueError(f"unknown tool-call parser {name!r}; known: {known}") from None


# Checked in this order: a template may mention another family's words in passing (a role
# named "ipython", say), so the most distinctive marker wins, harmony's first.
_MARKERS: tuple[tuple[str, ToolFormat], ...] = (
    ("<|channel|>", ToolFormat.HARMONY),
    ("[TOOL_CALLS]", ToolFormat.MISTRAL),
    ("<tool_call>", ToolFormat.HERMES),
    ("<|python_tag|>", ToolFormat.LLAMA3_JSON),
    ("ipython", ToolFormat.LLAMA3_JSON),
)


def detect(template: str | None) -> ToolFormat | None:
    """The format a chat template's source text writes tool calls in, or None when it shows no
    known marker (the server then has no default and needs the flag)."""
    if not template:
        return None
    for marker, fmt in _MARKERS:
        if marker in template:
            return fmt
    return None


def needs_special_tokens(fmt: ToolFormat) -> bool:
    """Whether the format's markers are special tokens, which decoding normally drops: the
    text must then be decoded with them kept, or there is nothing to find. Hermes' tags are
    plain text, or (Qwen) added tokens that are not special, so decoding keeps them; Llama's
    ``<|python_tag|>`` is optional, its calls are bare JSON."""
    return fmt in (ToolFormat.HARMONY, ToolFormat.MISTRAL)
