"""Why KVzip loses the asked needle among distractors: its scores of each needle's tokens, and the answers it gives
with other scores or other pass settings (issue 27).

Question: on multi_needle prompts (four "The special magic number for {key} is: {value}." sentences, one asked),
where do the asked needle's tokens rank among every (layer, KV head, token) pair under our reconstruction scores
(and under kvpress 0.5.5's KVzipPress's, with `--kvpress`), and does the real `kvzip:ratio=R` cache answer when its
scores are replaced (`--inject`) or the pass is changed (`--variants`)?
Command:
    PYTHONPATH=. python benchmarks/probes/kvzip_multi_needle_scores.py [--model smollm2-135m] [--ratios 0.5 0.25] \\
        [--split dev] [--depths 10 50 90] [--samples 2] [--kvpress] [--variants "kvzip:ratio=R,span=0" ...]
Written up: docs/results.md, "KVzip among distractor needles: what the scores keep (issue 27)" and "KVzip among
distractor needles, 12 prompts per half: what loses the asked number" (the `--inject` sources beyond kvpress/oracle).

Each prompt: `dynamic`'s answer; the scores our pass leaves (`kvzip:ratio=1.0`, nothing evicted; every layer); per
needle sentence, each token's kept share under one ranking of every pair at each ratio (as the head budgets rank,
span 0: the raw scores); then the answers of the real caches: each variant spec (R in it is replaced by each ratio),
and, with `--kvpress`, our cache at each ratio with kvpress's scores put in place of ours before it ranks.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from kvzip_scores_vs_kvpress import global_keep, kvpress_scores, our_scores  # noqa: E402

SENTENCE = " special magic number for"
# --inject: answer with these scores in place of ours. "kvpress": KVzipPress's; "oracle": the most attention each
# pair gets from the question and the right answer; "runs"/"words": ours, each pair taking the best of its digit run
# (with the space before it) or of its whole word (`groups`); "layer"/"head": ours over the mean of their layer /
# head (every layer / head gets about the same share), "layer-sqrt" over the square root of the layer's mean;
# "oracle-counts": each head keeps the oracle's count of pairs, chosen by our scores; "ours-counts" the reverse.
INJECTED = ("kvpress", "oracle", "runs", "words", "layer", "head", "layer-sqrt", "oracle-counts", "ours-counts")


def needles(doc: list[int], tok) -> list[tuple[int, int]]:
    """(start, end) token positions of each needle sentence: from ' special' to the closing '.'."""
    pattern = tok(SENTENCE, add_special_tokens=False).input_ids
    found = []
    for i in range(len(doc) - len(pattern)):
        if doc[i : i + len(pattern)] == pattern:
            end = i
            while end < len(doc) and tok.decode([doc[end]]) != ".":
                end += 1
            found.append((i, end + 1))
    return found


def groups(doc: list[int], tok, rule: str) -> torch.Tensor:
    """[T] group id of each document token: "runs": a run of single-digit tokens with the lone space before it is
    one group, every other token its own; "words": a token that does not start with whitespace joins the previous
    token's group (whole words, numbers with their digits)."""
    texts = [tok.decode([t]) for t in doc]
    ids, current = [], -1
    for i, text in enumerate(texts):
        if rule == "runs":
            joins = i > 0 and text.isdigit() and (texts[i - 1].isdigit() or texts[i - 1] == " ")
        else:
            joins = i > 0 and text[:1] not in ("", " ", "\n", "\t")
        current += 0 if joins else 1
        ids.append(current)
    return torch.tensor(ids)


