"""Bad settings as one line naming what is at fault: `SettingError` (the settings `SpecConfig`
refuses, by argument name, for the Python API) and `describe_error` (any error, by CLI flag, for
`spec-runtime` and `spec-runtime train`)."""

import re
from collections.abc import Iterable, Mapping
from typing import Any

from .runtime import SetupError

__all__ = ["SettingError", "describe_error", "named_settings", "setting_errors"]


def named_settings(message: str, names: Iterable[str]) -> tuple[str, ...]:
    """The `names` that `message` mentions as words (`topk`, not `top_k` or `topk_x`), in the order
    they first appear."""
    found = []
    for name in names:
        hit = re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", message)
        if hit:
            found.append((hit.start(), name))
    return tuple(name for _, name in sorted(found))


def setting_errors(err: Any, names: Iterable[str]) -> tuple[tuple[tuple[str, ...], str], ...]:
    """Each error of a pydantic `ValidationError` as (the settings it is about, one line): the field of
    a field check (its `loc`), or, for a whole-config check (a model validator, whose `loc` is empty),
    every one of `names` that its message mentions. Pydantic's own wording names no value: the input
    is added (`input should be greater than 0, got 0`)."""
    names = tuple(names)
    parts = []
    for e in err.errors():
        msg = " ".join(str(e["msg"]).removeprefix("Value error, ").split())
        if e["type"] != "value_error":
            msg = f"{msg[:1].lower()}{msg[1:]}, got {e['input']!r}"
        field = ".".join(str(part) for part in e["loc"])
        parts.append(((field,) if field else named_settings(msg, names), msg))
    return tuple(parts)


class SettingError(SetupError):
    """Settings that `SpecConfig` refuses, on one line naming the argument(s) at fault
    (`num_steps: input should be greater than 0, got 0`). `parts` keeps each error's settings and
    message apart, so the CLI names its flags instead (`describe_error`)."""

    def __init__(self, parts: tuple[tuple[tuple[str, ...], str], ...]) -> None:
        def line(fields: tuple[str, ...], msg: str) -> str:
            return msg if not fields or named_settings(msg, fields) else f"{', '.join(fields)}: {msg}"

        super().__init__(next((fields[0] for fields, _ in parts if fields), ""),
                         "; ".join(line(fields, msg) for fields, msg in parts))
        self.parts = parts


def describe_error(err: BaseException, flags: Mapping[str, str]) -> str:
    """`err` on one line naming the CLI flag(s) at fault (`flags`: setting -> flag, e.g. `cli.FLAGS`),
    not pydantic's field dump: `--speculative-num-steps: input should be greater than 0, got 0`.

    A pydantic validation error or the engine's `SettingError` names the flag of each field it is
    about; an error of a whole-config check (`SpecConfig`'s model validators, no field) names the
    flag of every setting its message mentions, in order. A `SetupError` names the flag of its field."""
    from pydantic import ValidationError

    parts = getattr(err, "parts", None)  # the engine's SettingError
    if isinstance(err, ValidationError):
        parts = setting_errors(err, flags)
    if parts is not None:
        return "; ".join(_with_flags(fields, msg, flags) for fields, msg in parts)
    flag = flags.get(getattr(err, "field", None) or "")
    text = " ".join(str(err).split("\n"))
    return f"{flag}: {text}" if flag else text


def _with_flags(fields: tuple[str, ...], msg: str, flags: Mapping[str, str]) -> str:
    named = ", ".join(flags.get(field, field) for field in fields)
    return f"{named}: {msg}" if named else msg
