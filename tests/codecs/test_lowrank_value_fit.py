"""Value bases fitted to the attention output (`calibrate_joint(value_fit="attention" | "oblique")`, research options
beside the default PCA): the weighted fit equals a plain reference solution of its problem, the token weights are
the attention each token receives (sinks and window left out), the W_o Gram is written out head by head, with an
identity metric and equal weights the fit is plain PCA, the file records the fit and survives a round trip, full rank
equals DynamicCache, bytes are the same as PCA bases', oblique bases encode with their own encoder, bad input is
refused."""

import pytest
import torch
from transformers import DynamicCache

from hf_kvcompress import make_cache, measured_kv_bytes
from hf_kvcompress.calibration import (
    OUTPUT_GRAM_RIDGE,
    attention_captures,
    calibrate_joint,
    concatenated,
    load_bases,
    output_gram,
    output_weighted_fit,
    output_weighted_pca,
    pca,
    received_attention,
    save_bases,
)

from ..caches.tiny_models import calibration_model


def _fitted_bases(model, ids, value_fit, folder, **kwargs):
    """The folder of joint bases fitted on `ids` with `value_fit` (calibrate_joint's other arguments in kwargs)."""
    tensors, metadata, _ = calibrate_joint(model, ids, text="random ids", value_fit=value_fit, **kwargs)
    return save_bases(tensors, metadata, folder).parent


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """{family: (model, {fit: bases dir}, ids)}: both value fits on the same ids, every component kept."""
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(0))
    out = {}
    for family in ("llama", "gemma3"):
        model = calibration_model(family)
        dirs = {}
        for fit in ("attention", "pca"):
            dirs[fit] = _fitted_bases(model, ids, fit, tmp_path_factory.mktemp(f"{family}-{fit}"))
        out[family] = model, dirs, ids
    return out


def _weighted_problem(seed=0, tokens=300, width=12):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, width, generator=g, dtype=torch.float64) @ torch.randn(width, width, generator=g,
                                                                                  dtype=torch.float64)
    x = x + 3.0  # a mean away from zero
    a = torch.randn(width, width, generator=g, dtype=torch.float64)
    gram = a @ a.T
    weights = torch.rand(tokens, generator=g, dtype=torch.float64) ** 3
    return x, gram, weights


def test_the_span_is_the_weighted_problems_solution_by_a_plain_svd():
    x, gram, weights = _weighted_problem()
    mean, basis, spectrum = output_weighted_pca(x, gram, weights)
    width = x.shape[1]
    # Reference, written out: whiten by a Cholesky factor of the regularised Gram (any square root gives the same
    # subspace), weight each row, take the SVD; the best rank-r decoders span L^-T V_r.
    regular = gram + OUTPUT_GRAM_RIDGE * torch.trace(gram) / width * torch.eye(width, dtype=torch.float64)
    chol = torch.linalg.cholesky(regular)  # regular = L L^T
    rows = (x - x.mean(0)) * (weights / weights.mean()).sqrt()[:, None]
    _, singular, vh = torch.linalg.svd(rows @ chol, full_matrices=False)
    assert torch.allclose(spectrum.double(), singular**2 / x.shape[0], rtol=1e-4, atol=1e-6)
    assert torch.allclose(mean.double(), x.mean(0), atol=1e-5)
    assert torch.allclose(basis.double().T @ basis.double(), torch.eye(width, dtype=torch.float64), atol=1e-5)
    for rank in (1, 3, 6):
        decoders = torch.linalg.solve(chol.T, vh[:rank].T)  # L^-T V_r
        q, _ = torch.linalg.qr(decoders)
        kept = basis[:, :rank].double()
        assert torch.allclose(kept @ kept.T, q @ q.T, atol=1e-4)
        # With the best coefficients in that span (weighted least squares in the metric), the weighted error is
        # the Eckart-Young tail: no rank-r decoder does better.
        c = torch.linalg.solve(kept.T @ regular @ kept, kept.T @ regular @ rows.T).T
        error = ((rows - c @ kept.T) @ chol).pow(2).sum()
        assert error == pytest.approx(float(singular[rank:].pow(2).sum()), rel=1e-5)


