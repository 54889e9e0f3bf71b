"""What does `kvzap:budget=N` evict while decoding: the document's pairs or the generated ones, and the answer's?

Question: (issue 28, Gemma-3's decoding target) after a 2k-token document and N new tokens decoded under a KVzap
budget, which positions does each full-attention layer still hold (document vs generated tokens), are the asked
fact's tokens among them, and are the probe's scores of the generated tokens on the scale of the document's (the
scores the store kept each pair by, against the probe's estimates recomputed from one plain forward pass)?
Command:
    python benchmarks/probes/kvzap_decode_evictions.py [--model gemma-3-270m] [--split dev]
        [--method "kvzap:budget=1024"] [--new-tokens 512] [--samples 1] [--depths 10 50 90]
Written up: docs/results.md, "KVzap while decoding on Gemma-3: what the budget evicts".

Each document is prefilled and continued as in kvzap_long_decode.py; then one plain forward pass (DynamicCache) over
the same tokens gives every position's keys and the probe's inputs. Each pair a ranked layer holds is matched to its
position by its key (nearest key of the plain pass: RoPE makes every position's key distinct).
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
from kvzap_layer_shares import answer_positions
from kvzap_long_decode import continued
from transformers import DynamicCache

from hf_kvcompress import load_model, make_cache, repeat_prompt_ids, use_kvcompress_attention
from hf_kvcompress.eval.prompts import encode
from hf_kvcompress.eval.runner import served_torch_dtype
from hf_kvcompress.eval.scoring import score_all
from hf_kvcompress.eval.tasks import build_samples
from hf_kvcompress.generation import generate
from hf_kvcompress.hf.hidden_states import attention_modules
from hf_kvcompress.policies.kvzip import best_ahead
from hf_kvcompress.probes import estimated_score


@torch.inference_mode()
def plain_pass(model, ids: list[int], layers: list[int]):
    """(keys [T, D] of KV head 0, probe inputs [T, hidden]) per layer of `layers`, from one DynamicCache forward."""
    modules = attention_modules(model)
    hidden: dict[int, torch.Tensor] = {}

    def record(i):
        def hook(module, args, kwargs):
            hidden[i] = kwargs.get("hidden_states", args[0] if args else None)[0].float().clone()
        return hook

    handles = [modules[i].register_forward_pre_hook(record(i), with_kwargs=True) for i in layers]
    try:
        cache = DynamicCache(config=model.config)
        model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    finally:
        for handle in handles:
            handle.remove()
    return {i: cache.layers[i].keys[0, 0].float() for i in layers}, hidden


def held_positions(layer, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, stored scores) of the pairs a head store holds in KV head 0, matched by nearest key in `keys`
    [T, D]; the tail's valid tokens get score nan (not yet ranked)."""
    store = layer.store
    held = store.encoded.heads(store.codec, "key", torch.float32)[0]
    scores = store.encoded.scores[: held.shape[0]]
    if store.tail_keys is not None:
        valid = store.tail_valid[0]
        tail = store.tail_keys[0, 0].float()[valid]
        held = torch.cat([held, tail])
        scores = torch.cat([scores, torch.full((tail.shape[0],), float("nan"))])
    nearest = torch.cdist(held.float(), keys).argmin(-1)
    return nearest, scores


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--methods", nargs="+", default=["kvzap:budget=1024"])
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--tasks", nargs="+", default=["needle", "multi_question"])
    parser.add_argument("--depths", type=float, nargs="+", default=[10, 50, 90])
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--split", default="dev")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))

    model, tok = load_model(args.model)
    use_kvcompress_attention(model)
    dtype = served_torch_dtype(model)
    prompt = repeat_prompt_ids(tok)
    rows = [dict(r) for r in build_samples(tok, args.tasks, [2000], args.depths, samples_per_cell=args.samples,
                                           seed=0, split=args.split)]
    done: set[tuple] = set()
    for row in rows:
        doc, question = encode(tok, row)
        if tuple(doc) in done:
            continue
        done.add(tuple(doc))
        for method in args.methods:
            report(model, tok, row, doc, question, method, prompt, args.new_tokens, dtype)


def report(model, tok, row, doc, question, method, prompt, new_tokens, dtype):
    """Print what each ranked layer holds after the continuation, and the answer to the document's question."""
    for _ in (1,):
        cache = make_cache(method, model.config)
        cache, seen, _, _ = continued(model, doc, cache, prompt, new_tokens, dtype)
        with torch.inference_mode():
            out = generate(model, torch.tensor([seen + question]), None, copy.deepcopy(cache),
                           max_new_tokens=row["max_new_tokens"])
        text = tok.decode(out.new_tokens[0], skip_special_tokens=True)
        right = score_all([text], [row["references"]])[row["metric"]][0] >= 100.0
        ranked = [i for i, layer in enumerate(cache.layers) if layer.per_head]
        span = cache.policy.span
        held_ids = seen[:-1]  # the last generated token is not yet in the cache
        keys, hidden = plain_pass(model, held_ids, ranked)
        where = answer_positions(tok, doc, row["references"])
        n_doc = len(doc)
        print(f"{method} {row['task']} depth {row['depth']}: answered {int(right)} ({text!r}); document {n_doc} "
              f"tokens, {len(held_ids) - n_doc} generated; "
              f"answer tokens {where[:1]}..{where[-1:]} ({len(where)})", flush=True)
        for i in ranked:
            positions, stored = held_positions(cache.layers[i], keys[i])
            estimate = best_ahead(estimated_score(cache.layers[i].probe(hidden[i][None]))[:, :1], span)[0, 0]
            is_doc = positions < n_doc
            ranked_doc = is_doc & ~torch.isnan(stored) & (stored < 1.0)  # the document's pairs ranked by the probe
            gen = ~is_doc & ~torch.isnan(stored)
            diff = (stored[gen] - estimate[positions[gen]]).abs().max().item() if gen.any() else float("nan")
            diff_doc = ((stored[ranked_doc] - estimate[positions[ranked_doc]]).abs().max().item()
                        if ranked_doc.any() else float("nan"))
            answer = sum(int(p in set(positions.tolist())) for p in where)
            doc_est, gen_est = estimate[:n_doc - 128], estimate[n_doc:]
            print(f"  L{i}: allowance {int(cache.layers[i].store.allowance[0])}, holds {positions.numel()} "
                  f"({positions.unique().numel()} distinct): document "
                  f"{int(is_doc.sum())} (of them the last 128: {int((positions >= n_doc - 128)[is_doc].sum())}), "
                  f"generated {int((~is_doc).sum())}; answer tokens held {answer}/{len(where)}; "
                  f"probe estimate (span {span}) median document {doc_est.median():.3f} / "
                  f"generated {gen_est.median():.3f}; ranked pairs held: document median "
                  f"{stored[ranked_doc].median() if ranked_doc.any() else float('nan'):.3f}, generated median "
                  f"{stored[gen].median() if gen.any() else float('nan'):.3f}; "
                  f"answer tokens' estimates {[round(v, 3) for v in estimate[where].tolist()]}; "
                  f"|stored - recomputed| max document {diff_doc:.2e} generated {diff:.2e}", flush=True)


if __name__ == "__main__":
    main()
