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
import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).parent.parent

# What the lab needs and the library must not import. tqdm is not among them: transformers requires it itself.
LAB_MODULES = ("datasets", "evaluate", "matplotlib", "gguf", "lm_eval", "accelerate")
CORE = {"torch", "transformers", "safetensors"}
DISTRIBUTION = {"lm_eval": "lm-eval"}  # import name -> distribution name, where they differ

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
for spec in ("sink_window:sink_tokens=2,window=8", "h2o:budget=12,recent=4", "int4", "fp8",
             "snapkv:budget=40,window=16,recent=16+int8"):
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


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_pyproject_reads_without_setuptools_warnings():
    from setuptools.config.pyprojecttoml import read_configuration

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = read_configuration(ROOT / "pyproject.toml", expand=True)
    assert [str(w.message) for w in caught] == []
    assert config["project"]["license"] == "Apache-2.0"  # an SPDX expression, not the deprecated table
    assert all((ROOT / name).is_file() for name in config["project"]["license-files"])


def test_the_core_dependencies_are_what_a_cache_needs():
    assert {Requirement(r).name for r in pyproject()["project"]["dependencies"]} == CORE


def test_each_extra_installs_the_modules_its_check_asks_for():
    """extras.EXTRAS (what `require` checks) and pyproject.toml's extras (what pip installs) name the same modules."""
    from hf_kvcompress.extras import EXTRAS

    declared = pyproject()["project"]["optional-dependencies"]

    def installs(extra: str) -> set[str]:  # distribution names, through the extras an extra names (`[models]`)
        names = set()
        for requirement in map(Requirement, declared[extra]):
            names |= set().union(*map(installs, requirement.extras)) if requirement.name == "hf-kvcompress" else {
                requirement.name}
        return names

    for extra, modules in EXTRAS.items():
        assert {DISTRIBUTION.get(m, m) for m in modules} <= installs(extra), extra
    assert set(EXTRAS) <= set(declared)
    lab = set(LAB_MODULES) | {"tqdm"}
    assert {DISTRIBUTION.get(m, m) for m in lab} <= installs("all")


def test_make_setup_installs_every_extra_the_suite_needs():
    makefile = (ROOT / "Makefile").read_text()
    assert '-e ".[all,test]"' in makefile


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


def test_import_and_cli_help_import_no_torch_and_no_lab_module():
    script = BLOCK + """
import json
import hf_kvcompress
from hf_kvcompress.cli import build_parser
build_parser()
print(json.dumps(sorted({name.split(".")[0] for name, module in sys.modules.items() if module is not None})))
"""
    done = run_python(script, ",".join(LAB_MODULES))
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = set(json.loads(done.stdout.splitlines()[-1]))
    assert not loaded & {*LAB_MODULES, "torch", "transformers"}


def test_an_embedded_model_without_gguf_names_the_models_extra(tmp_path):
    """Converting a GGUF file needs gguf (transformers reads it with that package): the error names the extra."""
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")  # never read: the check comes before the conversion
    script = BLOCK + """
from hf_kvcompress import load_model
from hf_kvcompress.extras import MissingExtraError
try:
    load_model(sys.argv[2])
except MissingExtraError as error:
    print(error)
"""
    env = {**__import__("os").environ, "HF_KVCOMPRESS_CACHE": str(tmp_path / "cache")}
    done = run_python(script, "gguf", str(gguf), env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert 'pip install "hf-kvcompress[models]"' in done.stdout
    assert "gguf" in done.stdout


@pytest.mark.parametrize(
    "argv, absent, extra",
    [
        (["eval", "--out", "OUT", "--methods", "int4"], "datasets", "eval"),
        (["study", "--out", "OUT"], "matplotlib", "eval"),
        (["demo", "--out", "OUT"], "evaluate", "eval"),
        (["lm-eval", "ls", "tasks"], "lm_eval", "lm-eval"),
    ],
)
def test_a_lab_command_without_its_extra_fails_in_one_line(argv, absent, extra, tmp_path):
    script = BLOCK + """
import json
from hf_kvcompress.cli import main
sys.exit(main(json.loads(sys.argv[2])))
"""
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    done = run_python(script, absent, json.dumps(argv))
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"hf-kvcompress {argv[0]}: error: ") and absent in line, line
    assert f'pip install "hf-kvcompress[{extra}]"' in line, line
    assert not (tmp_path / "out").exists()  # refused before anything ran
