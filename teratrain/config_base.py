"""The pieces every config section is made of: the error a bad input raises, and the section base
class (unknown keys refused, numbers never read from strings)."""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator
from pydantic_core import PydanticCustomError


class ConfigError(ValueError):
    """Bad user input: the message is one sentence naming the key and the fix."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_are_not_strings(cls, value: Any, info) -> Any:
        """A TOML string "100" (or a true) is not a number, as on the command line, where --set
        train.steps=many is refused; pydantic alone would parse it. An integer is a fine float."""
        kind = _number_kind(cls.model_fields[info.field_name].annotation)
        if kind and isinstance(value, (str, bool)):
            raise PydanticCustomError(f"{kind}_type", f"Input should be a valid {kind}")
        return value


def _number_kind(annotation) -> str | None:
    """"int" or "float" for a numeric field (optional or not), else None."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    for t in (annotation, *args):
        if t is int or t is float:
            return t.__name__
    return None
