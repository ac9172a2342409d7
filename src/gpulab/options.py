"""The command-line options of a training run, built from TrainConfig's fields (gpulab.config):
the flag, the type, the choices and the help text each come from the one field that declares them.
gpulab train takes every field; gpulab plan the ones that say what one training step is.

Every option's argparse default is None, so that only the options the user typed override
TrainConfig's defaults (and a resumed run can tell which ones were given)."""

from __future__ import annotations

import typing
from dataclasses import fields

from gpulab.config import TrainConfig, literal_choices

STEP_FIELDS = ("model", "data_dir", "devices", "batch_size", "recipe", "sync", "shard", "channels_last", "precision")
"""What one training step is: the options gpulab plan shares with gpulab train."""


def train_fields() -> tuple[str, ...]:
    return tuple(f.name for f in fields(TrainConfig) if f.metadata["cli"])


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_config_options(parser, names: tuple[str, ...]) -> None:
    """One option per TrainConfig field in `names`."""
    by_name = {f.name: f for f in fields(TrainConfig)}
    hints = typing.get_type_hints(TrainConfig)
    for name in names:
        f, hint = by_name[name], hints[name]
        help_text = f.metadata["help"] + ("" if f.default is None or f.default is False else f" (default {f.default})")
        if hint is bool:
            parser.add_argument(flag(name), action="store_const", const=True, default=None, help=help_text)
            continue
        allowed = literal_choices(TrainConfig).get(name)
        # No argparse choices=: TrainConfig checks them, with the one-line error that lists them.
        metavar = "{" + ",".join(allowed) + "}" if allowed else None
        parser.add_argument(flag(name), type=value_type(hint), default=None, metavar=metavar, help=help_text)


def value_type(hint) -> type:
    """What argparse turns the text into: int or float for those fields (also `float | None`), else str."""
    return next((t for t in (int, float) if hint is t or t in typing.get_args(hint)), str)


def given_options(args, names: tuple[str, ...]) -> dict:
    """The options the user gave (None: not given)."""
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}
