"""The `hf-kvcompress` command: one sub-command per module in `hf_kvcompress.commands`."""

from __future__ import annotations

import argparse
import importlib
import sys

from .extras import MissingExtraError

# Each module defines `add_parser(subparsers)`, which registers its sub-command and sets `func(args) -> int`.
COMMANDS = ("budget", "generate", "eval", "lm_eval", "study", "demo", "calibrate")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-kvcompress", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"hf_kvcompress.commands.{name}")
        except ModuleNotFoundError as error:
            if error.name == f"hf_kvcompress.commands.{name}":
                continue  # that sub-command is not part of this build
            raise
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a sub-command; user errors print one line, not a traceback."""
    args = build_parser().parse_args(argv)
    return run_command(args, f"hf-kvcompress {args.command}")


def run_command(args, prog: str) -> int:
    """`args.func(args)`; bad input, a missing extra and Ctrl-C are reported in one line each (exit codes 2, 130)."""
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, KeyError, MissingExtraError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        out = getattr(args, "out", None)
        kept = f"; finished results are kept in {out}, and the same command resumes from them" if out else ""
        print(f"\n{prog}: interrupted{kept}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
