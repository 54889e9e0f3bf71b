"""Tiny random-weight models of several families, built from configs (no downloads)."""

import pytest
import torch
import transformers

COMMON = dict(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON, num_key_value_heads=2),
    "llama_mha": lambda: transformers.LlamaConfig(**COMMON, num_key_value_heads=4),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, num_key_value_heads=2),
    "mistral": lambda: transformers.MistralConfig(**COMMON, num_key_value_heads=1, sliding_window=None),
    "phi3": lambda: transformers.Phi3Config(**COMMON, num_key_value_heads=2, pad_token_id=0),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **{**COMMON, "num_hidden_layers": 3}, num_key_value_heads=1, head_dim=32, sliding_window=6,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    ),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=128, n_embd=128, n_layer=2, n_head=4, n_positions=256),
}


def bytes_config() -> transformers.LlamaConfig:
    """The byte tests' model (tests/test_served_bytes.py, tests/test_study_bytes.py): 2 KV heads of 32 dims, a
    vocabulary with room for the reconstruction prompt's ids, positions for 600-token prompts. Not in CONFIGS: the
    contract suite runs on every model there."""
    return transformers.LlamaConfig(
        vocab_size=200, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )


def tiny_model(name: str):
    torch.manual_seed(0)
    config = CONFIGS[name]()
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # random weights: compare full-length outputs
    return model


def calibration_model(family: str):
    """`tiny_model(family)` on the package's attention, named `tiny-<family>`: calibration files record the
    model's name and are refused for another, so each family's tests fit and load under their own name."""
    from hf_kvcompress import use_kvcompress_attention

    model = use_kvcompress_attention(tiny_model(family))
    model.config._name_or_path = f"tiny-{family}"
    return model


