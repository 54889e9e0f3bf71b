"""`python -m hf_kvcompress.eval ...`: the eval command, for `accelerate launch --multi_gpu` and `torchrun`."""

import argparse
import sys

from ..cli import run_command
from ..commands.eval import __doc__ as _doc
from ..commands.eval import add_arguments, run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hf_kvcompress.eval", description=_doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.func = run
    return run_command(args, "hf_kvcompress.eval")


if __name__ == "__main__":
    sys.exit(main())
