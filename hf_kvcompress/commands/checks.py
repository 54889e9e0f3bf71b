"""Checks the commands run before loading a model, so a wrong flag costs a line, not a traceback."""

from __future__ import annotations


def check_device(device: str | None, flag: str = "--device") -> None:
    """A CUDA device asked of a torch without CUDA (or without a visible GPU) fails here, in one line."""
    if device is None:
        return
    import torch

    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise ValueError(f"{flag} must be cpu, cuda, cuda:N or another torch device, got {device!r}") from None
    if kind == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}, no GPU visible"
        raise ValueError(f"{flag} {device}: this torch ({torch.__version__}) has no CUDA ({build}); use {flag} cpu")
