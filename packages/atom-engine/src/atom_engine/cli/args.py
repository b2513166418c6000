"""Engine flags generated from `EngineConfig`: one `--flag` per field, documented by its `help`.

`int | None` fields take an int, `bool` fields get `--x / --no-x`, and the default shown is the
dataclass default, so a new config field becomes a flag of every engine command by itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from atom_engine.config import EngineConfig


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _scalar_type(annotation) -> type:
    """`int | None` -> int, `str` -> str (the type argparse converts the flag's value with)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"EngineConfig fields must be one type or None, got {annotation}")
        annotation = args[0]
    return annotation


def _parser(parse):
    """A field's own parser as an argparse type: its ValueError message becomes the error."""

    def convert(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


def on_off(value: bool) -> str:
    return "on" if value else "off"


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every `EngineConfig` field as a flag to `parser` (in an "engine" group)."""
    group = parser.add_argument_group("engine", "EngineConfig fields")
    hints = typing.get_type_hints(EngineConfig)
    for field in dataclasses.fields(EngineConfig):
        kind = _scalar_type(hints[field.name])
        default = field.default
        if default is dataclasses.MISSING and field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        help_text = field.metadata.get("help", "")
        names = [_flag(field.name), *field.metadata.get("aliases", ())]  # -tp, -dp as in vLLM
        if kind is bool:
            group.add_argument(
                *names,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=help_text if default is None else f"{help_text} (default: {on_off(default)})",
            )
        else:
            shown = "" if default is None else " (default: %(default)s)"
            group.add_argument(
                *names,
                type=_parser(field.metadata["type"]) if "type" in field.metadata else kind,
                default=default,
                dest=field.name,
                metavar=field.name.upper(),
                help=help_text + shown,
            )
    return parser


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of parsed flags (raises ValueError for invalid values)."""
    return EngineConfig(**{name: getattr(args, name) for name in EngineConfig.field_names()})
