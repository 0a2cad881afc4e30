"""Typer application: wires the subcommands and turns KvtoolError into a one-line message."""

from __future__ import annotations

import sys

import typer

from kvtool.errors import KvtoolError
from kvtool.models import use_offline_defaults

app = typer.Typer(
    help="Calibrate per-layer KV-cache budgets offline and apply them at generation time.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
inspect_app = typer.Typer(help="Look inside profiles (and models).", no_args_is_help=True)
app.add_typer(inspect_app, name="inspect")


def _register() -> None:
    # Imported here so `kvtool --help` stays quick and each command lives in its own module.
    from kvtool.cli import bench, calibrate, eval_cmd, generate, inspect_cmd, inspect_gini  # noqa: F401
    from kvtool.cli import serve_cmd  # noqa: F401
    from kvtool.cli import export_cmd  # noqa: F401


def main() -> None:
    # First: transformers and huggingface_hub read these defaults once, when a command imports them.
    use_offline_defaults()
    _register()
    try:
        app(standalone_mode=False)
    except KvtoolError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except (typer.Abort, KeyboardInterrupt):
        typer.echo("aborted", err=True)
        sys.exit(130)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except Exception as exc:
        if _is_usage_error(exc):
            exc.show()
            sys.exit(exc.exit_code)
        raise


def _is_usage_error(exc: Exception) -> bool:
    """Whether `exc` is a command-line usage error (unknown command or option, bad value), which
    prints its own one-line message. Typer >= 0.2x raises those from its own copy of click, whose
    classes are not click's, so both are recognised."""
    import click

    classes: tuple[type, ...] = (click.ClickException,)
    vendored = getattr(getattr(typer, "exceptions", None), "TyperException", None)
    if isinstance(vendored, type):
        classes += (vendored,)
    return isinstance(exc, classes) and callable(getattr(exc, "show", None)) and isinstance(getattr(exc, "exit_code", None), int)
