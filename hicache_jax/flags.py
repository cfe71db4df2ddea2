"""The server's absl flags: defined here, parsed here into ``EngineConfig`` + ``ServerConfig``.
Nothing else reads ``FLAGS``.

Every ``EngineConfig`` and ``ServerConfig`` field is a flag of the same name (type from the
field; help and default from its ``setting``), so a field added to a config is a flag at
once, and its help is also its row in the flag table of docs/flags.md (``hicache_jax/flag_table.py``).
Invalid or contradictory values raise ``FlagError`` whose message names the flag.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing

from absl import flags

from hicache_jax.config import ConfigError, EngineConfig
from hicache_jax.hub import SHORT_NAMES, ModelNotFound, installed_model, is_repo_id
from hicache_jax.server.config import ServerConfig, ServerConfigError


class FlagError(ValueError):
    """Invalid or contradictory flags; the message names them."""


def _kind(tp) -> str:
    """'bool' | 'int' | 'float' | 'str' for a field's resolved type (``int | None`` -> int)."""
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    base = next((a for a in args if a is not type(None)), str)
    return {bool: "bool", int: "int", float: "float"}.get(base, "str")


def config_fields() -> list[dataclasses.Field]:
    """Every flag's field, in flag order: ``EngineConfig``'s, then ``ServerConfig``'s."""
    return [*dataclasses.fields(EngineConfig), *dataclasses.fields(ServerConfig)]


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    """Define every flag on ``fv`` (names already defined there are left alone): one per
    config field, its type from the field's, its default and help from the field's ``setting``."""
    define = {
        "bool": flags.DEFINE_bool,
        "int": flags.DEFINE_integer,
        "float": flags.DEFINE_float,
        "str": flags.DEFINE_string,
    }
    hints = typing.get_type_hints(EngineConfig) | typing.get_type_hints(ServerConfig)
    for f in config_fields():
        if f.name in fv:
            continue
        help_ = f.metadata["help"]
        if f.metadata["choices"]:
            flags.DEFINE_enum(f.name, f.default, f.metadata["choices"], help_, flag_values=fv)
        else:
            define[_kind(hints[f.name])](f.name, f.default, help_, flag_values=fv)
        if f.default is None and f.metadata["shown_default"]:
            fv[f.name].default_as_str = f.metadata["shown_default"]  # --helpfull: "(default: ...)"


def _name_flags(message: str) -> str:
    """'page_size=3: must be ...' -> '--page_size=3: must be ...' (field names are flag names)."""
    names = sorted((f.name for f in dataclasses.fields(EngineConfig)), key=len, reverse=True)
    pattern = r"(?<![\w-])(" + "|".join(map(re.escape, names)) + r")\b"
    return re.sub(pattern, r"--\1", message)


def configs_from_flags(fv: flags.FlagValues = flags.FLAGS) -> tuple[EngineConfig, ServerConfig]:
    """Parsed flags -> configs; raises FlagError naming the offending flag."""
    kwargs = {}
    for f in dataclasses.fields(EngineConfig):
        value = fv[f.name].value
        if value == "" and f.default is None:
            value = None  # --hicache_storage_spec= unsets a value a flagfile set
        kwargs[f.name] = value
    path = kwargs["model_path"]
    if path in SHORT_NAMES:
        try:
            installed_model(path)
        except ModelNotFound as e:
            raise FlagError(str(e)) from None
    elif path and "://" not in path and not os.path.isdir(path) and not is_repo_id(path):
        if not (os.path.isfile(path) and path.endswith(".gguf")):  # a GGUF file is a checkpoint too
            msg = "no such directory, and not a Hugging Face model id (org/name)"
            raise FlagError(f"--model_path={path}: {msg}")
    try:
        engine_cfg = EngineConfig(**kwargs)
    except ConfigError as e:
        raise FlagError(_name_flags(str(e))) from None
    try:
        server_kwargs = {f.name: fv[f.name].value for f in dataclasses.fields(ServerConfig)}
        for name in ("profile_dir", "allowed_hosts"):  # empty: unset (never --api_key: that is refused)
            server_kwargs[name] = server_kwargs[name] or None
        server_cfg = ServerConfig(**server_kwargs)
    except ServerConfigError as e:
        raise FlagError(str(e)) from None
    return engine_cfg, server_cfg


def parse(argv: list[str]) -> tuple[EngineConfig, ServerConfig]:
    """Parse a command line (``argv[0]`` is the program) on fresh FlagValues; for tests and
    tools that want configs without touching the global FLAGS."""
    fv = flags.FlagValues()
    define_flags(fv)
    try:
        rest = fv(argv)
    except flags.Error as e:
        raise FlagError(str(e)) from None
    if len(rest) > 1:
        raise FlagError(f"unexpected arguments: {rest[1:]}")
    return configs_from_flags(fv)
