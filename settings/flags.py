"""A setting declared once: the config dataclass field carries its flag, and the argparse flags
and the config built from parsed flags are generated from the fields.

    drain_timeout_s: float = setting(30.0, flag="--drain-timeout", help="...")

    add_arguments(parser, RouterConfig)              # one flag per field that declares one
    config = from_args(RouterConfig, args, redis_url=...)   # each field from its flag's dest

A flag's argparse ``type`` comes from the field's annotation (``int``, ``float``, ``int | None``;
a ``str`` field gets none, as argparse's default), a ``bool`` field is ``store_true`` or, named
``--no-...``, ``store_false``; a field without a default is a required flag. ``dest`` is the
field's name unless the flag says otherwise (a ClusterConfig holds the planner's settings under
``planner_*`` names); ``to_field`` turns a parsed value into the field's (``negative_is_none``:
``--http-port -1`` is None). Other add_argument keywords (choices, metavar, a ``type`` of its
own, ``action``) are given with the declaration. ``like`` refers to another class's declaration
of the same setting instead of repeating it. ``to_argv`` goes the other way: the flags that give
back a config (a process started with another's settings: chaos's router process).
"""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

FLAG = "pdserve.flag"  # the metadata key of a field's Flag


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET = _Unset()  # a Flag's default when it is the field's


@dataclasses.dataclass(frozen=True, slots=True)
class Flag:
    option: str  # "--drain-timeout"
    help: str | None = None
    dest: str | None = None  # where argparse stores it; None = the field's name
    to_field: Callable[[Any], Any] | None = None  # parsed value -> field value
    default: Any = UNSET  # the flag's default where it is not the field's (--api-key: None)
    # More add_argument keywords: choices, metavar, a type of its own, action.
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def setting(default: Any = dataclasses.MISSING, *, flag: str | None = None, help: str | None = None,
            dest: str | None = None, to_field: Callable[[Any], Any] | None = None, repr: bool = True,
            default_factory: Any = dataclasses.MISSING, flag_default: Any = UNSET,
            **kwargs: Any) -> Any:
    """A dataclass field with its flag (``flag`` None: a setting without one)."""
    meta = {} if flag is None else {FLAG: Flag(flag, help, dest, to_field, flag_default, MappingProxyType(kwargs))}
    return dataclasses.field(default=default, default_factory=default_factory, repr=repr, metadata=meta)


def like(cls: type, name: str, **changes: Any) -> Any:
    """Another class's field ``name`` (default and flag), for a config that carries the same
    setting to hand it on; ``changes``: Flag attributes (``dest``, ``help``) or ``default``."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    default = changes.pop("default", f.default)
    meta = dict(f.metadata)
    if FLAG in meta and changes:
        meta[FLAG] = dataclasses.replace(meta[FLAG], **changes)
    return dataclasses.field(default=default, default_factory=f.default_factory, repr=f.repr, metadata=meta)


def negative_is_none(value: int) -> int | None:
    """``--http-port -1``: no such port (None)."""
    return None if value < 0 else value


def negated(value: bool) -> bool:
    """``--no-prefix-caching`` stored True under its own dest: the field (``enable_prefix_caching``)
    is False."""
    return not value


def flagged(cls: type, names: Iterable[str] | None = None,
            exclude: Iterable[str] = ()) -> list[tuple[dataclasses.Field, Flag]]:
    """``cls``'s fields that declare a flag, in declaration order (or in the order of ``names``)."""
    by_name = {f.name: (f, f.metadata[FLAG]) for f in dataclasses.fields(cls) if FLAG in f.metadata}
    skip = set(exclude)
    if names is None:
        return [v for n, v in by_name.items() if n not in skip]
    missing = [n for n in names if n not in by_name]
    if missing:
        raise KeyError(f"{cls.__name__} declares no flag for {missing}")
    return [by_name[n] for n in names if n not in skip]


def dest_of(f: dataclasses.Field, flag: Flag) -> str:
    return flag.dest or f.name


def _type_of(annotation: Any) -> Any:
    """The argparse type of a field annotation (a string under ``from __future__ import annotations``)."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    parts = [p.strip() for p in text.split("|") if p.strip() != "None"]
    known = {"int": int, "float": float, "str": None, "bool": bool}
    if len(parts) != 1 or parts[0] not in known:
        raise TypeError(f"no argparse type for {annotation!r}: give type= with the setting")
    return known[parts[0]]


def argument(f: dataclasses.Field, flag: Flag, default: Any = dataclasses.MISSING,
             help: str | None = None) -> tuple[tuple[str, ...], dict[str, Any]]:
    """(option strings, add_argument keywords) of one declared field."""
    kw: dict[str, Any] = {"dest": dest_of(f, flag)}
    extra = dict(flag.kwargs)
    if default is dataclasses.MISSING and flag.default is not UNSET:
        default = flag.default
    if default is dataclasses.MISSING:
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
    kind = extra.pop("type") if "type" in extra else _type_of(f.type)
    if kind is bool and "action" not in extra:
        extra["action"] = "store_false" if flag.option.startswith("--no-") else "store_true"
    elif kind is not None and kind is not bool:
        kw["type"] = kind
    if default is dataclasses.MISSING:
        kw["required"] = True
    else:
        kw["default"] = default
    kw.update(extra)
    text = help if help is not None else flag.help
    if text is not None:
        kw["help"] = text
    return (flag.option,), kw


def add_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type,
                  names: Iterable[str] | None = None, *, exclude: Iterable[str] = (),
                  defaults: Mapping[str, Any] | None = None, helps: Mapping[str, str] | None = None) -> None:
    """One flag per field of ``cls`` that declares one (only ``names``, in their order, when
    given); ``defaults`` / ``helps``: by field name, where this command's differ."""
    defaults, helps = defaults or {}, helps or {}
    for f, flag in flagged(cls, names, exclude):
        options, kw = argument(f, flag, defaults.get(f.name, dataclasses.MISSING), helps.get(f.name))
        p.add_argument(*options, **kw)