def group_max(scores: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """[L, H, T]: each pair takes the best score of its group's pairs in its head."""
    index = group.expand_as(scores)
    best = torch.full(scores.shape[:-1] + (int(group.max()) + 1,), float("-inf"), dtype=scores.dtype)
    best = best.scatter_reduce(-1, index, scores, "amax")
    return best.gather(-1, index)


def oracle_scores(model, doc: list[int], question: list[int], reply: list[int]) -> torch.Tensor:
    """[L, H, T]: the most attention each document pair receives from the question and the right answer's queries
    (the pass's machinery, with the question as its prompt and the answer as the text it reads): what a
    question-aware cache would rank by, to tell whether KVzip's scores miss the pairs the answer reads."""
    from hf_kvcompress import generation, make_cache, prefill
    from hf_kvcompress.generation import RepeatPrompt

    cache = make_cache("kvzip:ratio=1.0", model.config)
    original = generation.score_by_reconstruction

    def read_answer(model, input_ids, attention_mask, cache, prompt_ids, *rest):
        return original(model, torch.tensor([reply]), attention_mask, cache, RepeatPrompt(question), *rest)

    captured = []
    end = cache.end_reconstruction

    def capture(evict: bool = True):
        captured.extend(layer.slots.accumulated[0].clone() for layer in cache.layers
                        if layer.policy.scores_by_reconstruction)
        return end(evict)

    cache.end_reconstruction = capture
    generation.score_by_reconstruction = read_answer
    try:
        prefill(model, torch.tensor([doc]), None, cache, repeat_prompt_ids=RepeatPrompt(question))
    finally:
        generation.score_by_reconstruction = original
    return torch.stack(captured)


def answer(model, tok, doc, question, spec, max_new, scores=None, chunk=None, hold=False) -> str:
    """The real cache's answer (prefill with KVzip's pass, then greedy decoding); `scores` [L, H, T]: the pass is
    not run, and these are every scored layer's scores when the cache ranks (the same ranking, eviction and decoding
    as after a pass that left them). `hold`: nothing the ranking kept is evicted after the document (the question's
    and the answer's tokens are added beyond the share, as KVzipPress, which evicts nothing after the document)."""
    from hf_kvcompress import generation, make_cache
    from hf_kvcompress.caches.head_store import HeadStore
    from hf_kvcompress.generation import generate, prefill, repeat_prompt_ids

    cache = make_cache(spec, model.config)
    if spec != "dynamic":
        original = generation.score_by_reconstruction
        if scores is not None:

            def given(model, input_ids, attention_mask, cache, *rest):
                cache.begin_reconstruction()
                scored = [layer for layer in cache.layers if layer.policy.scores_by_reconstruction]
                for i, layer in enumerate(scored):
                    layer.slots.accumulated = scores[i][None].to(layer.slots.accumulated)
                cache.end_reconstruction(evict=True)

            generation.score_by_reconstruction = given
        extra = {} if chunk is None else {"reconstruction_chunk": chunk}
        try:
            prefill(model, torch.tensor([doc]), None, cache, repeat_prompt_ids=repeat_prompt_ids(tok), **extra)
        finally:
            generation.score_by_reconstruction = original
    evict = HeadStore.evict
    if hold:
        HeadStore.evict = lambda self, policy: None
    try:
        result = generate(model, torch.tensor([doc + question]), None, cache, max_new_tokens=max_new)
    finally:
        HeadStore.evict = evict
    return tok.decode(result.new_tokens[0], skip_special_tokens=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.25])
    parser.add_argument("--task", default="multi_needle")
    parser.add_argument("--split", default="dev")
    parser.add_argument("--depths", type=float, nargs="+", default=[10, 50, 90])
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--length", type=int, default=2000)
    parser.add_argument("--kvpress", action="store_true", help="also kvpress's scores (its own environment)")
    parser.add_argument("--variants", nargs="*", default=["kvzip:ratio=R"], help="specs; R: each ratio")
    parser.add_argument("--inject", nargs="*", default=[], choices=INJECTED,
                        help="also answer with these scores in place of ours")
    parser.add_argument("--top", type=float, default=0.01, help="the oracle's top share of pairs to look at")
    parser.add_argument("--reuse", action="store_true",
                        help="the variants rank our pass's saved scores instead of running the pass (faster)")
    parser.add_argument("--spans", type=int, nargs="+", default=[0], help="our scores' kept shares under these spans")
    parser.add_argument("--no-oracle", dest="oracle", action="store_false", help="skip the oracle's scores")
    parser.add_argument("--hold", action="store_true",
                        help="also answer each variant and injection with nothing evicted after the document")
    parser.add_argument("--chunk", type=int, default=None, help="reconstruction_chunk of the variants' pass")
    parser.add_argument("--only", nargs="*", default=[], help="sample ids to run (default: every sample)")
    parser.add_argument("--out", default="results/kvzip-multi-needle")
    args = parser.parse_args()
    from hf_kvcompress import load_model, use_kvcompress_attention
    from hf_kvcompress.eval.prompts import encode
    from hf_kvcompress.eval.scoring import score_all
    from hf_kvcompress.eval.tasks import build_samples
    from hf_kvcompress.models import ensure_converted

    model, tok = load_model(args.model)
    use_kvcompress_attention(model)
    rows = [dict(r) for r in build_samples(tok, [args.task], [args.length], args.depths,
                                           samples_per_cell=args.samples, split=args.split)]  # fmt: skip
    rows = [r for r in rows if not args.only or r["sample_id"] in args.only]
    tally: dict[str, list[int]] = {}
    for row in rows:
        doc, question = encode(tok, row)
        reference = row["references"][0]

        def right(text: str, row=row) -> bool:  # the eval's own metric for this row
            return score_all([text], [row["references"]])[row["metric"]][0] >= 100.0

        max_new = row["max_new_tokens"]
        text = answer(model, tok, doc, question, "dynamic", max_new)
        print(f"\n{row['sample_id']} ({reference}) dynamic: {right(text)} {text!r}", flush=True)
        if not right(text):
            continue  # retention counts the answers the uncompressed cache gives
        out = Path(args.out) / f"{args.model}-{row['sample_id'].replace('/', '_')}"
        out.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha1(str(doc).encode()).hexdigest()[:12]  # a document asked several questions: one pass
        path = Path(args.out) / f"{args.model}-ours-{digest}.pt"
        if not path.exists():
            torch.save(our_scores(model, tok, doc, "kvzip:ratio=1.0"), path)
        sources = {"ours": torch.load(path)}
        if args.kvpress:
            theirs = kvpress_scores(str(ensure_converted(args.model)), doc, out)
            scores = theirs["scores"][:, 0].clone()
            scores[..., : theirs["prefix_length"]] = 0.0  # never scored by the press, but for its sinks (below)
            scores[..., : theirs["n_sink"]] = scores.max() + 1.0  # as its compress_post: never evicted
            sources["kvpress"] = scores
        reply = tok(" " + reference, add_special_tokens=False).input_ids
        path = out / "oracle.pt"
        if args.oracle and not path.exists():
            torch.save(oracle_scores(model, doc, question, reply), path)
        oracle = torch.load(path) if args.oracle else sources["ours"]
        if args.oracle:
            sources["oracle"] = oracle
        for rule in ("runs", "words"):
            if rule in args.inject:
                sources[rule] = group_max(sources["ours"], groups(doc, tok, rule))
        ours = sources["ours"]  # [L, H, T]: each layer's (head's) scores over their mean, to its power
        layer_mean, head_mean = ours.mean((1, 2), keepdim=True), ours.mean(2, keepdim=True)
        normalised = (("layer", layer_mean, 1.0), ("head", head_mean, 1.0), ("layer-sqrt", layer_mean, 0.5))
        for name, mean, power in normalised:
            if name in args.inject:
                sources[name] = ours / mean.clamp_min(1e-12) ** power
        if args.oracle:  # each head's count from one score, its choice of pairs from the other
            for name, counts, choice in (("oracle-counts", oracle, ours), ("ours-counts", ours, oracle)):
                if name in args.inject:
                    ranks = choice.argsort(-1, descending=True).argsort(-1)
                    sources[name] = counts.sort(-1, descending=True).values.gather(-1, ranks)
        top = torch.zeros(oracle.numel(), dtype=torch.bool)
        top[oracle.flatten().topk(round(oracle.numel() * args.top)).indices] = True
        top = top.view_as(oracle)
        found = needles(doc, tok)
        for (name, scores), span, ratio in itertools.product(sources.items(), args.spans, args.ratios):
            if span == 0 or name == "ours":
                keep = global_keep(scores, ratio, span).float()  # [L, H, T]
                name = f"{name} (span {span})"
                asked = [(a, b) for a, b in found if reference in tok.decode(doc[a:b])]
                in_asked = torch.zeros_like(top)
                for a, b in asked:
                    in_asked[..., a:b] = True
                against = (f"; the oracle's top {args.top:g} pairs kept {keep[top].mean():.2f}, of them in the asked "
                           f"sentence {keep[top & in_asked].mean():.2f} ({int((top & in_asked).sum())} pairs); its "
                           f"attention mass kept {(oracle * keep).sum() / oracle.sum():.3f}" if args.oracle else "")
                print(f"  {name} keep {ratio}: document {keep.mean():.2f}{against}")
                for start, end in found:
                    share = keep[..., start:end].mean((0, 1))
                    words = " ".join(f"{tok.decode([doc[j]])!r}:{share[j - start]:.2f}" for j in range(start, end))
                    asked = "ASKED" if reference in tok.decode(doc[start:end]) else "     "
                    print(f"    {asked} {words}")
        for ratio in args.ratios:
            for variant in args.variants:
                spec = variant.replace("=R", f"={ratio:g}")
                given = sources["ours"] if args.reuse else None  # the same scores, without running the pass again
                for hold in (False, True) if args.hold else (False,):
                    text = answer(model, tok, doc, question, spec, max_new, scores=given, chunk=args.chunk, hold=hold)
                    label = spec + (" (held after the document)" if hold else "")
                    tally.setdefault(label, []).append(right(text))
                    print(f"  {label}: {right(text)} {text!r}", flush=True)
            for name, hold in itertools.product(args.inject, (False, True) if args.hold else (False,)):
                spec = f"kvzip:ratio={ratio:g},span=0"
                text = answer(model, tok, doc, question, spec, max_new, scores=sources[name], hold=hold)
                label = f"{spec} with {name}'s scores" + (" (held after the document)" if hold else "")
                tally.setdefault(label, []).append(right(text))
                print(f"  {label}: {right(text)} {text!r}", flush=True)
    print("\nanswered:", "; ".join(f"{k} {sum(v)}/{len(v)}" for k, v in tally.items()))


if __name__ == "__main__":
    main()
