"""Text for the agent workload: a system prompt, a list of function tools with JSON-schema
parameters, and short user turns, all made of words drawn with a seed; and, where the
benchmark can, the prompt the server renders from them, as token ids.

The chat route takes messages, not ids, so the benchmark sends text. To compare a run with
its theoretical maximum it still needs each prompt's ids: ``LocalChat`` renders the messages
and tools with the server's chat template and tokenizer when both can be found on this
machine (a preset's tokenizer, or a model directory's ``tokenizer.json``; the template from
``--chat_template`` in the server's flags, else the tokenizer's). Each request's rendering
is checked against the prompt tokens the server reports; one that differs is not used
(``client.BenchClient.chat``).
"""

from __future__ import annotations

import json
import os
import shlex

import numpy as np

# Ordinary English words, the material of every text. Tool and parameter names are made of
# them too, so the JSON reads like a real tool list (``search_invoice(customer, limit)``).
VERBS = tuple(
    """
    get list search create update delete send fetch find check cancel book convert translate
    summarize compute lookup export import archive restore approve reject assign merge split
    validate estimate track notify upload download resize rename share
    """.split()
)
NOUNS = tuple(
    """
    account address agenda alert answer article asset balance batch booking branch budget
    calendar campaign card cart channel city comment contact contract country coupon
    currency customer dashboard date deadline device discount document domain draft email
    event expense file flight folder forecast group hotel image incident invoice issue item
    job label language lead ledger limit link location meeting member message metric note
    order owner package page payment period permission phone photo plan policy price
    priority product profile project query quote rate receipt record region reminder report
    request reservation review role room route schedule score section sensor server service
    session shipment size source status stock subject subscription summary supplier table
    tag task team template ticket timezone title topic total trip unit user vendor version
    warehouse weather window workflow
    """.split()
)
_OTHER = tuple(
    """
    a about after all always an and any are as at be before best between both but by can
    careful clear current each early every exact few first for from full given good has have
    helpful if in into is it its last late least less local long many may more most must
    never new next no not of old on one only or other our over own please polite precise
    private public quick recent same short should small some such than that the their then
    there these this those through to today tomorrow under until up use used useful valid
    very was we weekly what when where which while who will with within without would you
    your
    """.split()
)
WORDS = VERBS + NOUNS + _OTHER


def _sentences(rng: np.random.Generator, n_words: int) -> str:
    """``n_words`` words in sentences of 6-14 words: capitalized, ending in a period."""
    words = rng.choice(WORDS, n_words).tolist()
    out, k = [], 0
    while k < len(words):
        m = int(rng.integers(6, 15))
        s = words[k : k + m]
        out.append(" ".join([s[0].capitalize(), *s[1:]]) + ".")
        k += m
    return " ".join(out)


def system_prompt(rng: np.random.Generator, n_words: int) -> str:
    return _sentences(rng, n_words)


def user_turn(rng: np.random.Generator, n_words: int) -> str:
    return _sentences(rng, n_words)


def _parameter(rng: np.random.Generator, depth: int = 0) -> dict:
    """One parameter's JSON schema, with a description; now and then an enum, a bounded
    integer, an array, or (at the top level) an object of two fields."""
    kinds = ["string", "string", "string", "enum", "integer", "number", "boolean", "array"]
    kinds += ["object"] if depth == 0 else []
    kind = kinds[int(rng.integers(len(kinds)))]
    desc = _sentences(rng, int(rng.integers(3, 8)))
    if kind == "enum":
        return {"type": "string", "enum": rng.choice(NOUNS, 3, replace=False).tolist(), "description": desc}
    if kind == "integer":
        return {"type": "integer", "minimum": 0, "maximum": int(rng.integers(10, 1000)), "description": desc}
    if kind == "array":
        return {"type": "array", "items": {"type": "string"}, "description": desc}
    if kind == "object":
        names = rng.choice(NOUNS, 2, replace=False).tolist()
        props = {n: _parameter(rng, depth + 1) for n in names}
        return {"type": "object", "properties": props, "required": names[:1], "description": desc}
    return {"type": kind, "description": desc}


