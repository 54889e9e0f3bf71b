"""`hf-kvcompress budget`: lesson 13.1's KV cache budget, for the lesson's 8B model and for a real model's config.

With no flags it prints the lesson's table and worked example (exactly the lesson's numbers), then the same for the
embedded model if it is installed, so the figure a user reproduces from the lesson sits next to the one for the
model this package runs. `--lesson` prints the lesson alone; `--model NAME` prints that model alone. The other
flags change the workload for every section printed. Only configs are read: no weights are loaded.
"""

from __future__ import annotations

import argparse

from hf_kvcompress import budget


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `budget`; `run` is its entry point."""
    parser = subparsers.add_parser(
        "budget", help="KV cache size of each compression plan, and how many users fit on a GPU",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", metavar="NAME", help="a model name or local path whose config gives the shape "
                        "(default: the lesson's 8B shape, then the embedded model's)")
    source.add_argument("--lesson", action="store_true",
                        help="only the lesson's shape: 32 layers, 32 KV heads, head_dim 128")
    parser.add_argument("--tokens", type=int, default=budget.LESSON_TOKENS,
                        help="context tokens per user, prompt and reply together (default: %(default)s)")
    parser.add_argument("--users", type=int, default=budget.LESSON_USERS,
                        help="users served at once, for the table (default: %(default)s)")
    parser.add_argument("--kept-tokens", type=int, default=None,
                        help="tokens the eviction plan keeps (default: tokens // 8, the lesson's 4k)")
    parser.add_argument("--dtype", default=None, help="cache dtype: float16, bfloat16, float32, fp8, int8, int4 "
                        "(default: FP16 for the lesson; for a model its config's 16-bit dtype, else bfloat16, "
                        "the dtype models are served in)")
    parser.add_argument("--gpu-memory", type=float, default=float(budget.LESSON_GPU_GIB), metavar="GIB",
                        help="GPU memory in GiB (default: %(default)g)")
    parser.add_argument("--weights", type=float, default=None, metavar="GIB",
                        help="model weights in GiB (default: 16 for the lesson; a model's parameters x dtype)")
    parser.add_argument("--reserve", type=float, default=0.0, metavar="GIB",
                        help="GiB kept free for activations and buffers (default: %(default)g)")
    parser.set_defaults(func=run)
    return parser


def _check(args) -> None:
    """User errors as one line naming the flag, before any arithmetic."""
    for flag in ("tokens", "users"):
        if getattr(args, flag) <= 0:
            raise ValueError(f"--{flag} must be a positive integer, got {getattr(args, flag)}")
    if args.kept_tokens is not None and args.kept_tokens <= 0:
        raise ValueError(f"--kept-tokens must be a positive integer, got {args.kept_tokens}")
    if not args.gpu_memory > 0:
        raise ValueError(f"--gpu-memory must be > 0 GiB, got {args.gpu_memory:g}")
    for flag in ("weights", "reserve"):
        value = getattr(args, flag)
        if value is not None and not value >= 0:
            raise ValueError(f"--{flag} must be >= 0 GiB, got {value:g}")


def _load_config(name: str | None):
    """The config alone: an embedded model's GGUF is read, not converted (no weights are loaded or written)."""
    from ..models import load_config  # models.py reads torch: not for --help (tests/test_cli.py)

    return load_config(name, convert=False)


def _parameter_count(config) -> int:
    """Parameters of the model a config describes, counted on the meta device: no memory, no download."""
    import torch  # as load_config above
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(param.numel() for param in model.parameters())


def _dtype(args, declared) -> tuple[float, str, str | None]:
    """Bytes per value, its label, and a note when the served dtype was assumed: `--dtype`, else the config's
    16-bit dtype, else bfloat16 (a config's float32 is how the weights were stored, not how the model is served)."""
    if args.dtype is not None:
        return budget.dtype_bytes(args.dtype), budget.dtype_label(None, args.dtype), None
    name, note = budget.served_dtype(declared)
    if note is not None:
        said = f"the config declares {declared}" if declared is not None else "the config declares no dtype"
        note = f"{said}; counted at {name}, the dtype models are served in (--dtype float32 to count that)"
    return budget.dtype_bytes(name), budget.dtype_label(None, name), note


def _describe(shape: budget.KVShape) -> str:
    if shape.latent_dim is not None:
        heads = f"MLA latent of {shape.latent_dim} values"
    else:
        query = f" for {shape.attention_heads} query heads" if shape.attention_heads else ""
        heads = f"{shape.kv_heads} KV head{'s' if shape.kv_heads != 1 else ''}{query}, head_dim {shape.head_dim}"
    return f"{shape.layers} layers, {heads}"


def _section(title: str, shape: budget.KVShape, args, bytes_per_value: float, label: str, weights_gib: float | None,
             notes: list[str]) -> str:
    """One shape's table and worked example; the example is skipped (with a note) when the weights are unknown."""
    table = budget.compression_plans(shape, args.tokens, args.users, bytes_per_value, args.kept_tokens, label)
    lines = [f"{title}: {_describe(shape)}; {args.tokens:,} tokens x {args.users} users (GB = GiB = 1024**3 bytes)",
             budget.format_plans(table), ""]
    if weights_gib is None:
        notes = notes + ["weights unknown, so no users-per-GPU plan: pass --weights GIB"]
    else:
        plans = budget.capacity_plans(shape, args.gpu_memory * budget.GIB, weights_gib * budget.GIB, args.tokens,
                                      bytes_per_value, (args.reserve or 0) * budget.GIB, label)
        lines += [budget.format_capacity(plans), ""]
    lines += [f"note: {note}" for note in notes]
    return "\n".join(lines).rstrip("\n")


def _lesson_section(args) -> str:
    bytes_per_value, label, _ = _dtype(args, "float16")
    weights = args.weights if args.weights is not None else float(budget.LESSON_WEIGHTS_GIB)
    return _section("Lesson 13.1 (8B-class model)", budget.LESSON_SHAPE, args, bytes_per_value, label, weights, [])


def _model_section(args, name: str | None) -> str:
    config = _load_config(name)
    shape = budget.kv_shape_from_config(config)
    bytes_per_value, label, note = _dtype(args, shape.dtype)
    notes = [note] if note else []
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    longest = getattr(text, "max_position_embeddings", None)
    if longest and args.tokens > longest:
        notes.append(f"{args.tokens:,} tokens is more than this model's max_position_embeddings ({longest:,})")
    weights = args.weights
    if weights is None:
        try:
            params = _parameter_count(config)
        except (ValueError, KeyError, TypeError, ImportError, OSError) as error:
            notes.append(f"could not count parameters ({error})")
        else:
            weights = budget.weight_bytes(params, bytes_per_value) / budget.GIB
            notes.append(f"weights: {params:,} parameters x {bytes_per_value:g} bytes = {weights:.3g} GiB")
    title = f"{name or 'Embedded model'} ({getattr(config, 'model_type', None) or type(config).__name__})"
    return _section(title, shape, args, bytes_per_value, label, weights, notes)


def run(args) -> int:
    """Print the sections the flags ask for; user errors raise ValueError, which the CLI prints as one line."""
    _check(args)
    if args.model is not None:
        try:
            print(_model_section(args, args.model))
        except OSError as error:  # transformers reports a missing model as OSError; the CLI prints ValueErrors
            raise ValueError(f"cannot read the config of {args.model!r}: {error}") from None
        return 0
    print(_lesson_section(args))
    if args.lesson:
        return 0
    print()
    try:
        print(_model_section(args, None))
    except (ValueError, OSError, ImportError) as error:
        print(f"Embedded model: not shown ({error})")
    return 0
