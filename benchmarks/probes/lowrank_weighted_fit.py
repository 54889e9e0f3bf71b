"""Low rank: do bases fitted to what attention reads lose less of each layer's attention output than plain PCA?

Question: (issue 30, a quarter of the dimensions) the joint bases minimise the keys' and values' own reconstruction
error. Attention reads q . k and, after the output projection, p V W_o. Fitted instead: keys to the query-weighted
error (the metric E[R(j)^T q q^T R(j)] of post-RoPE queries turned back to each key's position j, over key positions
drawn uniformly or by the attention they receive), values to the error after W_o (each KV head's Gram of its query
heads' W_o blocks), optionally with tokens weighted by the attention they receive. Each weighted fit is solved in
the metric's whitened coordinates (an SVD), giving an encoder and a decoder (oblique); `orth` keeps only the
decoder's span with an orthogonal projection (what the shipped codec format holds). Every fit is scored at the
shipped ranks of `--ratio` on held-out SQuAD text (the last `--queries` queries), the first 4 tokens and the newest
`--window` exact, as the codec keeps them: relative attention-output error after the output projection, summed over
layers, keys alone, values alone and both.
Command:
    python benchmarks/probes/lowrank_weighted_fit.py --model smollm2-135m --ratio 0.25
Written up: docs/results.md, "Low rank at a quarter: bases fitted to attention".
"""

from __future__ import annotations

import argparse

import torch

from hf_kvcompress.calibration import (
    attention_captures,
    attention_weights,
    calibration_ids,
    output_error,
    output_gram,
    rope_frequencies,
    unrotated,
)
from hf_kvcompress.codecs.lowrank import LowRankCodec
from hf_kvcompress.eval.data import squad_questions
from hf_kvcompress.models import load_model
from hf_kvcompress.ops.rerotate import rerotate


def joint(x: torch.Tensor) -> torch.Tensor:
    heads, tokens, dim = x.shape
    return x.permute(1, 0, 2).reshape(tokens, heads * dim).double()


def block_diag(blocks: list[torch.Tensor]) -> torch.Tensor:
    return torch.block_diag(*blocks).double()


def allowed_keys(length: int, queries: int, sinks: int, window: int) -> torch.Tensor:
    """[Q, T]: the projected keys each of the last `queries` positions reads (not a sink, not in its window)."""
    positions = torch.arange(length - queries, length)
    k = torch.arange(length)
    return (k[None] >= sinks) & (k[None] <= positions[:, None] - window)


def key_metric(config, capture, layer: int, draw: str, samples: int, sinks: int, window: int) -> torch.Tensor:
    """[W, W] block-diagonal metric of pre-RoPE key errors: per KV head, the mean of u u^T over its query heads'
    queries turned back to key positions j (drawn uniformly among the keys they read, or by attention)."""
    query, keys = capture["query"], capture["keys"]
    heads, length, dim = keys.shape
    groups, count = query.shape[0] // heads, query.shape[1]
    allowed = allowed_keys(length, count, sinks, window)  # [Q, T]
    if draw == "attention":
        probs = attention_weights(capture, keys).reshape(heads, groups, count, length) * allowed
    else:
        probs = allowed.double().expand(heads, groups, count, length)
    rows = probs.reshape(-1, length)
    live = rows.sum(-1) > 0
    drawn = torch.zeros(rows.shape[0], samples, dtype=torch.long)
    drawn[live] = torch.multinomial(rows[live].float(), samples, replacement=True)
    positions = drawn.reshape(heads, groups * count * samples).float()
    q = query.reshape(heads, groups, count, 1, dim).expand(-1, -1, -1, samples, -1).reshape(heads, -1, dim)
    inv_freq = torch.tensor(rope_frequencies(config)[layer])
    u = rerotate(q[None].float(), -positions[None], inv_freq)[0].double()  # [H, N, D]
    u = u * live.reshape(heads, groups * count, 1).repeat_interleave(samples, 1)
    return block_diag([u[h].T @ u[h] / max(1, int(live.sum())) for h in range(heads)])


def received(capture, sinks: int, window: int, power: float = 1.0) -> torch.Tensor:
    """[T]: the attention each token receives from the captured queries (sinks and window excluded), each weight
    raised to `power` (2: the variance an independent error of each value adds to the outputs)."""
    keys = capture["keys"]
    heads, length, _ = keys.shape
    probs = attention_weights(capture, keys).reshape(heads, -1, capture["query"].shape[1], length)
    return (probs.double().pow(power) * allowed_keys(length, probs.shape[2], sinks, window)).sum((0, 1, 2))


def fit(x: torch.Tensor, metric: torch.Tensor | None, weights: torch.Tensor | None, eps: float):
    """x [N, W] -> (mean [W], encoder [W, W], decoder [W, W]) minimising the (token-weighted) error in the metric at
    every rank (prefixes of the columns): latent = (x - mean) @ enc[:, :r], rebuilt = latent @ dec[:, :r].T + mean."""
    mean = x.mean(0)
    xc = x - mean
    if weights is not None:
        xc = xc * (weights / weights.mean()).clamp(min=0).sqrt()[:, None]
    if metric is None:
        _, vectors = torch.linalg.eigh(xc.T @ xc)
        basis = vectors.flip(-1)
        return mean, basis, basis
    width = metric.shape[0]
    metric = metric + eps * torch.trace(metric) / width * torch.eye(width, dtype=metric.dtype)
    values, vectors = torch.linalg.eigh(metric)
    root = vectors @ torch.diag(values.sqrt()) @ vectors.T
    inverse = vectors @ torch.diag(values.rsqrt()) @ vectors.T
    y = xc @ root
    _, v = torch.linalg.eigh(y.T @ y)
    v = v.flip(-1)
    return mean, root @ v, inverse @ v


