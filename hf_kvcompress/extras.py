"""The optional parts of hf-kvcompress: each pip extra, the modules it provides, and the check made where one is used.

The library (caches, generate, load_model on a folder or a Hub id) needs torch, transformers and safetensors. The rest
is installed by name: `pip install "hf-kvcompress[eval]"`; pyproject.toml's optional-dependencies list the same
extras with their versions.
"""

from __future__ import annotations

import importlib.util

# extra -> the modules (import names) that the code behind it imports.
EXTRAS: dict[str, tuple[str, ...]] = {
    "models": ("gguf",),  # the embedded models: transformers reads their GGUF files with it, once, to convert them
    "eval": ("datasets", "evaluate", "matplotlib", "accelerate", "tqdm"),  # the suite, the study, their plots
    "lm-eval": ("lm_eval",),
    "triton": ("triton",),  # the decode-attention kernel on CUDA; without it attention stays in PyTorch
    "cpu-kernel": ("ninja",),  # builds the CPU decode-attention kernel; without it attention stays in PyTorch
}


class MissingExtraError(ImportError):
    """A module of an extra is not installed; the message holds the pip command that installs it."""


def require(extra: str, what: str) -> None:
    """Raise `MissingExtraError` unless every module of `extra` is installed (`what` needs them, e.g. a command).

    Checked without importing them, before any work starts: a missing extra costs one line, not a run.
    """
    missing = [module for module in EXTRAS[extra] if not _installed(module)]
    if missing:
        raise MissingExtraError(
            f"{what} needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not installed: "
            f'pip install "hf-kvcompress[{extra}]"',
            name=missing[0],
        )


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None  # None also for a module set to None in sys.modules
    except (ImportError, ValueError):
        return False
