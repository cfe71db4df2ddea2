"""Structured output: grammars (JSON schema, regex, EBNF, structural tags) compiled by
llguidance, and the per-row token bitmasks the jitted sampler applies."""