def field_values(cls: type, args: Any, names: Iterable[str] | None = None, exclude: Iterable[str] = ()) -> dict:
    """Field name -> value from ``args`` (parsed flags, or anything with the flags' dests as
    attributes: a ClusterConfig) for every flagged field of ``cls`` (or only ``names``)."""
    out = {}
    for f, flag in flagged(cls, names, exclude):
        value = getattr(args, dest_of(f, flag))
        out[f.name] = flag.to_field(value) if flag.to_field is not None else value
    return out


def from_args(cls: type, args: Any, names: Iterable[str] | None = None, exclude: Iterable[str] = (), **fields: Any):
    """``cls`` from parsed flags (``field_values``); ``fields`` win (what no flag says)."""
    return cls(**{**field_values(cls, args, names, exclude), **fields})


def shared_values(source: Any, cls: type, exclude: Iterable[str] = ()) -> dict:
    """The fields ``source`` (a dataclass) has in common with ``cls``, by name: one setting
    handed on (a ClusterConfig's to the router's RouterConfig, a NodeTemplate's to each node)."""
    mine = {f.name for f in dataclasses.fields(cls)} - set(exclude)
    return {f.name: getattr(source, f.name) for f in dataclasses.fields(source) if f.name in mine}


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _text(value: Any) -> str:
    """A value as its flag's text: a tuple as ``a,b`` (``--planner-slo-band``), else ``str``."""
    if isinstance(value, (tuple, list)):
        return ",".join(_text(v) for v in value)
    return str(value)


def to_argv(config: Any, names: Iterable[str] | None = None, exclude: Iterable[str] = ()) -> list[str]:
    """The flags that give back ``config`` (a dataclass instance) when parsed by the parser
    ``add_arguments`` made for its class: option and value of each flagged field that is required
    or differs from its default, in declaration order (or only ``names``); a bool as its
    ``store_true`` / ``store_false`` flag present or absent, a repeatable (``append``) flag once per
    item, None as -1 where ``to_field`` is ``negative_is_none``. ``exclude``: fields left to the
    caller (neither given nor checked). ValueError names the fields no flag can say: no flag and
    not the default, or a value the flag cannot express (None without ``negative_is_none``, a
    ``to_field`` this cannot invert)."""
    skip = set(exclude)
    chosen = None if names is None else list(names)
    if chosen is not None:
        flagged(type(config), chosen)  # KeyError: a name without a flag
    lost: list[str] = []
    argv: list[str] = []
    for f in dataclasses.fields(config):
        if f.name in skip or (chosen is not None and f.name not in chosen):
            continue
        value, default = getattr(config, f.name), _field_default(f)
        flag = f.metadata.get(FLAG)
        if flag is None:
            if default is dataclasses.MISSING or value != default:
                lost.append(f"{f.name}={value!r} (no flag)")
            continue
        if default is not dataclasses.MISSING and value == default:
            continue
        action = flag.kwargs.get("action")
        if action in ("store_true", "store_false") or (action is None and isinstance(value, bool)):
            present = (action or ("store_false" if flag.option.startswith("--no-") else "store_true")) == "store_true"
            present_value = flag.to_field(present) if flag.to_field is not None else present
            if value == present_value:
                argv.append(flag.option)
            else:  # absent gives the flag's default: not this value
                lost.append(f"{f.name}={value!r} ({flag.option} present or absent cannot say it)")
            continue
        if flag.to_field not in (None, tuple, negative_is_none):
            lost.append(f"{f.name}={value!r} ({flag.option}: its to_field is not invertible)")
            continue
        if value is None:
            if flag.to_field is negative_is_none:
                argv += [flag.option, "-1"]
            else:
                lost.append(f"{f.name}=None ({flag.option} cannot say None)")
            continue
        if action == "append":
            for item in value:
                argv += [flag.option, _text(item)]
        else:
            argv += [flag.option, _text(value)]
    if lost:
        raise ValueError(f"{type(config).__name__} has settings its flags cannot carry: {', '.join(lost)}")
    return argv
