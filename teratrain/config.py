"""Reading a run's configuration: a TOML file, `section.key=value` overrides (--set), what
`model.init_from` fills in, then validation into `Config` with pydantic's first error turned into one
sentence naming the key and the fix.

The schema (every section and its checks) is config_schema.py, the model's sections config_model.py;
this module imports them and re-exports their names, so `teratrain.config` is the config API:
`Config`, `ConfigError`, `load_config`, `apply_overrides`, `validate`. A Hugging Face folder named by
`model.init_from` is read here, before validation (`resolve_init_from`): the schema reads no file.
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from teratrain.config_base import ConfigError, Section  # noqa: F401 - the config API names them here
from teratrain.config_model import ROPE_SCALING_KEYS, ROUTERS, ModelConfig, MoEConfig  # noqa: F401
from teratrain.config_schema import (DEFAULT_LR, REPLAYING, CheckpointConfig, Config, DataConfig,  # noqa: F401
                                     LoraConfig, MemoryConfig, MetricsConfig, OptimConfig, ParallelConfig,
                                     TrainConfig, compile_scope_problem)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Read an optional TOML file, apply `section.key=value` overrides, validate."""
    return validate(apply_overrides(read_toml(path) if path is not None else {}, overrides))


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file '{p}' does not exist; pass the path of a TOML file.")
    try:
        return tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file '{p}' is not valid TOML ({e}); fix the syntax at that line.") from None


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `section.key=value` strings to a raw config dict (in place); returns it."""
    for item in overrides:
        _apply_override(raw, item)
    return raw


def validate(raw: dict[str, Any]) -> Config:
    """A raw config dict (TOML tables, overrides applied) as a `Config`: `model.init_from` resolved,
    then validated."""
    raw = resolve_init_from(raw)
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_explain(e)) from None


def resolve_init_from(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` with what `model.init_from` fills in: its config.json's model keys under the keys given
    (checkpoint/hf_config.py `init_shape`, which refuses a given shape key that contradicts them; its
    `moe` table key by key), and its tokenizer.json as data.tokenizer unless one is given. The only
    place a config reads a model folder; `raw` is not changed."""
    model = raw.get("model")
    if not isinstance(model, dict) or not model.get("init_from"):
        return raw
    folder = str(model["init_from"])
    if model.get("preset", "tiny") != "tiny":  # the default is what a run's saved config.toml writes
        raise ConfigError(f"model.preset={model['preset']} names a built-in shape, and model.init_from takes the "
                          f"shape from {folder}/config.json; give one of them.")
    from teratrain.checkpoint.hf_config import init_shape  # here: the checkpoint package imports torch

    hf = init_shape(folder, model)
    filled = {**hf, **model}
    if isinstance(hf.get("moe"), dict) and isinstance(model.get("moe"), dict):
        filled["moe"] = {**hf["moe"], **model["moe"]}
    out = {**raw, "model": filled}
    tokenizer = Path(folder).expanduser() / "tokenizer.json"
    data = raw.get("data") if isinstance(raw.get("data"), dict) else {}
    if tokenizer.is_file() and not data.get("tokenizer"):
        out["data"] = {**data, "tokenizer": str(tokenizer)}
    return out


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    parts = key.strip().split(".")
    nested = len(parts) == 3 and bool(_fields_of(".".join(parts[:2])))  # section.table.key, e.g. model.moe.top_k
    if not sep or not (len(parts) == 2 or nested) or not all(parts):
        raise ConfigError(f"--set '{item}' is not of the form section.key=value (section.table.key=value for a "
                          "nested table such as model.moe); write e.g. --set optim.lr=3e-4.")
    if parts[0] not in Config.model_fields:
        raise ConfigError(f"unknown config section '{parts[0]}' in --set {item}; use one of {', '.join(Config.model_fields)}.")
    table = raw
    for part in parts[:-1]:
        table = table.setdefault(part, {})
        if not isinstance(table, dict):
            raise ConfigError(f"--set {item}: '{'.'.join(parts[:-1])}' was given as a value, not a table; "
                              "give its keys one by one.")
    table[parts[-1]] = _parse_value(text.strip())


def _parse_value(text: str) -> Any:
    """A TOML literal when it is one (3, 3e-4, true, "x"), else the bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


_TYPE_WORDS = {"int_parsing": "an integer", "int_from_float": "an integer", "float_parsing": "a number",
               "bool_parsing": "true or false", "string_type": "a string", "int_type": "an integer",
               "float_type": "a number", "bool_type": "true or false"}


def _explain(e: ValidationError) -> str:
    """Turn pydantic's first error into one sentence naming the key and the fix."""
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err["loc"])
    kind, given = err["type"], _as_toml(err.get("input"))
    if kind == "extra_forbidden":
        section, _, name = loc.rpartition(".")
        fields = _fields_of(section)
        close = difflib.get_close_matches(name, fields, n=1)
        hint = f"did you mean '{section + '.' if section else ''}{close[0]}'?" if close else f"known keys: {', '.join(fields)}."
        return f"unknown config key '{loc}'; {hint}"
    if isinstance(err.get("ctx", {}).get("error"), ConfigError):
        return str(err["ctx"]["error"])
    if kind in _TYPE_WORDS:
        return f"config key '{loc}' must be {_TYPE_WORDS[kind]}, got {given}; fix its value."
    if kind == "literal_error":
        return f"config key '{loc}' got {given}; {err['msg'].lower().replace('input ', 'it ')}."
    if kind == "model_type" or kind == "dict_type":
        return f"config key '{loc}' must be a [section] table, got {given}; write it as a TOML table."
    return f"config key '{loc}' is invalid ({err['msg'].lower()}, got {given}); fix its value."


def _as_toml(value) -> str:
    """A value quoted in a sentence as the user wrote it: TOML's true, not Python's True."""
    return str(value).lower() if isinstance(value, bool) else repr(value)


def _fields_of(section: str) -> list[str]:
    """Keys of a (possibly nested) table, e.g. 'model' or 'model.moe'."""
    cls = Config
    for part in section.split(".") if section else []:
        field = cls.model_fields.get(part)
        if field is None or not isinstance(field.annotation, type) or not issubclass(field.annotation, BaseModel):
            return []
        cls = field.annotation
    return [f.alias or k for k, f in cls.model_fields.items()]  # checkpoint.async: its alias
