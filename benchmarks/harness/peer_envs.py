"""The virtual environments the bench's peers run in, built on first use: none of their libraries is ours to depend on.

- `quantized`: transformers' QuantizedCache backends. The torch and transformers of this environment plus
  optimum-quanto and hqq, each installed on its own (~/.cache/hf-kvcompress/bench-quantized-venv), shared with the
  probe benchmarks/probes/transformers_quantized_cache.py.
- `kvpress`: kvpress 0.5.5, which pins transformers < 5.3 (benchmarks/.venv-kvpress), shared with the probe
  benchmarks/probes/kvpress_side_by_side.py.

An environment that already imports what its peers need is used as it is (no pip call). `prepare` never raises: a
backend that does not install, or an environment that cannot be built, is returned as the reason each affected peer
(and, for a whole environment, its DynamicCache baseline) cannot run, which the bench reports in its table.
"""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

from bench_peer_worker import PEERS

QUANTIZED_VENV = Path.home() / ".cache" / "hf-kvcompress" / "bench-quantized-venv"
BACKEND_PACKAGES = {"quanto": "optimum-quanto", "hqq": "hqq"}  # what pip installs for each QuantizedCache backend
BACKEND_MODULES = {"quanto": "optimum.quanto", "hqq": "hqq"}  # what must import for each QuantizedCache backend
KVPRESS_VENV = Path(__file__).resolve().parent.parent / ".venv-kvpress"  # benchmarks/.venv-kvpress (git-ignored)
KVPRESS_REQUIREMENTS = ["torch==2.13.0", "kvpress==0.5.5", "transformers<5.3"]


def build_quantized_venv(path: Path, log: Path) -> dict[str, str]:
    """Create the environment (once) with this process's torch and transformers; install each backend on its own.

    Returns backend -> why it cannot run (its pip install failed); raises when torch and transformers do not
    install. pip's output goes to `log`."""
    import torch
    import transformers

    python = path / "bin" / "python"
    failures = {}
    if not python.exists():
        venv.create(path, with_pip=True)
    base = [f"torch=={torch.__version__.split('+')[0]}", f"transformers=={transformers.__version__}"]
    with log.open("a") as stream:
        done = subprocess.run([str(python), "-m", "pip", "install", "-q", *base], stdout=stream, stderr=stream)
        if done.returncode:
            raise RuntimeError(f"pip could not install {base} into {path}; see {log}")
        for backend, package in BACKEND_PACKAGES.items():
            done = subprocess.run([str(python), "-m", "pip", "install", "-q", package], stdout=stream, stderr=stream)
            if done.returncode:
                failures[backend] = f"pip install {package} failed (exit {done.returncode}); see {log}"
    return failures


def ensure_kvpress_venv(path: Path) -> Path:
    """The kvpress environment's python: the environment is created, and kvpress installed, when they are missing."""
    python = path / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    probe = subprocess.run([str(python), "-c", "import kvpress, transformers; print(transformers.__version__)"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        subprocess.run([str(python), "-m", "pip", "install", "-q", *KVPRESS_REQUIREMENTS], check=True)
    return python


def _imports(python: Path, modules: str) -> bool:
    if not python.exists():
        return False
    return subprocess.run([str(python), "-c", f"import {modules}"], capture_output=True).returncode == 0


def _quantized(path: Path, log: Path) -> dict[str, str]:
    """backend -> why it cannot run; builds or completes the environment when something does not import."""
    python = path / "bin" / "python"
    if _imports(python, "torch, transformers") and all(_imports(python, m) for m in BACKEND_MODULES.values()):
        return {}
    return build_quantized_venv(path, log)


def prepare(env: str, path: Path, log: Path) -> tuple[Path, dict[str, str]]:
    """(the environment's python, {peer or "dynamic": why it cannot run there}) for the environment `env`."""
    python = path / "bin" / "python"
    peers = [name for name, (where, _) in PEERS.items() if where == env]
    try:
        if env == "quantized":
            failed = _quantized(path, log)
            return python, {p: failed[PEERS[p][1]["backend"]] for p in peers if PEERS[p][1]["backend"] in failed}
        ensure_kvpress_venv(path)
        return python, {}
    except Exception as error:  # the whole environment: every peer in it, and its baseline
        reason = f"environment {path} could not be built: {type(error).__name__}: {error}"
        return python, {name: reason for name in ["dynamic", *peers]}


DEFAULT_PATHS = {"quantized": QUANTIZED_VENV, "kvpress": KVPRESS_VENV}