def orthogonal(fitted):
    """The decoder's span with an orthogonal projection (nested over ranks: Gram-Schmidt in column order)."""
    mean, _, dec = fitted
    q, r = torch.linalg.qr(dec)
    q = q * torch.sign(torch.diagonal(r))[None]
    return mean, q, q


def rebuild(x: torch.Tensor, fitted, rank: int) -> torch.Tensor:
    mean, enc, dec = fitted
    return ((x - mean) @ enc[:, :rank]) @ dec[:, :rank].T + mean


def reconstruction(config, layer, capture, fits, ranks, sinks: int, window: int):
    keys, values = capture["keys"], capture["values"]
    heads, length, dim = keys.shape
    out = []
    for kind, x, rank in (("key", keys, ranks[0]), ("value", values, ranks[1])):
        if fits.get(kind) is None:
            out.append(x)
            continue
        plain = unrotated(x, config, layer) if kind == "key" else x
        rebuilt = rebuild(joint(plain), fits[kind], rank).float().reshape(length, heads, dim).transpose(0, 1)
        if kind == "key":
            inv_freq = torch.tensor(rope_frequencies(config)[layer])
            positions = torch.arange(length, dtype=torch.float32).expand(heads, -1)
            rebuilt = rerotate(rebuilt[None], positions[None], inv_freq)[0]
        exact = torch.zeros(length, dtype=torch.bool)
        exact[:sinks] = True
        if window:
            exact[-window:] = True
        out.append(torch.where(exact[None, :, None], x, rebuilt))
    return out[0], out[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--ratio", type=float, default=0.25)
    parser.add_argument("--fit-tokens", type=int, default=2048)
    parser.add_argument("--queries", type=int, default=256)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--samples", type=int, default=8, help="key positions drawn per query for the key metric")
    parser.add_argument("--eps", default="0.01", help="metric regularisers (share of its mean eigenvalue), commas")
    parser.add_argument("--kinds", default="key,value", help="which kinds to fit and score")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_model(args.model)
    sinks = 4
    codec = LowRankCodec(ratio=args.ratio).reduction_for_model(model.config)
    ranks = codec._ranks
    print(f"shipped ranks at {args.ratio}: keys {sum(r[0] for r in ranks)} values {sum(r[1] for r in ranks)}")
    ids = calibration_ids(tokenizer, args.fit_tokens)
    fit_caps = attention_captures(model, ids, args.fit_tokens)
    _, paragraphs, _ = squad_questions()
    held_out = tokenizer("\n\n".join(paragraphs[:80]), return_tensors="pt").input_ids[:, : args.fit_tokens]
    test = attention_captures(model, held_out, args.queries)
    layers = len(test)
    eps_list = [float(e) for e in args.eps.split(",")]
    key_fits: dict[str, list] = {}
    value_fits: dict[str, list] = {}
    for layer, cap in enumerate(fit_caps):
        heads, _, dim = cap["keys"].shape
        pre = joint(unrotated(cap["keys"], model.config, layer))
        vals = joint(cap["values"])
        key_fits.setdefault("pca", []).append(fit(pre, None, None, 0))
        value_fits.setdefault("pca", []).append(fit(vals, None, None, 0))
        tokens = received(cap, sinks, args.window)
        squared = received(cap, sinks, args.window, 2.0)
        for draw in ("uniform", "attention") if "key" in args.kinds else ():
            metric = key_metric(model.config, cap, layer, draw, args.samples, sinks, args.window)
            for eps in eps_list:
                fitted = fit(pre, metric, None, eps)
                key_fits.setdefault(f"q-{draw}-{eps}", []).append(fitted)
                key_fits.setdefault(f"q-{draw}-{eps}-orth", []).append(orthogonal(fitted))
        key_fits.setdefault("pca-attn-tokens", []).append(fit(pre, None, tokens, 0))
        wo = output_gram(model, layer, heads, dim)
        for eps in eps_list:
            for name, weights in (("wo", None), ("wo-attn-tokens", tokens), ("wo-attn-sq", squared),
                                  ("wo-attn-sqrt", tokens.sqrt())):
                fitted = fit(vals, wo, weights, eps)
                value_fits.setdefault(f"{name}-{eps}", []).append(fitted)
                value_fits.setdefault(f"{name}-{eps}-orth", []).append(orthogonal(fitted))
        value_fits.setdefault("pca-attn-tokens", []).append(fit(vals, None, tokens, 0))
        print(f"fitted layer {layer}", flush=True)

    def score(key_name, value_name):
        errors = []
        for layer in range(layers):
            fits = {"key": key_fits[key_name][layer] if key_name else None,
                    "value": value_fits[value_name][layer] if value_name else None}
            states = reconstruction(model.config, layer, test[layer], fits, ranks[layer], sinks, args.window)
            errors.append(output_error(model, test[layer], states, layer))
        return errors

    for name in key_fits if "key" in args.kinds else ():
        e = score(name, None)
        print(f"keys   {name:28s} sum {sum(e):.3f} max {max(e):.3f}", flush=True)
    for name in value_fits:
        e = score(None, name)
        print(f"values {name:28s} sum {sum(e):.3f} max {max(e):.3f}", flush=True)
    for value_name in ("pca", f"wo-attn-tokens-{eps_list[0]}-orth"):
        e = score("pca", value_name)
        print(f"both   pca / {value_name} sum {sum(e):.3f} max {max(e):.3f}")
        print("          per layer " + " ".join(f"{x:.2f}" for x in e), flush=True)


if __name__ == "__main__":
    main()
