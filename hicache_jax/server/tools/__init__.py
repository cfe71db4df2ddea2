"""OpenAI function calling: each model family's tool-call syntax in generated text, parsed
into ``tool_calls`` (``parsers``), and which family a model uses (``formats``)."""
