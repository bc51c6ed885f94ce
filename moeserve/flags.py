"""Config fields as command-line flags. Every engine flag is declared once, as a field of
``config.py`` (``config.flag``: its name, type, default, choices and help); the commands
(``server/cli.py``, the planner, the benchmarks) build their flags from those fields here, and
say only where a flag means something else to them."""

from __future__ import annotations

import argparse
from collections.abc import Collection, Mapping
from typing import Any

from moeserve.config import config_flags


def add_config_flags(parser: argparse.ArgumentParser, names: Collection[str] | None = None,
                     defaults: Mapping[str, Any] | None = None, classes: tuple[type, ...] | None = None, *,
                     helps: Mapping[str, str] | None = None, required: Collection[str] = ()) -> None:
    """A flag ``--field-name`` for each config field declared as one in ``classes`` (default: the
    engine's sections), or for those in ``names``, with the field's type, choices, default and help.

    A command may give some flags another default (``defaults``: a benchmark's device), its own
    help (``helps``: where the flag means something narrower to it) or make them ``required``. A
    field whose default is None that a command defaults to one of its choices also takes ``none``
    (None), so the field's own default stays reachable.
    """
    flags = config_flags(classes)
    defaults, helps = defaults or {}, helps or {}
    unknown = {*(names or ()), *defaults, *helps, *required} - {name for name, *_ in flags}
    if unknown:
        raise ValueError(f"not config flags: {', '.join(sorted(unknown))}")
    for name, kind, field_default, spec in flags:
        if names is not None and name not in names:
            continue
        option, text = "--" + name.replace("_", "-"), helps.get(name, spec.help)
        if kind is bool:
            parser.add_argument(option, action="store_true", help=text or None)
            continue
        default = defaults.get(name, field_default)
        takes_none = spec.choices is not None and field_default is None and default is not None
        shown = f"(default: {default})" if default is not None and "default" not in text else ""
        parser.add_argument(option, type=kind, default=default, required=name in required,
                            choices=(*spec.choices, "none") if takes_none else spec.choices,
                            action=_StoreOrNone if takes_none else "store",
                            help=" ".join(filter(None, (text, shown))) or None)


class _StoreOrNone(argparse.Action):
    """Store the value given, or None for ``none``."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, None if values == "none" else values)


def add_engine_flags(parser: argparse.ArgumentParser, model_required: bool = True) -> None:
    """``--model-path`` and every engine flag: what ``engine_settings`` reads back."""
    parser.add_argument("--model-path", required=model_required,
                        help="Hugging Face checkpoint folder" + ("" if model_required else
                                                                " (default: the small chat model shipped in the "
                                                                "package)"))
    add_config_flags(parser)


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The config flags ``args`` holds, as the keyword settings of ``build_engine_config``."""
    return {name: getattr(args, name) for name, *_ in config_flags() if hasattr(args, name)}
