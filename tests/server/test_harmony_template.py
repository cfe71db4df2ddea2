"""gpt-oss's harmony chat template (the published ``chat_template.jinja``, shipped in
``tests/data``) renders through the server's jinja2 sandbox exactly as transformers renders
it: plain turns, a system prompt as the developer message, reasoning effort, function tools,
and a tool call with its result. A model directory's ``chat_template.jinja`` is picked up."""

from __future__ import annotations

import os

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from hicache_jax.models.tokenizer import Tokenizer
from hicache_jax.sampling_params import InvalidRequest
from hicache_jax.server.chat_template import ChatTemplate

TEMPLATE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "gpt_oss_chat_template.jinja")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Unit"},
                "days": {"type": "array", "items": {"type": "integer"}, "description": "Days ahead"},
            },
            "required": ["city"],
        },
    },
}
CONVERSATIONS = {
    "one turn": ([{"role": "user", "content": "Hi"}], {}),
    "system and turns": (
        [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "thinking": "simple sum"},
            {"role": "user", "content": "and 3+3?"},
        ],
        {"reasoning_effort": "high"},
    ),
    "tool call and result": (
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "thinking": "Need the weather tool.",
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
                ],
            },
            {"role": "tool", "content": '{"temp": 21}'},
        ],
        {"tools": [WEATHER], "model_identity": "You are a test model."},
    ),
}


def template_text() -> str:
    with open(TEMPLATE, encoding="utf-8") as f:
        return f.read()


class Config:
    has_text = True

    def __init__(self, config):
        self.config = config


@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_as_transformers_does(name, add_generation_prompt):
    messages, variables = CONVERSATIONS[name]
    text = template_text()
    ours = ChatTemplate(Config({"chat_template": text})).render(messages, add_generation_prompt, variables)
    extra = {k: v for k, v in variables.items() if k != "tools"}
    theirs = render_jinja_template(
        [messages],
        tools=variables.get("tools"),
        chat_template=text,
        add_generation_prompt=add_generation_prompt,
        **extra,
    )[0][0]
    assert ours == theirs
    assert ours.startswith("<|start|>system<|message|>") and ours.endswith(
        "<|start|>assistant" if add_generation_prompt else "<|end|>"
    )


def test_tool_definitions_and_calls_reach_the_prompt():
    messages, variables = CONVERSATIONS["tool call and result"]
    text = ChatTemplate(Config({"chat_template": template_text()})).render(messages, True, variables)
    assert "namespace functions {" in text and "type get_weather = (_: {" in text
    assert (
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
        in text
    )
    assert (
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"{\\"temp\\": 21}"<|end|>'
        in text
    )


def test_template_refusals_are_bad_requests():
    chat = ChatTemplate(Config({"chat_template": template_text()}))
    with pytest.raises(InvalidRequest, match="no previous assistant message with a tool call"):
        chat.render([{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}])


def test_chat_template_jinja_beside_the_tokenizer_is_used(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel

    HFTokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "old"}')
    (tmp_path / "chat_template.jinja").write_text(template_text(), encoding="utf-8")
    chat = ChatTemplate(Tokenizer(str(tmp_path)))
    assert chat.from_model
    assert chat.render([{"role": "user", "content": "Hi"}]).endswith(
        "<|start|>user<|message|>Hi<|end|><|start|>assistant"
    )
