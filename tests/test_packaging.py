"""The package installs and runs as a library apart from the lab: pyproject.toml, the extras, and what imports what.

A cache needs torch, transformers and safetensors. The evaluation suite, the study, the plots, the embedded models
and lm-eval are extras; the library path imports none of them, and a lab command or an embedded model without its
extra fails in one line naming `pip install "hf-kvcompress[EXTRA]"`.

A module is made absent in a subprocess by `sys.modules[name] = None`: `import name` then raises
ModuleNotFoundError and `importlib.util.find_spec(name)` says None, which is what transformers' availability checks
ask (a meta-path finder that raises would break those checks instead of answering them).
"""

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent

# What the lab needs and the library must not import. tqdm is not among them: transformers requires it itself.
LAB_MODULES = ("datasets", "evaluate", "matplotlib", "gguf", "lm_eval", "accelerate")

BLOCK = """
import sys
for name in filter(None, sys.argv[1].split(",")):
    sys.modules[name] = None  # as if not installed
"""

# The library path on a tiny random Llama saved to a folder (as a Hub checkpoint would be), with its tokenizer.
LIBRARY_PATH = BLOCK + """
import json
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import hf_kvcompress
from hf_kvcompress import (load_cache, load_model, make_cache, measured_kv_bytes, prefill, save_cache,
                           use_kvcompress_attention)
from hf_kvcompress.generation import generate

folder = sys.argv[2]
torch.manual_seed(0)
config = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
LlamaForCausalLM(config).save_pretrained(folder)
vocab = {f"w{i}": i for i in range(62)} | {"<unk>": 62, "</s>": 63}
words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
words.pre_tokenizer = pre_tokenizers.Whitespace()
PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", eos_token="</s>").save_pretrained(folder)

model, tokenizer = load_model(folder, device="cpu")
use_kvcompress_attention(model)
inputs = tokenizer([" ".join(f"w{i}" for i in range(1, 61))], return_tensors="pt")
for spec in ("sink_window:sink_tokens=2,window=8", "h2o:budget=12,recent=4", "int4", "fp8", "snapkv:budget=40+int8"):
    cache = make_cache(spec, model.config)
    out = model.generate(**inputs, cache=cache, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == inputs.input_ids.shape[1] + 4, (spec, out.shape)
    assert measured_kv_bytes(cache) > 0, spec
cache = make_cache("int4", model.config)
prefill(model, inputs.input_ids, inputs.attention_mask, cache)
save_cache(cache, f"{folder}/cache.safetensors")
question = torch.cat([inputs.input_ids, inputs.input_ids[:, :3]], 1)  # the document, then more after it
answer = generate(model, question, None, load_cache(f"{folder}/cache.safetensors"), max_new_tokens=4)
assert answer.new_tokens.shape[1] == 4, answer.new_tokens.shape
print(json.dumps(sorted({name.split(".")[0] for name, module in sys.modules.items() if module is not None})))
"""


def run_python(script: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -c script args...` from the repository root (this checkout's package first on sys.path)."""
    return subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=600)  # fmt: skip


def test_pyproject_reads_without_setuptools_warnings():
    from setuptools.config.pyprojecttoml import read_configuration

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = read_configuration(ROOT / "pyproject.toml", expand=True)
    assert [str(w.message) for w in caught] == []
    assert config["project"]["license"] == "Apache-2.0"  # an SPDX expression, not the deprecated table
    assert all((ROOT / name).is_file() for name in config["project"]["license-files"])


@pytest.mark.parametrize("absent", [LAB_MODULES, ()], ids=["core-only", "everything-installed"])
def test_the_library_path_imports_no_lab_module(absent, tmp_path):
    """make_cache, generate() with the caches, prefill, save/load and load_model on a folder, without the lab.

    Core-only: the lab's modules are absent, as in `pip install hf-kvcompress`. Everything installed: the library
    still imports none of them (accelerate aside: transformers imports it itself whenever it is installed).
    """
    done = run_python(LIBRARY_PATH, ",".join(absent), str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = set(json.loads(done.stdout.splitlines()[-1]))
    assert loaded & set(LAB_MODULES) <= ({"accelerate"} if not absent else set())
