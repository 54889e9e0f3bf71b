"""Low rank: how much variance each kind of basis loses on text it was not fitted on.

Question: at a quarter and a half of a layer's key and value dimensions, how much of the held-out variance do
per-head bases of post-RoPE keys (as the cache receives them), per-head bases of pre-RoPE keys and one basis over a
layer's KV heads (pre-RoPE keys; values as they are) lose? The answer chose lowrank's joint pre-RoPE bases.
Command:
    python benchmarks/probes/lowrank_bases_error.py --model smollm2-135m --fit-tokens 2048 --test-tokens 1024
Written up: docs/methods.md, "`shared_heads` and `lowrank`".

The bases are fitted on the calibration text (`calibration.calibration_text`, HotpotQA paragraphs) and the error is
measured on SQuAD paragraphs (another source of Wikipedia text): the share of the held-out states' variance (about
their own mean) left in the residual of the projection, averaged over layers (and heads, per head).
"""

from __future__ import annotations

import argparse

import torch

from hf_kvcompress.calibration import calibration_ids, concatenated, layer_states, unrotated
from hf_kvcompress.eval.data import squad_questions
from hf_kvcompress.models import load_model


def lost(fit: torch.Tensor, test: torch.Tensor, rank: int) -> float:
    """fit [N, F], test [M, F]: the share of test's variance outside fit's first `rank` principal components."""
    fit, test = fit.double(), test.double()
    mean = fit.mean(0)
    _, vectors = torch.linalg.eigh((fit - mean).T @ (fit - mean) / fit.shape[0])
    basis = vectors.flip(-1)[:, :rank]
    residual = (test - mean) - (test - mean) @ basis @ basis.T
    return float(residual.pow(2).sum() / (test - test.mean(0)).pow(2).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--fit-tokens", type=int, default=2048)
    parser.add_argument("--test-tokens", type=int, default=1024)
    args = parser.parse_args()
    model, tokenizer = load_model(args.model)
    _, paragraphs, _ = squad_questions()
    held_out = tokenizer("\n\n".join(paragraphs[:80]), return_tensors="pt").input_ids[:, : args.test_tokens]
    fit = layer_states(model, calibration_ids(tokenizer, args.fit_tokens).to(model.device))
    test = layer_states(model, held_out.to(model.device))
    heads, _, dim = fit[0][0].shape
    print(f"{'share':>6s}  {'keys post-RoPE, per head':>25s}  {'pre-RoPE, per head':>19s}  {'pre-RoPE, joint':>16s}  "
          f"{'values, per head':>17s}  {'values, joint':>14s}")
    for share in (0.25, 0.5):
        rank = int(dim * share)
        sums = [0.0] * 5
        for i, ((kf, vf), (kt, vt)) in enumerate(zip(fit, test, strict=True)):
            pf, pt = unrotated(kf, model.config, i), unrotated(kt, model.config, i)
            sums[0] += sum(lost(kf[h], kt[h], rank) for h in range(heads)) / heads
            sums[1] += sum(lost(pf[h], pt[h], rank) for h in range(heads)) / heads
            sums[2] += lost(concatenated(pf)[0], concatenated(pt)[0], rank * heads)
            sums[3] += sum(lost(vf[h], vt[h], rank) for h in range(heads)) / heads
            sums[4] += lost(concatenated(vf)[0], concatenated(vt)[0], rank * heads)
        cells = [f"{s / len(fit):.3f}" for s in sums]
        print(f"{share:6.2f}  {cells[0]:>25s}  {cells[1]:>19s}  {cells[2]:>16s}  {cells[3]:>17s}  {cells[4]:>14s}")


if __name__ == "__main__":
    main()
