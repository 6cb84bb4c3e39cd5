"""TOML configuration files, checked against a dataclass.

Each service declares its settings as a dataclass (field types are the
schema, defaults are the defaults); `load_config` reads a TOML file into it and
turns every mistake (a syntax error, an unknown key, a missing key, a wrong
type) into one clear FsError(EINVAL) naming the file and the key. What types
cannot say (ranges, addresses, settings that must agree) a config class says
in a method ``validate(self, where: str) -> None`` that raises
FsError(EINVAL) naming *where* (the file) and the key; `load_config` calls it,
so a config that loads is a config its service accepts.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import tomllib
from pathlib import Path
from typing import Any, TypeVar, get_type_hints

import tomli_w

from shufflefs.rpc.errors import FsError
from shufflefs.rpc.schema import validator_for

T = TypeVar("T")


def load_config(path: str | os.PathLike[str], cls: type[T]) -> T:
    path = Path(path)
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise FsError(errno.ENOENT, f"config file {path} not found") from None
    except PermissionError:
        raise FsError(errno.EACCES, f"cannot read config file {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise FsError(errno.EINVAL, f"config file {path}: {exc}") from None
    return config_from_dict(data, cls, str(path))


def config_from_dict(data: dict[str, Any], cls: type[T], where: str) -> T:
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise FsError(errno.EINVAL, f"{where}: unknown setting {key!r} (known: {known})")
    for name, f in fields.items():
        has_default = (
            f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        )
        if name not in data and not has_default:
            raise FsError(errno.EINVAL, f"{where}: missing setting {name!r}")
        if name in data:
            value = data[name]
            if hints[name] is float and isinstance(value, int) and not isinstance(value, bool):
                data[name] = value = float(value)
            try:
                validator_for(hints[name])(value, f"{where}: setting {name!r}")
            except FsError as exc:
                raise FsError(errno.EINVAL, exc.message) from None
    config = cls(**data)
    validate = getattr(config, "validate", None)
    if validate is not None:
        validate(where)
    return config


def write_toml(path: str | os.PathLike[str], data: dict[str, Any], mode: int = 0o644) -> None:
    """Write a TOML file atomically (temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        tomli_w.dump(data, f)
    os.replace(tmp, path)