def test_identity_metric_and_equal_weights_give_plain_pca():
    x, _, _ = _weighted_problem(seed=1)
    width = x.shape[1]
    mean, basis, spectrum = output_weighted_pca(x, torch.eye(width, dtype=torch.float64),
                                                torch.ones(x.shape[0], dtype=torch.float64), ridge_share=0.0)
    plain_mean, plain_basis, variances = pca(x[None].float())
    assert torch.allclose(spectrum, variances[0], rtol=1e-4)
    assert torch.allclose(mean, plain_mean[0], atol=1e-5)
    for rank in (2, 5):
        a, b = basis[:, :rank].double(), plain_basis[0, :, :rank].double()
        assert torch.allclose(a @ a.T, b @ b.T, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_token_weights_are_the_attention_received_far_from_sinks_and_window(fitted, family):
    model, _, ids = fitted[family]
    layer = 1
    capture = attention_captures(model, ids[:, :60], 60)[layer]
    sinks, window = 3, 10
    weights = received_attention(capture, sinks, window)
    # Reference: each query head's softmax over the keys it may read (causal, the layer's sliding window), summed
    # over the keys' columns for keys at least `window` behind the query and past the sinks.
    query, keys = capture["query"].double(), capture["keys"].double()
    heads, length, _ = keys.shape
    groups = query.shape[0] // heads
    expected = torch.zeros(length, dtype=torch.float64)
    for head in range(query.shape[0]):
        for position in range(length):
            lo = 0 if not capture["window"] else max(0, position - capture["window"] + 1)
            logits = keys[head // groups, lo: position + 1] @ query[head, position] * capture["scaling"]
            if capture["softcap"]:
                logits = torch.tanh(logits / capture["softcap"]) * capture["softcap"]
            probs = logits.softmax(0)
            for k in range(lo, position + 1):
                if k >= sinks and k <= position - window:
                    expected[k] += probs[k - lo]
    assert torch.allclose(weights, expected, atol=1e-4)
    assert weights[:sinks].abs().max() == 0 and weights[length - window:].abs().max() == 0


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_output_gram_is_each_kv_heads_query_heads_wo_blocks(fitted, family):
    model, _, _ = fitted[family]
    attention = model.model.layers[0].self_attn
    weight = attention.o_proj.weight.detach().double()
    heads, dim = model.config.num_key_value_heads, model.config.head_dim
    groups = model.config.num_attention_heads // heads
    gram = output_gram(model, 0, heads, dim)
    for h in range(heads):
        block = sum(weight[:, q * dim: (q + 1) * dim].T @ weight[:, q * dim: (q + 1) * dim]
                    for q in range(h * groups, (h + 1) * groups))
        assert torch.allclose(gram[h * dim: (h + 1) * dim, h * dim: (h + 1) * dim], block)
    off = gram.clone()
    for h in range(heads):
        off[h * dim: (h + 1) * dim, h * dim: (h + 1) * dim] = 0
    assert off.abs().max() == 0


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_file_holds_the_calibrated_fit_and_keys_stay_pca(fitted, family):
    model, dirs, ids = fitted[family]
    attention, _ = load_bases(dirs["attention"], model.config)
    plain, metadata = load_bases(dirs["pca"], model.config)
    assert metadata["value_fit"] == "pca" and load_bases(dirs["attention"], model.config)[1]["value_fit"] == "attention"
    assert torch.equal(attention["layers.1.key_basis"], plain["layers.1.key_basis"])  # keys: the same PCA
    # The values' file basis is the weighted fit of the captured values (half precision in the file).
    capture = attention_captures(model, ids, ids.shape[1])[1]
    heads, _, dim = capture["values"].shape
    _, basis, spectrum = output_weighted_pca(concatenated(capture["values"])[0], output_gram(model, 1, heads, dim),
                                             received_attention(capture).sqrt())
    stored = attention["layers.1.value_basis"].double().reshape(heads * dim, -1)
    for rank in (4, 16):
        assert torch.allclose(stored[:, :rank] @ stored[:, :rank].T,
                              basis[:, :rank].double() @ basis[:, :rank].double().T, atol=2e-2)
    assert torch.allclose(attention["layers.1.value_variance"], spectrum, rtol=1e-3, atol=1e-6)
    assert not torch.allclose(stored[:, :4].abs(), plain["layers.1.value_basis"].double().reshape(heads * dim, -1)[
        :, :4].abs(), atol=1e-2)  # a different fit than PCA


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_full_rank_equals_dynamic_cache_and_bytes_match_pca_bases(fitted, family):
    model, dirs, _ = fitted[family]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2, 35), generator=g)

    def steps(cache):
        with torch.no_grad():
            outs = [model(input_ids=ids[:, :30], cache=cache).logits]
            for j in range(30, 35):
                outs.append(model(input_ids=ids[:, j:j + 1], cache=cache).logits)
        return torch.cat(outs, 1), cache

    # Keys rebuilt in float32: full rank equals DynamicCache to float32's rounding (a bf16 product, `compute`'s
    # default on a CPU that multiplies bf16 natively, rounds keys by ~2^-9: test_lowrank_attention.py bounds it).
    full, cache = steps(make_cache(f"lowrank:ratio=1.0,bases={dirs['attention']},compute=float32", model.config))
    assert (full - steps(DynamicCache())[0]).abs().max() < 1e-4
    assert cache.layers[-1].n_encoded == 35
    # The same ranks (rank=) hold the same bytes whichever fit wrote the bases.
    sizes = [measured_kv_bytes(steps(make_cache(f"lowrank:rank=8,bases={dirs[fit]}", model.config))[1])
             for fit in ("attention", "pca")]
    assert sizes[0] == sizes[1] > 0


def test_pca_is_the_default_and_a_bad_value_fit_is_refused(fitted):
    model, _, ids = fitted["llama"]
    assert calibrate_joint(model, ids[:, :40])[1]["value_fit"] == "pca"  # what the package ships
    with pytest.raises(ValueError, match="value_fit must be one of attention, oblique, pca"):
        calibrate_joint(model, ids, value_fit="svd")


