"""`hf-kvcompress lm-eval ARGS...`: lm-eval's own command line, with the `hf-kvcompress` model registered.

    hf-kvcompress lm-eval --model hf-kvcompress --model_args pretrained=,cache=int4 \\
        --tasks kvc_needle --include_path eval_tasks --metadata '{"lengths": [1000], "depths": [0, 50, 100]}'

Every argument goes to lm-eval unchanged (`hf-kvcompress lm-eval --help` shows lm-eval's help). lm-eval's CLI
discovers no plugins, so this command registers the model first. `--include_path` defaults to the eval_tasks
folder shipped with hf-kvcompress when it is not given.
"""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers) -> None:
    # '+' as the prefix character lets every "--option" through untouched to lm-eval's parser.
    parser = subparsers.add_parser(
        "lm-eval",
        aliases=["lm_eval"],
        help="lm-eval's CLI with the hf-kvcompress model registered (all arguments go to lm-eval)",
        description=__doc__,
        prefix_chars="+",
        add_help=False,
    )
    parser.add_argument("lm_eval_args", nargs=argparse.REMAINDER)
    parser.set_defaults(func=run)


def _default_include_path() -> str | None:
    from ..eval.scoring import metrics_dir

    try:
        return str(metrics_dir().parent)
    except FileNotFoundError:
        return None


def run(args) -> int:
    from ..eval.lm_eval_model import register

    register()
    argv = list(args.lm_eval_args)
    wants_run = bool(argv) and not any(a in ("-h", "--help") for a in argv[:1]) and argv[0] not in ("ls", "validate")
    if wants_run and "--include_path" not in argv and not any(a.startswith("--include_path=") for a in argv):
        include = _default_include_path()
        if include is not None:
            argv += ["--include_path", include]
    from lm_eval.__main__ import cli_evaluate

    saved = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        cli_evaluate()
    except SystemExit as done:
        return int(done.code or 0) if not isinstance(done.code, str) else 1
    finally:
        sys.argv = saved
    return 0
