"""What the HTTP handlers share: the engine loop and facts fixed at start-up.

Handlers read only these; nothing here is the engine itself, except the tokenizer, which
chat uses to tokenize rendered templates (encoding is read-only and thread-safe).
"""

from __future__ import annotations

import dataclasses
import time

from hicache_jax.config import EngineConfig
from hicache_jax.server import prompt_size
from hicache_jax.server.chat_template import ChatTemplate
from hicache_jax.server.config import ServerConfig
from hicache_jax.server.disaggregation import Disaggregation
from hicache_jax.server.engine_loop import EngineLoop
from hicache_jax.server.tools.formats import ToolFormat, detect, from_name


@dataclasses.dataclass
class ServerState:
    loop: EngineLoop
    engine_cfg: EngineConfig
    server_cfg: ServerConfig
    model_info: dict  # GET /model_info
    chat: ChatTemplate
    served_model_name: str
    context_len: int
    max_request_tokens: int  # prompt + completion: min(context, device KV pool)
    devices: list[str]
    max_body_bytes: int = prompt_size.MAX_BODY_BYTES  # a request body (prompt_size.py)
    max_text_bytes: int | None = None  # a prompt's text, before it is tokenized (None: no bound)
    tool_format: ToolFormat | None = None  # how tool_choice=auto output is parsed
    pd: Disaggregation = dataclasses.field(default_factory=lambda: Disaggregation("null", 1.0))
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @classmethod
    def from_engine(cls, engine, loop: EngineLoop, server_cfg: ServerConfig) -> ServerState:
        import jax

        cfg: EngineConfig = engine.cfg
        mc = engine.model.cfg
        name = server_cfg.served_model_name or cfg.model_path or cfg.preset
        info = {  # SGLang's /model_info fields first (sglang-router reads them), then ours
            "model_path": cfg.model_path,
            "tokenizer_path": cfg.model_path,
            "is_generation": True,
            "architectures": [mc.architecture],
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "weight_version": "default",
            "preset": None if cfg.model_path else cfg.preset,
            "served_model_name": name,
            "architecture": mc.architecture,
            "vocab_size": mc.vocab_size,
            "context_length": engine.context_len,
            "layer_kinds": list(mc.layer_kinds),
            "sliding_window": mc.sliding_window,
            "page_size": cfg.page_size,
            "has_tokenizer": engine.tokenizer.has_text,
            "eos_token_ids": list(mc.eos_token_ids),
            # The pages' dtype (--kv_cache_dtype resolved: auto is the model's) and the device
            # bytes a token takes in every paged layer at it, every head (also /server_info).
            "kv_cache_dtype": str(engine.model.kv_dtype),
            "kv_bytes_per_token": engine.runner.kv_bytes_per_token(),
            "disaggregation_mode": cfg.disaggregation_mode,  # this server's PD role (also /server_info)
        }
        source = None
        if server_cfg.chat_template:
            with open(server_cfg.chat_template, encoding="utf-8") as f:
                source = f.read()
        chat = ChatTemplate(engine.tokenizer, source)
        info["has_chat_template"] = chat.from_model
        return cls(
            loop=loop,
            engine_cfg=cfg,
            server_cfg=server_cfg,
            model_info=info,
            chat=chat,
            served_model_name=name,
            context_len=engine.context_len,
            max_request_tokens=min(engine.context_len, cfg.max_total_tokens),
            devices=[str(d) for d in jax.devices()],
            max_body_bytes=prompt_size.body_limit(cfg.queued_token_limit),
            max_text_bytes=prompt_size.text_limit(engine.context_len, engine.tokenizer),
            pd=Disaggregation.from_engine(engine),
            tool_format=from_name(server_cfg.tool_call_parser)
            if server_cfg.tool_call_parser
            else detect(chat.source),
        )