def test_weights_that_are_all_zero_count_every_token_alike():
    x, gram, _ = _weighted_problem(seed=2)
    zero = output_weighted_pca(x, gram, torch.zeros(x.shape[0], dtype=torch.float64))
    equal = output_weighted_pca(x, gram, torch.ones(x.shape[0], dtype=torch.float64))
    for a, b in zip(zero, equal, strict=True):
        assert torch.isfinite(a).all() and torch.allclose(a, b)


@pytest.fixture(scope="module")
def oblique(tmp_path_factory):
    """{family: (model, bases dir)}: values fitted with an encoder of their own (value_fit="oblique")."""
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(0))
    out = {}
    for family in ("llama", "gemma3"):
        model = calibration_model(family)
        out[family] = model, _fitted_bases(model, ids, "oblique", tmp_path_factory.mktemp(f"{family}-oblique"),
                                           error_ids=ids[:, :120])
    return out


def test_the_oblique_fit_is_the_weighted_problems_minimiser():
    x, gram, weights = _weighted_problem(seed=3)
    width = x.shape[1]
    mean, encoder, decoder, spectrum = output_weighted_fit(x, gram, weights)
    regular = gram + OUTPUT_GRAM_RIDGE * torch.trace(gram) / width * torch.eye(width, dtype=torch.float64)
    chol = torch.linalg.cholesky(regular)
    rows = (x - x.mean(0)) * (weights / weights.mean()).sqrt()[:, None]
    _, singular, _ = torch.linalg.svd(rows @ chol, full_matrices=False)
    assert torch.allclose(encoder.double().T @ decoder.double(), torch.eye(width, dtype=torch.float64), atol=1e-4)
    for rank in (1, 4, 8):
        rebuilt = (rows @ encoder[:, :rank].double()) @ decoder[:, :rank].double().T
        error = ((rows - rebuilt) @ chol).pow(2).sum()
        assert error == pytest.approx(float(singular[rank:].pow(2).sum()), rel=1e-4)  # the Eckart-Young bound


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_oblique_bases_encode_with_their_encoder_and_full_rank_equals_dynamic_cache(oblique, family):
    model, bases = oblique[family]
    tensors, metadata = load_bases(bases, model.config)
    assert metadata["value_fit"] == "oblique" and "layers.1.value_encoder" in tensors
    assert "layers.1.key_encoder" not in tensors
    codec = make_cache(f"lowrank:ratio=0.5,bases={bases}", model.config).layers[1].codec
    rank = codec._ranks[1][1]
    g = torch.Generator().manual_seed(4)
    heads, dim = tensors["layers.1.value_mean"].shape
    values = torch.randn(1, heads, 9, dim, generator=g)
    # Reference: latent = (x - mean) E_r, rebuilt = latent D_r^T + mean with D_r rescaled so that E_r^T D_r = I.
    enc = tensors["layers.1.value_encoder"][..., :rank].double().reshape(heads * dim, rank)
    dec = tensors["layers.1.value_basis"][..., :rank].double().reshape(heads * dim, rank)
    dec = dec @ torch.linalg.inv(enc.T @ dec)
    mean = tensors["layers.1.value_mean"].double().reshape(-1)
    flat = concatenated(values[0].double())[0] - mean
    expected = ((flat @ enc) @ dec.T + mean).reshape(9, heads, dim).permute(1, 0, 2)[None]
    decoded = codec.decode(codec.encode(values, "value"), "value", torch.float32)
    assert torch.allclose(decoded.double(), expected, atol=1e-3)
    assert not torch.allclose(codec._layer.value_encoder, codec._layer.value_basis)  # oblique, not orthonormal
    assert codec._layer.key_encoder is codec._layer.key_basis
    # Full rank rebuilds every value: the cache answers as DynamicCache, through the decode-over-latents path too.
    ids = torch.randint(3, 128, (2, 35), generator=g)

    def steps(cache):
        with torch.no_grad():
            outs = [model(input_ids=ids[:, :30], cache=cache).logits]
            for j in range(30, 35):
                outs.append(model(input_ids=ids[:, j:j + 1], cache=cache).logits)
        return torch.cat(outs, 1)

    # compute=float32: full rank equals DynamicCache to float32's rounding (bf16 keys: test_lowrank_attention.py)
    full = steps(make_cache(f"lowrank:ratio=1.0,bases={bases},compute=float32", model.config))
    assert (full - steps(DynamicCache())).abs().max() < 1e-4


def test_oblique_bases_count_their_encoders_once_per_model(oblique, fitted):
    model, bases = oblique["llama"]
    _, dirs, _ = fitted["llama"]
    spec = "lowrank:rank=8,bases={}"
    plain = make_cache(spec.format(dirs["attention"]), model.config).layers[0].codec
    skew = make_cache(spec.format(bases), model.config).layers[0].codec
    width = plain._kv_heads * 32
    assert skew.model_bytes() - plain.model_bytes() == sum(4 * width * r[1] for r in skew._ranks)
