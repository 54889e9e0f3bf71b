"""One ranking of the context's tokens for every full-attention layer: KVzip's `budgets=token`.

While the model repeats the context, the layers that copy it attend to a number's digits and the others need not;
yet answering a question later may read those digits in another layer. On Gemma-3-270M the needle's digits rank
in the best 5-25% of its first global layer's scores and in the worst half of its last (docs/results.md, "Gemma-3 at a
quarter of the bytes"), so per-layer or per-head rankings keep the needle in one layer and lose it in the others.
Scoring each token by its best over layers and heads keeps what any layer needs to rebuild the context in all of
them, with the same number of tokens per layer and head (the memory of `budgets=uniform`). With many heads the best
score flattens (every token has some head that attends to it): on SmolLM2 it is the wrong ranking.
"""

from __future__ import annotations

import torch


def share_token_scores(layers: list) -> None:
    """Give every layer's slots (`accumulated`, [B, H, T]) the best score of their token over all `layers`."""
    if not layers:
        return
    shapes = {tuple(layer.slots.accumulated.shape[::2]) for layer in layers}
    if len(shapes) != 1:
        raise RuntimeError(f"budgets=token needs the same slots in every full-attention layer, got {sorted(shapes)}")
    best = torch.stack([layer.slots.accumulated.amax(dim=1) for layer in layers]).amax(dim=0)  # [B, T]
    for layer in layers:
        layer.slots.accumulated = best[:, None, :].expand_as(layer.slots.accumulated).clone()
