"""Chat messages -> prompt: the model's jinja template when it has one, else the fallback."""

from __future__ import annotations

import pytest

from hicache_jax.sampling_params import InvalidRequest
from hicache_jax.server.chat_template import ChatTemplate

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role not in ['user', 'assistant', 'system'] %}{{ raise_exception('bad role') }}{% endif %}"
    "[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)


class FakeTokenizer:
    has_text = True

    def __init__(self, config):
        self.config = config
        self.calls = []

    def encode(self, text, add_special_tokens=True):
        self.calls.append((text, add_special_tokens))
        return [1, 2, 3]


def test_model_template_renders_its_own_special_tokens():
    tok = FakeTokenizer({"chat_template": TEMPLATE, "bos_token": {"content": "<s>"}})
    chat = ChatTemplate(tok)
    assert chat.from_model
    chat.encode([{"role": "user", "content": "hi"}])
    assert tok.calls == [("<s>[user] hi\n[assistant] ", False)]  # no second BOS


def test_named_templates_pick_default():
    tok = FakeTokenizer(
        {"chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": "D"}]}
    )
    assert ChatTemplate(tok).render([{"role": "user", "content": "hi"}]) == "D"


def test_fallback_without_a_template():
    tok = FakeTokenizer({})
    chat = ChatTemplate(tok)
    text = chat.render([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    assert text == "<|system|>\ns\n<|user|>\nu\n<|assistant|>\n"
    chat.encode([{"role": "user", "content": "u"}])
    assert tok.calls[-1][1] is True  # the tokenizer's usual special tokens


def test_template_errors_are_bad_requests():
    chat = ChatTemplate(FakeTokenizer({"chat_template": TEMPLATE}))
    with pytest.raises(InvalidRequest, match="bad role"):
        chat.render([{"role": "tool", "content": "x"}])
    with pytest.raises(InvalidRequest, match="chat template"):
        ChatTemplate(FakeTokenizer({"chat_template": "{{ messages[0].content + 1 }}"})).render(
            [{"role": "user", "content": "x"}]
        )


def test_sandbox_blocks_attribute_escapes():
    evil = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(InvalidRequest):
        ChatTemplate(FakeTokenizer({"chat_template": evil})).render([{"role": "user", "content": "x"}])
