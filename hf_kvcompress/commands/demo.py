"""`hf-kvcompress demo`: the main job of `make demo`: the quality-versus-memory study on the embedded model."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="what `make demo` runs: the budget table, then the study")
    parser.add_argument("--quick", action="store_true", help="budget table and one answer only")
    parser.set_defaults(func=run)


def run(args) -> int:
    from . import budget, generate

    budget_parser = argparse.ArgumentParser()
    sub = budget_parser.add_subparsers()
    budget.add_parser(sub)
    budget.run(budget_parser.parse_args(["budget"]))
    print()
    question = "In one sentence: why does a KV cache grow with the length of the conversation?"
    for spec in ("dynamic", "int4"):
        print(f"--- {question} (cache {spec})")
        generate_parser = argparse.ArgumentParser()
        generate.add_parser(generate_parser.add_subparsers())
        generate.run(generate_parser.parse_args(["generate", "--prompt", question, "--cache", spec, "--max-new-tokens", "60"]))
    return 0
