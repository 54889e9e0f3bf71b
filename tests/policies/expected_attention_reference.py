"""Expected Attention's score computed the plain way, for the tests: explicit D x D rotation matrices averaged
over the positions ahead, statistics first and rotated after, loops over rows and query heads."""

import torch


def rotation_matrix(position: int, inv_freq: torch.Tensor, dim: int) -> torch.Tensor:
    """RoPE's rotate-half rotation at `position` as a [D, D] matrix (channels past 2 * len(inv_freq) untouched)."""
    half = inv_freq.shape[0]
    matrix = torch.eye(dim, dtype=torch.float64)
    for j in range(half):
        angle = position * float(inv_freq[j])
        c, s = torch.cos(torch.tensor(angle, dtype=torch.float64)), torch.sin(torch.tensor(angle, dtype=torch.float64))
        matrix[j, j], matrix[j, j + half] = c, -s
        matrix[j + half, j], matrix[j + half, j + half] = s, c
    return matrix


def reference_scores(keys, values, queries, counted, next_position, inv_freq, pads, future, covariance=True,
                     value_norm=True, epsilon=0.0, sink_tokens=0):
    """[B, H_kv, T]: keys/values [B, H_kv, T, D], queries [B, H_q, N, D] (pre-RoPE, scaled), counted [B, N].
    Padding slots (the first pads[b] of row b) and the row's `sink_tokens` first real slots take no share of the
    softmax (their expectation is 0); compare real slots only."""
    batch, kv_heads, slots, dim = keys.shape
    q_heads = queries.shape[1]
    groups = q_heads // kv_heads
    out = torch.zeros(batch, kv_heads, slots, dtype=torch.float64)
    for b in range(batch):
        start = int(next_position[b])
        mean_rotation = sum(rotation_matrix(start + i, inv_freq, dim) for i in range(future)) / future
        real = range(int(pads[b]) + sink_tokens, slots)
        for h in range(q_heads):
            chosen = queries[b, h][counted[b]].double()  # [n, D]
            if chosen.shape[0]:
                mu = chosen.mean(0)
                sigma = (chosen - mu).T @ (chosen - mu) / chosen.shape[0]
            else:
                mu, sigma = torch.zeros(dim, dtype=torch.float64), torch.zeros(dim, dim, dtype=torch.float64)
            mu, sigma = mean_rotation @ mu, mean_rotation @ sigma @ mean_rotation.T
            kv = h // groups
            logits = []
            for t in real:
                k = keys[b, kv, t].double()
                logits.append(mu @ k + (k @ sigma @ k / 2 if covariance else 0.0))
            probs = torch.softmax(torch.stack(logits), 0)
            for i, t in enumerate(real):
                out[b, kv, t] += probs[i] / groups
        if value_norm:
            out[b] = (out[b] + epsilon) * values[b].double().norm(dim=-1)
    return out
