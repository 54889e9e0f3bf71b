"""What int4 loses under KVzip's eviction: the pairs it keeps (the ranking) or how it stores them (the codec)?

Question: `kvzip:ratio=R+int4` answers fewer questions than `kvzip:ratio=R` on Gemma-3. The reconstruction pass
scores the pairs from the store, which int4 has already encoded, so int4 may keep other pairs; and it stores the
pairs it keeps at 4 bits. Which of the two moves the answer?
Command:
    python benchmarks/probes/kvzip_int4_split.py [--model gemma-3-270m] [--ratio 0.25] [--codec int4]
        [--tasks needle multi_question] [--split dev] [--depths 10 50 90] [--samples 2]
Written up: docs/results.md, "KVzip at a quarter on Gemma-3: what the quarter and int4 lose" (issue 27).

For each prompt that the uncompressed cache answers, its greedy answer is teacher-forced after the question
(`answer_margin.answer_margin`: the smallest log-probability gap between an answer token and the best other token;
negative = a flip) through four caches of the same document:
- `fp`:           `kvzip:ratio=R` (full precision, its own ranking);
- `codec`:        `kvzip:ratio=R+CODEC` (its own ranking, the pairs encoded);
- `fp@codec`:     `kvzip:ratio=R` keeping the pairs the codec cache's ranking kept (full precision);
- `codec@fp`:     `kvzip:ratio=R+CODEC` keeping the pairs the full-precision ranking kept (encoded).
The ranking is `head_budget_keep` as the cache calls it (wrapped: the first call of a cache records its masks, a
replaying call returns recorded masks instead). Also printed: the share of kept pairs the two rankings share, per
full-attention layer, and of the fact's tokens.
"""

from __future__ import annotations

import argparse
import os

import torch
from answer_margin import answer_margin

import hf_kvcompress.caches.compressed as compressed
from hf_kvcompress import load_model, make_cache, use_kvcompress_attention
from hf_kvcompress.eval.prompts import encode
from hf_kvcompress.eval.tasks import build_samples
from hf_kvcompress.generation import generate, repeat_prompt_ids

RANKING = compressed.head_budget_keep


class Ranking:
    """Wraps the cache's ranking: records each call's keep masks, or replays masks recorded earlier."""

    def __init__(self):
        self.recorded: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.replay: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def __call__(self, *positional, **named):
        out = RANKING(*positional, **named)
        if self.replay is not None:
            # the recorded pairs, plus what this cache protects (its codec's exact sinks: +inf priority)
            out = [(priority, keep | torch.isposinf(priority))
                   for (priority, _), (_, keep) in zip(out, self.replay, strict=True)]
        self.recorded = out
        return out


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--ratio", default="0.25")
    parser.add_argument("--codec", default="int4")
    parser.add_argument("--tasks", nargs="+", default=["needle", "multi_question"])
    parser.add_argument("--split", default="dev")
    parser.add_argument("--depths", type=float, nargs="+", default=[10, 50, 90])
    parser.add_argument("--samples", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    model, tok = load_model(args.model, dtype="float32", device="cpu")
    use_kvcompress_attention(model)
    ranking = Ranking()
    compressed.head_budget_keep = ranking  # the cache looks the name up at call time
    repeat = repeat_prompt_ids(tok)
    fp, coded = f"kvzip:ratio={args.ratio}", f"kvzip:ratio={args.ratio}+{args.codec}"
    rows = build_samples(tok, args.tasks, [2000], args.depths, samples_per_cell=args.samples, split=args.split)
    totals: dict[str, list[float]] = {}
    for row in rows:
        doc, question = encode(tok, row)
        ids = torch.tensor([doc + question])
        result = generate(model, ids, None, make_cache("dynamic", model.config), max_new_tokens=row["max_new_tokens"])
        answer = result.new_tokens[0].tolist()
        reference = row["references"][0]
        upto = next((i + 1 for i in range(len(answer)) if reference in tok.decode(answer[: i + 1])), None)
        if upto is None:
            print(f"{row['sample_id']}: uncompressed {tok.decode(answer)!r} misses {reference!r}", flush=True)
            continue
        margins, masks = {}, {}
        for name, spec, replay in (("fp", fp, None), ("codec", coded, None), ("fp@codec", fp, "codec"),
                                   ("codec@fp", coded, "fp")):  # fmt: skip
            ranking.replay = None if replay is None else masks[replay]
            margins[name] = answer_margin(model, make_cache(spec, model.config), doc, question, answer[:upto], repeat)
            assert ranking.recorded is not None  # the cache ranked its pairs at the pass's end
            masks.setdefault(name, ranking.recorded)
        ranking.replay = None
        where = None
        value = tok(" " + reference, add_special_tokens=False).input_ids
        for i in range(len(doc) - len(value) + 1):
            if doc[i : i + len(value)] == value:
                where = slice(i, i + len(value))
        same = []
        for (_, a), (_, b) in zip(masks["fp"], masks["codec"], strict=True):
            a, b = a[0, :, : len(doc)], b[0, :, : len(doc)]
            fact = "" if where is None else f" fact {a[:, where].float().mean():.2f}/{b[:, where].float().mean():.2f}"
            same.append(f"{(a & b).sum() / a.sum().clamp(min=1):.2f}{fact}")
        for name, value_ in margins.items():
            totals.setdefault(name, []).append(value_)
        print(f"{row['sample_id']} {reference!r}: " + " ".join(f"{k}={v:+.2f}" for k, v in margins.items())
              + f" | kept in both (fp/codec fact kept): {'; '.join(same)}", flush=True)  # fmt: skip
    print(f"\n{args.model} {fp} vs {coded}, {args.split}: flips (margin < 0) and mean margin")
    for name, values in totals.items():
        print(f"{name:10s} flips {sum(v < 0 for v in values)}/{len(values)}  mean {sum(values) / len(values):+.2f}")


if __name__ == "__main__":
    main()
