"""What Expected Attention's cache holds after the document and after the question, beside ExpectedAttentionPress's
(issue 27).

Question: on one development prompt, does our `expected_attention` evict document pairs while the question is read,
does it hold R of the document or R of document + question, and how many of the pairs kvpress 0.5.5's
ExpectedAttentionPress keeps does ours keep after each step? kvpress's pipeline compresses the document under the
press and appends the question whole, unscored.
Command:
    PYTHONPATH=. python benchmarks/probes/expected_attention_question_step.py [--model smollm2-135m] \\
        [--task multi_question] [--depth 90] [--index 0] [--split dev] [--specs "expected_attention:ratio=0.25"] \\
        [--out results/ea-question-step]
Written up: docs/results.md, "Expected Attention's question step beside ExpectedAttentionPress (issue 27, session
37; helper i27x)".

kvpress's scores come from press_scores_worker.py in kvpress's environment (benchmarks/.venv-kvpress); its kept
document pairs are the top int(R x T) of each layer and head, as its ScorerPress keeps them, and it holds them plus
every question pair. Ours: the spec's cache is fed as `hf-kvcompress eval` feeds it (the document prefilled at once,
then the question as generate() prefills it: all but its last token with compress=False, then the last token as a
decode step). Kept pairs are found by matching each kept key with the uncompressed cache's keys of the same layer and
head (keys carry their position; the nearest is far nearer than the next). Bytes are bf16, over DynamicCache's for
the same tokens. Printed per spec: bytes after the document and after the question, the document pairs kept after each
(share of T), the question pairs kept (share of the question), and the share of kvpress's kept document pairs ours
keeps after each step (mean over layers and KV heads).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # kvzip_scores_vs_kvpress reaches the kvpress environment (peer_envs.py)

from kvzip_scores_vs_kvpress import kvpress_scores  # noqa: E402
from press_scores_vs_kvpress import add_prompt_arguments, one_prompt  # noqa: E402


def kept_slots(cache, full: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """([L, H, T] bool: which of the document's uncompressed keys `full` ([1, H, T, D] per layer) the cache holds,
    [L, H]: how many kept pairs are not the document's (the question's)). A kept key is a document pair when its
    nearest document key is far nearer than the next: another cache's float32 arithmetic moves keys slightly (about
    0.01 at norms near 10), and a question's keys in later layers differ more (its queries saw a compressed cache)."""
    held, others = [], []
    for layer, keys in zip(cache.layers, full, strict=True):
        kept = layer.tail_keys[0].float()  # [H, K, D]
        two = torch.cdist(kept, keys[0].float()).topk(2, dim=-1, largest=False)  # [H, K, 2]
        document = two.values[..., 0] < 0.2 * two.values[..., 1]
        mask = torch.zeros(keys.shape[1], keys.shape[2], dtype=torch.long)
        mask.scatter_add_(-1, two.indices[..., 0], document.long())
        assert int(mask.max()) <= 1, "two kept keys match one document key"
        held.append(mask.bool())
        others.append((~document).sum(-1))
    return torch.stack(held), torch.stack(others)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_prompt_arguments(parser, task="multi_question")
    parser.add_argument("--specs", default="expected_attention:ratio=0.5;expected_attention:ratio=0.25;"
                        "expected_attention:ratio=0.125", help="our specs, separated by ';'")
    parser.add_argument("--out", default="results/ea-question-step")
    args = parser.parse_args()
    from transformers import DynamicCache

    from hf_kvcompress import make_cache, prefill
    from hf_kvcompress.hf.compat import cache_kwargs
    from hf_kvcompress.measure import served_kv_bytes
    from hf_kvcompress.models import ensure_converted
    from hf_kvcompress.registry import parse_spec

    model, _, row, out, document_ids, question_ids = one_prompt(args)
    tokens, asked = len(document_ids), len(question_ids)
    print(f"{row['sample_id']}: document {tokens} tokens, question {asked} tokens", flush=True)
    theirs = kvpress_scores(str(ensure_converted(args.model)), document_ids, out, worker="press_scores_worker.py",
                            saved="kvpress_press_scores.pt")["ExpectedAttentionPress"]  # [L, H, T]
    document = torch.tensor([document_ids])
    question = torch.tensor([question_ids])

    def feed(cache):
        """The document at once, then the question as generate() feeds it; the bytes after each step."""
        with torch.inference_mode():
            prefill(model, document, None, cache)
            after_document = served_kv_bytes(cache, torch.bfloat16)
            mask = torch.ones(1, tokens + asked - 1, dtype=torch.long)
            prefill(model, question[:, :-1], mask, cache, compress=False)
            model(input_ids=question[:, -1:], position_ids=torch.tensor([[tokens + asked - 1]]), use_cache=True,
                  **cache_kwargs(cache))
        return after_document, served_kv_bytes(cache, torch.bfloat16)

    dynamic = DynamicCache(config=model.config)
    full_document, full_all = feed(dynamic)
    full_keys = [layer.keys for layer in dynamic.layers]
    print(f"DynamicCache: {full_document} bytes after the document, {full_all} after the question (bf16)")
    for spec in args.specs.split(";"):
        share = parse_spec(spec)[0].ratio
        keep_theirs = torch.zeros_like(theirs, dtype=torch.bool)
        keep_theirs.scatter_(-1, theirs.topk(max(1, int(tokens * share)), dim=-1).indices, True)
        held_theirs = (keep_theirs.sum() + asked * theirs.shape[0] * theirs.shape[1]) / (
            theirs.shape[0] * theirs.shape[1] * (tokens + asked))
        print(f"\nExpectedAttentionPress keep {share}: {share:.3f} of the document's bytes after it (int(R x T) "
              f"pairs), {held_theirs:.3f} after the question (every question pair kept)")
        cache = make_cache(spec, model.config)
        after_document_bytes, after_question_bytes = feed(cache)
        # The cache after the document: fed again (the question changes what it holds).
        first = make_cache(spec, model.config)
        with torch.inference_mode():
            prefill(model, document, None, first)
        doc_kept, strays = kept_slots(first, [k[:, :, :tokens] for k in full_keys])  # [L, H, T]
        assert int(strays.max()) == 0, "a kept key after the document matches no document key"
        after_doc_kept, question_kept = kept_slots(cache, [k[:, :, :tokens] for k in full_keys])
        print(f"  {spec}")
        print(f"    bytes: {after_document_bytes / full_document:.3f} after the document, "
              f"{after_question_bytes / full_all:.3f} after the question")
        print(f"    document pairs kept: {doc_kept.float().mean():.3f} of T after the document, "
              f"{after_doc_kept.float().mean():.3f} after the question; question pairs kept: "
              f"{question_kept.float().mean() / asked:.3f} of {asked}")
        evicted = (doc_kept & ~after_doc_kept).float().sum(-1).mean()
        print(f"    document pairs the question step evicted: {evicted:.1f} per layer and head "
              f"({evicted / asked:.2f} per question token)")
        shared_doc = (doc_kept & keep_theirs).sum() / keep_theirs.sum()
        shared_q = (after_doc_kept & keep_theirs).sum() / keep_theirs.sum()
        print(f"    kvpress's kept document pairs ours keeps: {shared_doc:.3f} after the document, "
              f"{shared_q:.3f} after the question")


if __name__ == "__main__":
    main()
