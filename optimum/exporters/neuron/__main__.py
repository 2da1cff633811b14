"""``python -m optimum.exporters.neuron``: the same export as ``optimum-cli export neuron``.

The flags that set a `NeuronConfig` field are made from the config itself (name, type, default,
choices, and the field's docstring as help), so the CLI cannot drift from it; the config refuses
every invalid value or combination when it is built.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ...neuron.errors import NeuronError

if TYPE_CHECKING:
    from ...neuron.config import NeuronConfig


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    """The export flags, shared by ``optimum-cli export neuron`` and ``python -m``."""
    from ...neuron.config import config_fields, field_docs

    parser.add_argument("--model", "-m", required=True, help="Local transformers checkpoint folder.")
    docs = field_docs()
    for spec in config_fields():
        _add_field(parser, spec, docs[spec.name])
    parser.add_argument(
        "--no_cache",
        action="store_true",
        help="Compile every graph, using neither the artifact cache nor the per-graph compile cache (docs/export.md).",
    )
    parser.add_argument("output", type=Path, help="Output artifact directory.")


def _add_field(parser: argparse.ArgumentParser, spec: dataclasses.Field, doc: str) -> None:
    """One flag for config field ``spec``: ``--<flag> VALUE``, or a switch for a boolean field."""
    from ...neuron.config import CHOICES, flag, switch

    help_text = doc.replace("%", "%%")
    if isinstance(spec.default, bool):
        action = "store_false" if spec.default else "store_true"
        default = " (default: on)" if spec.default else " (default: off)"
        parser.add_argument(switch(spec.name), dest=spec.name, action=action, help=help_text + default)
        return
    parser.add_argument(
        flag(spec.name),
        dest=spec.name,
        metavar=None if spec.name in CHOICES else flag(spec.name).removeprefix("--").upper(),
        type=type(spec.default),
        default=spec.default,
        choices=CHOICES.get(spec.name),
        help=f"{help_text} (default: %(default)s)",
    )


def config_from_args(args: argparse.Namespace) -> NeuronConfig:
    """The `NeuronConfig` that flags parsed by `add_export_arguments` describe (validated when built)."""
    from ...neuron.config import NeuronConfig, config_fields

    return NeuronConfig(**{spec.name: getattr(args, spec.name) for spec in config_fields()})


def run_export(args: argparse.Namespace) -> Path:
    """Build the `NeuronConfig` from parsed flags and export. The config is built first: a bad flag is refused before
    the exporter's imports (transformers, the model code), in about half the time."""
    config = config_from_args(args)
    from ...neuron.backends import get_backend

    get_backend(config.backend).prepare_compiler(config.device)
    from .export import export

    return export(args.model, args.output, config, use_cache=not args.no_cache)


def main(argv: list[str] | None = None) -> int:
    """Entry point; typed errors become a one-line message and exit status 2."""
    parser = argparse.ArgumentParser(prog="python -m optimum.exporters.neuron", description=__doc__)
    add_export_arguments(parser)
    args = parser.parse_args(argv)
    try:
        out = run_export(args)
    except NeuronError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"exported to {out}")
    return 0


if __name__ == "__main__":
    from ...neuron.fast_exit import exit_now

    exit_now(main())
