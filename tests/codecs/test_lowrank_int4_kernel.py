"""`lowrank:...+int4` decode steps on CPU: the C++ kernel reads int4's latent codes where they lie (`plain_codes`,
ops/cpu_lowrank.h `Codes`) instead of the whole store decoded in PyTorch at every step. The kernel decodes each tile
to the same latents, bit for bit, so a model's logits and `generate()`'s tokens are those of the kernel over the
decoded store (and within float32's rounding of the PyTorch path), on the tiny Llama and Gemma-3, padded batches,
float32 and bf16 products; where the codes say more than codes times scale plus zero (other widths, Lloyd-Max levels),
the store is decoded first, as before."""

import pytest
import torch

from hf_kvcompress import make_cache
from hf_kvcompress.codecs.intn import IntNCodec
from hf_kvcompress.generation import generate
from hf_kvcompress.ops import cpu_decode

from ..caches.tiny_models import fitted_joint_bases
from .test_lowrank_attention import _run, _spec

if not cpu_decode.available():
    pytest.skip("the CPU kernel cannot be built here (no C++ compiler?)", allow_module_level=True)

# int4 with per-channel key groups of 8 tokens and 16 tokens of residual: a 60-token prompt and 8 steps store 40 to
# 48 tokens' codes (more than 16: a Hadamard-rotated store of at most 16 is decoded by a matrix product, so PyTorch
# decodes it, `plain_codes`), hold latents after them and cross a tile between the two; and the plain name (groups
# of 32, a residual of 128) over a prompt long enough for codes.
SPECS = {"int4:residual_length=16,group_size=8": 60, "int4": 200}


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    return fitted_joint_bases(tmp_path_factory.mktemp)


def _reads(monkeypatch, in_place: bool) -> list[int]:
    """Counts the layers whose codes the kernel reads where they lie; `in_place=False`: none (`plain_codes` says
    None, so the store is decoded in PyTorch and the kernel reads the latents)."""
    reads = [0]
    original = IntNCodec.plain_codes

    def counted(self, *args, **kwargs):
        out = original(self, *args, **kwargs) if in_place else None
        reads[0] += out is not None
        return out

    monkeypatch.setattr(IntNCodec, "plain_codes", counted)
    return reads


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("storage", list(SPECS))
@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
def test_codes_read_in_place_give_the_decoded_stores_logits(fitted, family, storage, compute, monkeypatch):
    model, bases = fitted[family]
    spec = _spec(bases, f"lowrank:ratio=0.5+{storage}", compute)
    runs = {}
    for in_place in (True, False):
        with monkeypatch.context() as patch:
            reads = _reads(patch, in_place)
            runs[in_place] = _run(model, make_cache(spec, model.config), True, prompt=SPECS[storage], padded=True)
            # Each step reads the keys' and values' codes in place (2 per full-attention layer: Gemma-3's sliding
            # layers' windows of 6 hold no codes), or none.
            full = sum(kind != "sliding_attention" for kind in getattr(model.config, "layer_types", None)
                       or ["full_attention"] * model.config.num_hidden_layers)
            assert reads[0] == (2 * 8 * full if in_place else 0)
    assert torch.equal(runs[True], runs[False])


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_generated_tokens_equal_with_and_without_the_kernel(fitted, family, monkeypatch):
    """generate() on a padded batch: the kernel reading codes, the kernel reading decoded latents (the same tokens,
    bit for bit the same logits) and the PyTorch path (no kernel: the same greedy tokens at float32's rounding)."""
    model, bases = fitted[family]
    spec = _spec(bases, "lowrank:ratio=0.5+int4:residual_length=16,group_size=8")
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 128, (2, 60), generator=g)
    mask = torch.ones_like(ids)
    ids[0, :8], mask[0, :8] = 0, 0  # row 0 left-padded by a whole key group
    tokens = {}
    for name, in_place, kernel in (("codes", True, True), ("decoded", False, True), ("pytorch", True, False)):
        with monkeypatch.context() as patch:
            reads = _reads(patch, in_place)
            if not kernel:
                patch.setattr(cpu_decode, "available", lambda: False)
            tokens[name] = generate(model, ids, mask, make_cache(spec, model.config), max_new_tokens=12).new_tokens
            assert (reads[0] > 0) == (name == "codes")
    assert torch.equal(tokens["codes"], tokens["decoded"])
    assert torch.equal(tokens["codes"], tokens["pytorch"])


@pytest.mark.parametrize("storage", ["int8:residual_length=16,group_size=8",
                                     "int4:residual_length=16,group_size=8,codebook=gaussian"])
def test_codes_the_kernel_cannot_read_are_decoded_first(fitted, storage, monkeypatch):
    """int8, and int4's Lloyd-Max value levels: `plain_codes` says None for them, the kernel reads the latents
    decoded in PyTorch, and the logits are the PyTorch path's within float32's rounding."""
    model, bases = fitted["llama"]
    spec = _spec(bases, f"lowrank:ratio=0.5+{storage}")
    kernel = _run(model, make_cache(spec, model.config), True, padded=True)
    monkeypatch.setattr(cpu_decode, "available", lambda: False)
    torch_path = _run(model, make_cache(spec, model.config), True, padded=True)
    assert (kernel - torch_path).abs().max() < 1e-4 * max(1.0, torch_path.abs().max().item())
