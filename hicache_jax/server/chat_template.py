"""Chat messages -> prompt token ids.

With a ``chat_template`` in ``tokenizer_config.json`` the template is rendered with jinja2 in
a sandbox, as ``transformers`` does; templates write their own special tokens (``{{
bos_token }}``), so the result is tokenized without adding any. Without one (the tiny preset)
a documented fallback is used, tokenized with the tokenizer's usual special tokens:

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n
"""

from __future__ import annotations

import datetime
import json

from hicache_jax.sampling_params import InvalidRequest

FALLBACK = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _token_text(tok) -> str:
    """tokenizer_config.json writes special tokens as strings or {"content": ...}."""
    if isinstance(tok, dict):
        return tok.get("content", "")
    return tok or ""


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """Plain JSON, as templates expect. (jinja2's own ``tojson`` returns HTML-safe markup:
    it escapes ``<`` and ``>``, and text joined to it afterwards is HTML-escaped too, so
    ``x|tojson + "<|end|>"`` came out as ``...&lt;|end|&gt;``.)"""
    options = dict(ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    return json.dumps(value, **options)


def _raise(message: str):
    raise InvalidRequest(f"chat template: {message}")


class ChatTemplate:
    def __init__(self, tokenizer, source: str | None = None):
        """``source``: a template's text, in place of the model's (``--chat_template``)."""
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.tokenizer = tokenizer
        cfg = tokenizer.config or {}
        source = source or cfg.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default") or next(iter(named.values()), None)
        self.from_model = bool(source)
        self.source = source  # the template's text (``tools.formats.detect`` reads it)
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        self._template = env.from_string(source or FALLBACK)
        self._specials = {
            "bos_token": _token_text(cfg.get("bos_token")),
            "eos_token": _token_text(cfg.get("eos_token")),
        }

    def render(self, messages: list[dict], add_generation_prompt: bool = True, variables=None) -> str:
        """``variables``: extra template variables (a client's ``chat_template_kwargs``); a
        dict, not ``**kwargs``, so a client's key can never clash with a Python argument."""
        from jinja2 import TemplateError

        context = {**(variables or {}), **self._specials}
        context.update(messages=messages, add_generation_prompt=add_generation_prompt)
        try:
            return self._template.render(context)
        except InvalidRequest:
            raise
        except (TemplateError, TypeError, ValueError, LookupError, ArithmeticError, AttributeError) as e:
            # The template's fault or (with chat_template_kwargs) the client's: not the server's.
            raise InvalidRequest(f"chat template failed: {e}") from e

    def encode(self, messages: list[dict], add_generation_prompt: bool = True, variables=None) -> list[int]:
        if not self.tokenizer.has_text:
            raise InvalidRequest(
                "this model has no tokenizer.json: chat needs text; use /generate with input_ids"
            )
        text = self.render(messages, add_generation_prompt, variables)
        return self.tokenizer.encode(text, add_special_tokens=not self.from_model)
