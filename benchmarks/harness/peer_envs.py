"""The virtual environments the bench's peers run in, built on first use: none of their libraries is ours to depend on.

- `quantized`: transformers' QuantizedCache backends. The torch and transformers of this environment plus
  optimum-quanto and hqq, each installed on its own: transformers_quantized_cache.py's environment
  (~/.cache/hf-kvcompress/bench-quantized-venv), shared with that script.
- `kvpress`: kvpress 0.5.5, which pins transformers < 5.3: kvpress_side_by_side.py's environment
  (benchmarks/.venv-kvpress).

An environment that already imports what its peers need is used as it is (no pip call). `prepare` never raises: a
backend that does not install, or an environment that cannot be built, is returned as the reason each affected peer
(and, for a whole environment, its DynamicCache baseline) cannot run, which the bench reports in its table.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from bench_peer_worker import PEERS
from kvpress_side_by_side import DEFAULT_VENV as KVPRESS_VENV
from kvpress_side_by_side import ensure_venv

QUANTIZED_VENV = Path.home() / ".cache" / "hf-kvcompress" / "bench-quantized-venv"
BACKEND_MODULES = {"quanto": "optimum.quanto", "hqq": "hqq"}  # what must import for each QuantizedCache backend


def _imports(python: Path, modules: str) -> bool:
    if not python.exists():
        return False
    return subprocess.run([str(python), "-c", f"import {modules}"], capture_output=True).returncode == 0


def _quantized(path: Path, log: Path) -> dict[str, str]:
    """backend -> why it cannot run; builds or completes the environment when something does not import."""
    python = path / "bin" / "python"
    if _imports(python, "torch, transformers") and all(_imports(python, m) for m in BACKEND_MODULES.values()):
        return {}
    from transformers_quantized_cache import _environment

    return _environment(path, log)


def prepare(env: str, path: Path, log: Path) -> tuple[Path, dict[str, str]]:
    """(the environment's python, {peer or "dynamic": why it cannot run there}) for the environment `env`."""
    python = path / "bin" / "python"
    peers = [name for name, (where, _) in PEERS.items() if where == env]
    try:
        if env == "quantized":
            failed = _quantized(path, log)
            return python, {p: failed[PEERS[p][1]["backend"]] for p in peers if PEERS[p][1]["backend"] in failed}
        ensure_venv(path)
        return python, {}
    except Exception as error:  # the whole environment: every peer in it, and its baseline
        reason = f"environment {path} could not be built: {type(error).__name__}: {error}"
        return python, {name: reason for name in ["dynamic", *peers]}


DEFAULT_PATHS = {"quantized": QUANTIZED_VENV, "kvpress": KVPRESS_VENV}
