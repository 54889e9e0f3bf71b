"""`hf-kvcompress generate`: answer one prompt with any cache, streaming, then print speed and KV bytes."""

from __future__ import annotations

import sys
from pathlib import Path

from ..budget import kv_bytes_from_config
from .checks import DefaultsHelpFormatter, check_device


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="answer a prompt with a (compressed) KV cache",
        description="Answer one prompt with any cache spec, streaming the answer, then print prefill and decode "
        "speed, the bytes the KV cache holds and how many tokens it kept. The prompt goes through the model's chat "
        "template when it has one.",
        formatter_class=DefaultsHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the prompt text")
    source.add_argument("--prompt-file", type=Path, help="a file holding the prompt text")
    parser.add_argument("--model", default=None, help="alias, Hub id or local path (default: the embedded SmolLM2)")
    parser.add_argument("--cache", default="dynamic",
                        help="cache spec, e.g. int4, sink_window:window=256, h2o:budget=256+int4")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="most tokens to generate (greedy)")
    parser.add_argument("--prefill-chunk-size", type=int, default=None,
                        help="prefill in chunks of this many tokens (default: 512 for caches with bounded memory, "
                             "else the whole prompt at once)")  # fmt: skip
    parser.add_argument("--no-chat-template", action="store_true", help="send the prompt as plain text")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", default=None,
                        help="float32, bfloat16 or float16 (default: bfloat16 on CUDA, float32 on CPU)")  # fmt: skip
    parser.set_defaults(func=run)


def render_prompt(tokenizer, text: str, chat: bool = True) -> str:
    """The prompt as the model expects it: through its chat template when it has one."""
    if chat and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text


def served_summary(model, cache) -> str:
    """The cache's bytes at the dtype the model is served in, against an uncompressed cache of the same tokens in
    that dtype (`budget.kv_bytes_from_config`): the ratio a user serving in 16-bit sees, whatever this run's dtype."""
    # torch and the lab load here, not when the module is: `hf-kvcompress --help` reads none (tests/test_cli.py)
    import torch

    from ..eval.runner import served_name
    from ..measure import served_kv_bytes

    served = served_name(model)
    held = served_kv_bytes(cache, getattr(torch, served))
    full = kv_bytes_from_config(model.config, max(1, cache.get_seq_length()),
                                bytes_per_value=torch.empty((), dtype=getattr(torch, served)).element_size())
    ran = str(model.dtype).removeprefix("torch.")
    where = (f"in {served}, the dtype the model ran in" if ran == served else
             f"at {served}, the dtype the model is served in (it ran in {ran} here; keys and values counted at "
             f"{served}'s width)")
    return (f"{held:,} bytes {where}: {held / full:.3f} of the {full:,} bytes an uncompressed {served} cache holds "
            f"for the same {cache.get_seq_length()} tokens")


def run(args) -> int:
    # torch and the lab load here, not when the module is: `hf-kvcompress --help` reads none (tests/test_cli.py)
    from transformers import TextStreamer

    from ..generation import generate, repeat_prompt_ids
    from ..hf.attention import use_kvcompress_attention
    from ..models import load_model
    from ..registry import bounds_memory, make_cache, needs_attention, parse_spec
    from ..study import residual_note

    if args.max_new_tokens <= 0:
        raise ValueError(f"--max-new-tokens must be a positive number of tokens, got {args.max_new_tokens}")
    text = args.prompt if args.prompt is not None else args.prompt_file.read_text()
    if not text.strip():
        raise ValueError("the prompt is empty: give --prompt TEXT or --prompt-file PATH with some text")
    parse_spec(args.cache)  # validate the spec before loading a model (building the cache may need its config)
    check_device(args.device)
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    if needs_attention(args.cache):
        use_kvcompress_attention(model)
    cache = make_cache(args.cache, model.config)
    rendered = render_prompt(tokenizer, text, chat=not args.no_chat_template)
    inputs = tokenizer(rendered, return_tensors="pt", add_special_tokens=not getattr(tokenizer, "chat_template", None))
    inputs = inputs.to(model.device)
    chunk = args.prefill_chunk_size or (512 if bounds_memory(args.cache) else None)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    result = generate(
        model, inputs.input_ids, inputs.attention_mask, cache,
        max_new_tokens=args.max_new_tokens, streamer=streamer, prefill_chunk_size=chunk,
        repeat_prompt_ids=repeat_prompt_ids(tokenizer, chat=False if args.no_chat_template else None),
    )
    print(
        f"\n[cache {cache.spec}] prefill {result.prefill_tokens} tokens at "
        f"{result.prefill_tokens_per_second:.1f} tok/s; "
        f"decode {result.decode_tokens} tokens at {result.decode_tokens_per_second:.1f} tok/s; "
        f"KV cache holds {result.kv_bytes:,} bytes ({cache.stored_tokens} of {cache.get_seq_length()} tokens kept "
        "per layer)",
        file=sys.stdout,
    )
    print(f"[cache {cache.spec}] {served_summary(model, cache)}", file=sys.stdout)
    note = residual_note(cache.spec, cache.stored_tokens)  # the spec the cache runs (a ratio may be a byte target)
    if note is not None:
        print(f"[cache {cache.spec}] {note}", file=sys.stdout)
    return 0