def tool_list(rng: np.random.Generator, n_tools: int) -> list[dict]:
    """``n_tools`` OpenAI function tools with unique ``verb_noun`` names, a description of
    6-16 words and 1-3 parameters (the first one or two required): about 350 characters of
    JSON each, as the examples in OpenAI's function-calling guide."""
    names: list[str] = []
    while len(names) < n_tools:
        name = f"{rng.choice(VERBS)}_{rng.choice(NOUNS)}"
        if name not in names:
            names.append(name)
    tools = []
    for name in names:
        params = rng.choice(NOUNS, int(rng.integers(1, 4)), replace=False).tolist()
        schema = {
            "type": "object",
            "properties": {p: _parameter(rng) for p in params},
            "required": params[: int(rng.integers(1, 3))],
        }
        desc = _sentences(rng, int(rng.integers(6, 17)))
        fn = {"name": name, "description": desc, "parameters": schema}
        tools.append({"type": "function", "function": fn})
    return tools


# ---- the server's rendering, on this machine ----------------------------------------------
class _JsonTokenizer:
    """What ``ChatTemplate`` needs of a tokenizer, from a ``tokenizer.json`` (and the
    directory's ``tokenizer_config.json`` and ``chat_template.jinja``), as the server's
    ``models/tokenizer.py`` reads them, without importing the model code (and JAX)."""

    has_text = True

    def __init__(self, file: str):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(file)
        self.config: dict = {}
        cfg = os.path.join(os.path.dirname(file), "tokenizer_config.json")
        if os.path.isfile(cfg):
            with open(cfg) as f:
                self.config = json.load(f)
        template = os.path.join(os.path.dirname(file), "chat_template.jinja")
        if os.path.isfile(template):
            with open(template, encoding="utf-8") as f:
                self.config = {**self.config, "chat_template": f.read()}

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids


def _preset_tokenizer() -> str:
    import hicache_jax

    return os.path.join(os.path.dirname(hicache_jax.__file__), "assets", "tiny_tokenizer.json")


def flag_value(args: list[str] | tuple[str, ...], name: str, _depth: int = 0) -> str | None:
    """The last value of ``--name`` in command-line ``args``, ``--flagfile`` contents
    included (as absl reads them: a later flag wins)."""
    value = None
    it = iter(args)
    for a in it:
        if not a.startswith("--"):
            continue
        key, eq, v = a[2:].partition("=")
        if not eq and key in (name, "flagfile"):
            v = next(it, "")
        if key == name:
            value = v
        elif key == "flagfile" and _depth < 8 and os.path.isfile(v):
            with open(v) as f:
                lines = [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith(("#", "//"))]
            inner = flag_value([t for ln in lines for t in shlex.split(ln)], name, _depth + 1)
            value = inner if inner is not None else value
    return value


class LocalChat:
    """The server's prompt for a chat request, as ids: its template on its tokenizer."""

    def __init__(self, tokenizer, template_source: str | None):
        from hicache_jax.server.chat_template import ChatTemplate

        self.chat = ChatTemplate(tokenizer, template_source)

    def encode(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        return self.chat.encode(messages, True, {"tools": tools} if tools else None)

    @classmethod
    def find(cls, model_info: dict, server_flags: tuple[str, ...] = ()) -> LocalChat | None:
        """For the server described by ``/get_model_info`` and started with ``server_flags``:
        None where its tokenizer is not a ``tokenizer.json`` on this machine. (A server the
        benchmark did not start may have been given another ``--chat_template``: the check
        against the server's prompt counts catches that.)"""
        if not model_info.get("has_tokenizer"):
            return None
        path = model_info.get("tokenizer_path")
        if path is None and model_info.get("preset"):
            file = _preset_tokenizer()
        elif path and os.path.isfile(os.path.join(path, "tokenizer.json")):
            file = os.path.join(path, "tokenizer.json")
        else:
            return None
        template = flag_value(server_flags, "chat_template")
        try:
            source = None
            if template:
                with open(template, encoding="utf-8") as f:
                    source = f.read()
            return cls(_JsonTokenizer(file), source)
        except Exception:  # a file this machine cannot read, or a template jinja refuses
            return None
