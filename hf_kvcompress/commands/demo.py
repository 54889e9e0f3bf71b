"""`hf-kvcompress demo`: the main job of `make demo`: the lesson's budget table, then the measured study."""

from __future__ import annotations

import argparse

from ..extras import require


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo", help="what `make demo` runs: the budget table, then the study",
        description=__doc__ + " The same as `hf-kvcompress budget` followed by `hf-kvcompress study --out OUT` "
        "(the demo preset: every family on the embedded model, 30 samples per plan, on a CPU).")
    parser.add_argument("--out", default="results/study",
                        help="where the study writes its report and plots (default: %(default)s)")
    parser.set_defaults(func=run)


def _run(module, argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hf-kvcompress")
    module.add_parser(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.func(args)


def run(args) -> int:
    # the sub-commands it runs: cli.build_parser leaves out a sub-command a build lacks, so demo imports them
    # only when it runs
    from . import budget, study

    require("eval", "hf-kvcompress demo")  # its study: before the budget table prints

    print("=" * 100 + "\nThe lesson's KV budget, computed (hf-kvcompress budget)\n" + "=" * 100)
    _run(budget, ["budget"])
    print("\n" + "=" * 100 + "\nThe same plans, measured on a real model (hf-kvcompress study)\n" + "=" * 100)
    return _run(study, ["study", "--out", args.out])