def left_padded_prompts(seed=0, lengths=(5, 13, 9)):
    """Random prompts of `lengths` tokens: (the rows alone, [B, T] left-padded ids, their attention mask)."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(3, 128, (n,), generator=g) for n in lengths]
    return (rows, *left_padded(rows))


def left_padded(rows):
    """`rows` (1-D id tensors) as [B, T] left-padded ids and their attention mask."""
    width = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):], mask[i, width - len(row):] = row, 1
    return ids, mask


def padded_batch_against_rows_alone(model, spec, seed=3, lengths=(5, 13), max_new_tokens=6):
    """Generate from a left-padded batch with a cache of `spec`, assert each row's tokens equal the row run alone
    with a fresh cache, and return the batch's cache (for the caller's checks of what it holds)."""
    from hf_kvcompress import make_cache
    from hf_kvcompress.generation import generate

    rows, ids, mask = left_padded_prompts(seed=seed, lengths=lengths)
    cache = make_cache(spec, model.config)
    batched = generate(model, ids, mask, cache, max_new_tokens=max_new_tokens).new_tokens
    for i, row in enumerate(rows):
        alone = generate(model, row[None], torch.ones(1, len(row), dtype=torch.long), make_cache(spec, model.config),
                         max_new_tokens=max_new_tokens).new_tokens
        assert torch.equal(batched[i], alone[0]), (spec, i)
    return cache


def write_key_scales(directory, config, seed: int = 0, spread: float = 0.7):
    """Write a key-scales file (int codecs' key_scale) for `config`, naming the model "tiny-key-scales" in it and in
    the config: uneven channel scales exp(spread x N(0, 1)) per layer and KV head (0.7: the widest of 32 channels ~25
    times the narrowest, as on Gemma-3's global layers). Returns the file's path."""
    from hf_kvcompress.calibration import KEY_SCALES_FORMAT, save_key_scales
    from hf_kvcompress.hf.compat import text_config

    decoder = text_config(config)
    config._name_or_path = "tiny-key-scales"
    heads = getattr(decoder, "num_key_value_heads", None) or decoder.num_attention_heads
    head_dim = getattr(decoder, "head_dim", None) or decoder.hidden_size // decoder.num_attention_heads
    g = torch.Generator().manual_seed(seed)
    tensors = {f"layers.{i}.key_scale": torch.exp(spread * torch.randn(heads, head_dim, generator=g))
               for i in range(decoder.num_hidden_layers)}
    metadata = {"format": KEY_SCALES_FORMAT, "model": "tiny-key-scales", "layers": str(decoder.num_hidden_layers),
                "kv_heads": str(heads), "head_dim": str(head_dim), "stat": "absmax", "keys": "post_rope",
                "tokens": "0", "text": "random"}
    return save_key_scales(tensors, metadata, directory)


def masked_reference_attention(masks: dict):
    """An attention function (for `AttentionInterface.register`) that attends as the package's attention does, but
    over the full cache with each KV head's prompt pairs outside `masks[layer_idx]` ([H_kv, T] bool) masked: the
    plain reference of a cache that kept those pairs. Layers without an entry attend causally as usual."""
    from hf_kvcompress.hf.attention import kvcompress_attention

    def attend(module, query, key, value, attention_mask, **kwargs):
        keep = masks.get(module.layer_idx)
        if keep is not None:
            q_heads, q_len, kv_len = query.shape[1], query.shape[2], key.shape[2]
            allowed = torch.ones(1, q_heads, q_len, kv_len, dtype=torch.bool)
            allowed[..., : keep.shape[-1]] = keep.repeat_interleave(q_heads // keep.shape[0], 0)[None, :, None, :]
            causal = torch.arange(kv_len)[None, :] <= (torch.arange(q_len)[:, None] + kv_len - q_len)
            attention_mask = allowed & causal
        return kvcompress_attention(module, query, key, value, attention_mask, **kwargs)

    return attend


def masked_reference_logits(model, cache, steps: list, masks: dict, start: int) -> list:
    """The plain reference's logits for `steps` ([B, n] ids each, fed in turn at positions from `start`) over `cache`
    (a full cache of the prompt), each KV head's prompt pairs outside `masks[layer_idx]` masked
    (`masked_reference_attention`). The model gets the package's attention back afterwards."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from hf_kvcompress import use_kvcompress_attention

    AttentionInterface.register("masked_reference", masked_reference_attention(masks))
    AttentionMaskInterface.register("masked_reference", sdpa_mask)
    refs, position = [], start
    try:
        model.set_attn_implementation("masked_reference")
        with torch.inference_mode():
            for step in steps:
                where = torch.arange(position, position + step.shape[1])[None]
                refs.append(model(input_ids=step, cache=cache, position_ids=where).logits)
                position += step.shape[1]
    finally:
        use_kvcompress_attention(model)
    return refs


def fitted_joint_bases(mktemp) -> dict:
    """{family: (model, bases dir)} for the tiny Llama and Gemma-3 (`calibration_model`): joint pre-RoPE bases
    fitted on 200 random ids with every component kept, so `lowrank:ratio=1.0` is full rank. `mktemp`:
    pytest's `tmp_path_factory.mktemp`."""
    from hf_kvcompress.calibration import JOINT, calibrate_joint, save_bases

    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(0))
    out = {}
    for family in ("llama", "gemma3"):
        model = calibration_model(family)
        tensors, metadata, report = calibrate_joint(model, ids, text="random ids")
        assert metadata["heads"] == JOINT and metadata["keys"] == "pre_rope" and len(report) == len(model.model.layers)
        out[family] = model, save_bases(tensors, metadata, mktemp(family)).parent
    return out


def prompt_then_steps(model, cache, prompt=30, steps=5, batch=2) -> torch.Tensor:
    """Logits [B, prompt + steps, V] of a random prompt and then `steps` single-token steps, which read the encoded
    store (positions given, so caches of every kind see the same ones)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (batch, prompt + steps), generator=g)
    positions = torch.arange(prompt + steps)[None].expand(batch, -1)
    with torch.no_grad():
        outs = [model(input_ids=ids[:, :prompt], cache=cache, position_ids=positions[:, :prompt]).logits]
        for j in range(prompt, prompt + steps):
            outs.append(model(input_ids=ids[:, j:j + 1], cache=cache, position_ids=positions[:, j:j + 1]).logits)
    return torch.cat(outs, 1)


def filled_as_the_study_counts(model, spec: str, tokens: int = 40):
    """A cache of `spec` after a random prompt of `tokens`, checked to hold what the study's byte estimate
    (`study.promised_bytes`, at 4 new tokens) promises beside its per-layer bookkeeping."""
    from hf_kvcompress import make_cache
    from hf_kvcompress.study import promised_bytes

    cache = make_cache(spec, model.config)
    ids = torch.randint(3, 128, (1, tokens), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        model(input_ids=ids, cache=cache)
    bookkeeping = model.config.num_hidden_layers * 2 * 8  # each layer's pads and real_seen
    assert promised_bytes(spec, model.config, tokens, 4) == pytest.approx(cache.promised_kv_bytes() - bookkeeping)
    return cache


def kvzip_forced_logits(model, ids, mask, cache, tokens, repeat_prompt_ids=(5, 6, 7)):
    """Logits [B, 1 + t, V] of decode steps fed the prompt's last token and then `tokens` [B, t] (teacher forcing:
    caches compared see the same tokens), after KVzip's pass (`prefill` with `repeat_prompt_ids`) over the rest of the
    prompt; positions from the mask, as `generate` sets them."""
    from hf_kvcompress.generation import prefill
    from hf_kvcompress.hf.compat import cache_kwargs

    with torch.inference_mode():
        prefill(model, ids[:, :-1], mask[:, :-1], cache, repeat_prompt_ids=list(repeat_prompt_ids))
        feed, position, attention = torch.cat([ids[:, -1:], tokens], 1), mask.sum(-1, keepdim=True) - 1, mask
        logits = []
        for i in range(feed.shape[1]):
            logits.append(model(input_ids=feed[:, i : i + 1], attention_mask=attention, position_ids=position + i,
                                **cache_kwargs(cache)).logits[:, -1].float())
            attention = torch.cat([attention, torch.ones_like(attention[:, :1])], 1)
    return torch.stack(logits, 1)


def attend_per_head(joined, query, scaling):
    """Per-head stores' attention before heads were grouped (caches/joined_heads.py): one SDPA per (row, KV head)
    over its view, the reference for the grouped calls."""
    keys, values = joined.views(0), joined.views(1)
    return torch.cat([
        torch.nn.functional.scaled_dot_product_attention(
            query[i : i + 1], keys[i][None, None], values[i][None, None], scale=scaling)
        for i in range(query.shape[0])
    ])


HYBRID = ["sliding_attention", "sliding_attention", "full_attention"]


def tiny_hybrid_gemma(layer_types=HYBRID):
    """A tiny Gemma-3 with `layer_types` (64-token sliding windows, 1,024 positions) on our attention: the byte
    plans' tests need windows wider than CONFIGS' gemma3 holds."""
    from hf_kvcompress import use_kvcompress_attention

    config = transformers.Gemma3TextConfig(
        **{**COMMON, "num_hidden_layers": len(layer_types)}, num_key_value_heads=1, head_dim=32, sliding_window=64,
        layer_types=layer_types, max_position_embeddings=1024,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    return use_kvcompress_attention(model)


def greedy_logits_after_prefill(model, cache, ids, new_tokens=5, repeat_prompt_ids=(5, 6, 7)):
    """[B, new_tokens, V] greedy logits of model.generate on `ids`; a package cache is first prefilled with all but the
    last token by KVzip's pass (a DynamicCache is not)."""
    from hf_kvcompress.generation import prefill

    with torch.inference_mode():
        if not isinstance(cache, transformers.DynamicCache):
            prefill(model, ids[:, :-1], None, cache, repeat_prompt_ids=list(repeat_prompt_ids))
        out = model.generate(input_ids=ids, cache=cache, max_new_tokens=new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    return torch.stack(out.logits, 1)


def _exported_state(cache) -> dict:
    out = {}
    for i, layer in enumerate(cache.layers):
        tensors, meta = layer.export_state()
        out.update({f"{i}.{k}": t for k, t in tensors.items()})
        out.update({f"{i}.{k}": v for k, v in meta.items()})
    return out


def assert_same_state(a, b) -> None:
    """Two caches hold the same state, as saved (`export_state` of every layer): the same entries, tensors equal
    bit for bit with the same dtype and shape, numbers equal."""
    sa, sb = _exported_state(a), _exported_state(b)
    assert sa.keys() == sb.keys()
    for key in sa:
        x, y = sa[key], sb[key]
        if isinstance(x, torch.Tensor):
            same = x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
            assert same, key
        else:
            assert x == y, key
