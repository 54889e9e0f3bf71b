"""Shared by the commands: checks run before a model loads (a wrong flag costs a line), and the help's defaults."""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show each option's default, except None and False, whose meaning the help text itself says."""

    def _get_help_string(self, action):
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


def check_device(device: str | None, flag: str = "--device") -> None:
    """A CUDA device asked of a torch without CUDA (or without a visible GPU) fails here, in one line."""
    if device is None:
        return
    import torch  # only when a device is asked for: --help reads no torch (tests/test_cli.py)

    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise ValueError(f"{flag} must be cpu, cuda, cuda:N or another torch device, got {device!r}") from None
    if kind == "cuda" and not torch.cuda.is_available():
        cuda = torch.version.cuda
        build = "a CPU-only build" if cuda is None else f"built for CUDA {cuda}, no GPU visible"
        raise ValueError(f"{flag} {device}: this torch ({torch.__version__}) has no CUDA ({build}); use {flag} cpu")
