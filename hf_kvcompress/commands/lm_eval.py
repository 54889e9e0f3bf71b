"""`hf-kvcompress lm-eval ARGS...`: lm-eval's own command line, with the `hf-kvcompress` model registered.

    hf-kvcompress lm-eval --model hf-kvcompress --model_args pretrained=,cache=int4 \\
        --tasks kvc_needle --include_path eval_tasks --metadata '{"lengths": [1000], "depths": [0, 50, 100]}'

Every argument goes to lm-eval unchanged; `--help` prints this text, then lm-eval's help. lm-eval's CLI discovers
no plugins, so this command registers the model first. `--include_path` defaults to the eval_tasks folder shipped
with hf-kvcompress when it is not given, for `run` and `ls` alike (`hf-kvcompress lm-eval ls tasks` lists kvc_*).

Model `hf-kvcompress`, `--model_args`: `pretrained=` (alias, folder or .gguf; empty: the embedded SmolLM2-135M),
`cache=SPEC` (any cache spec, e.g. cache=int4 or cache=sink_window:window=256; default dynamic), `query_aware`,
`prompt_format` (auto/chat/plain), `chunk_size` (512), `dtype`, HFLM's own (batch_size, max_length, ...); any other
is refused. lm-eval splits --model_args at commas outside quotes, so a spec with commas goes in double quotes within
single ones: --model_args 'pretrained=,cache="h2o:budget=256,recent=64"'
(or JSON: '{"cache": "h2o:budget=256,recent=64"}').
Tasks shipped: {tasks} (the suite's tasks, the test half of their samples; each has a `_dev` variant, the half to
tune on, and `--metadata '{"split": "dev"}'` does the same; the document is compressed before the question).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..eval.scoring import metrics_dir
from ..extras import require


def add_parser(subparsers) -> None:
    # '+' as the prefix character lets every "--option" through untouched to lm-eval's parser.
    parser = subparsers.add_parser(
        "lm-eval",
        aliases=["lm_eval"],
        help="lm-eval's CLI with the hf-kvcompress model registered (all arguments go to lm-eval)",
        description=__doc__.split("\n\n")[0],
        prefix_chars="+",
        add_help=False,
    )
    parser.add_argument("lm_eval_args", nargs=argparse.REMAINDER, help="lm-eval's own arguments, passed on unchanged")
    parser.set_defaults(func=run)


def _default_include_path() -> str | None:
    try:
        return str(metrics_dir().parent)
    except FileNotFoundError:
        return None


def shipped_tasks() -> list[str]:
    """The kvc_* task folders in the eval_tasks shipped with hf-kvcompress."""
    include = _default_include_path()
    return sorted(p.name for p in Path(include).glob("kvc_*") if p.is_dir()) if include else []


def usage() -> str:
    return __doc__.replace("{tasks}", ", ".join(shipped_tasks()) or "none found")


def lm_eval_argv(argv: list[str]) -> list[str]:
    """The arguments for lm-eval: the user's, plus `--include_path` to the shipped tasks unless given or asking help."""
    argv = list(argv)
    wants_help = not argv or argv[0] in ("-h", "--help")
    if not wants_help and "--include_path" not in argv and not any(a.startswith("--include_path=") for a in argv):
        include = _default_include_path()
        if include is not None:
            argv += ["--include_path", include]
    return argv


def run(args) -> int:
    require("lm-eval", "hf-kvcompress lm-eval")
    argv = lm_eval_argv(args.lm_eval_args)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage() + "\nlm-eval's own help follows.\n")
    else:  # the model (torch, transformers, lm-eval's HFLM) is registered only for a run: help stays fast
        from ..eval.lm_eval_model import register

        register()
    from lm_eval.__main__ import cli_evaluate  # the lm-eval extra's, checked by require above

    saved = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        cli_evaluate()
    except SystemExit as done:
        return int(done.code or 0) if not isinstance(done.code, str) else 1
    finally:
        sys.argv = saved
    return 0
