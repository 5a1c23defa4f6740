"""A `Config` written back as TOML: `to_toml` (what a run saves as config.toml, read back by
`load_config`) and `describe` (`teratrain train --print-config`: every key with its description)."""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel

from teratrain.config_schema import Config


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML (unset optional keys are omitted)."""
    lines: list[str] = []
    tables = list(cfg.model_dump().items())
    while tables:
        name, values = tables.pop(0)
        lines.append(f"[{name}]")
        nested = [(f"{name}.{k}", v) for k, v in values.items() if isinstance(v, dict)]
        lines += [f"{k} = {toml_value(v)}" for k, v in values.items() if v is not None and not isinstance(v, dict)]
        lines.append("")
        tables[:0] = nested  # [model.moe] right after [model]
    return "\n".join(lines)


def toml_value(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):  # an inline table
        return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v) if not isinstance(v, float) or math.isfinite(v) else ("inf" if v > 0 else "-inf")
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def describe(cfg: Config | None = None) -> str:
    """`cfg` (default: the defaults) as TOML, each key with its description; an unset optional key
    is a comment, a nested section (model.moe) its own table after its parent's keys. What
    `teratrain train --print-config` prints: valid TOML a user can start from."""
    cfg = cfg or Config()
    lines: list[str] = []
    todo = [(section, getattr(cfg, section)) for section in Config.model_fields]
    while todo:
        name, values = todo.pop(0)
        lines.append(f"[{name}]")
        nested = []
        for key, f in type(values).model_fields.items():
            value = getattr(values, key)
            if isinstance(value, BaseModel):
                nested.append((f"{name}.{key}", value))
                continue
            key = f.alias or key  # checkpoint.async, a Python keyword
            text = f"{key} = {toml_value(value)}" if value is not None else f"# {key} = (unset)"
            lines.append(f"{text:32} # {f.description}")
        lines.append("")
        todo[:0] = nested
    return "\n".join(lines)
