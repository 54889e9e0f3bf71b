"""How far each cache moves the uncompressed answers towards a flip: a continuous reading behind the suite's counts.

Question: how close does each cache bring the answers the uncompressed cache gets right to flipping (the smallest
log-probability margin of the answer's tokens), where a retention count only says flipped or not?
Command:
    python benchmarks/probes/answer_margin.py --model gemma-3-270m --task multi_needle --length 2000 \\
        --depths 0,25,50,75,100 --samples 3 --specs "int4;int4:codebook=gaussian;int3"
Written up: docs/results.md, "The suite: retention at each width" (the int3 and codebook margins).

A retention count of 15 samples moves by one answer when one prompt flips, and some prompts sit on a knife's edge
even uncompressed. For each sample this greedily decodes the uncompressed answer, then feeds the same question and
answer tokens (teacher-forced) through each cache after the document was prefilled into it, and reports the
answer's margin: over the tokens up to the end of the reference, the smallest gap in log-probability between the
uncompressed answer's token and the best other token. A negative margin is a flip; the uncompressed margin says how
fragile the sample was to begin with. Specs are separated by ';' (they contain commas).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from hf_kvcompress import load_model, make_cache, prefill, repeat_prompt_ids, use_kvcompress_attention
from hf_kvcompress.eval.prompts import encode
from hf_kvcompress.eval.tasks import build_samples


def answer_margin(model, cache, document: list[int], question: list[int], answer: list[int], prompt_ids) -> float:
    """Smallest log-prob gap between each `answer` token and the best other token, the document in `cache`."""
    ids = torch.tensor([document])
    prefill(model, ids, torch.ones_like(ids), cache, repeat_prompt_ids=prompt_ids)
    rest = torch.tensor([question + answer])
    total = len(document) + rest.shape[1]
    out = model(input_ids=rest, attention_mask=torch.ones(1, total, dtype=torch.long), past_key_values=cache,
                position_ids=torch.arange(len(document), total)[None], use_cache=True)  # fmt: skip
    logprobs = out.logits[0, len(question) - 1 : len(question) - 1 + len(answer)].float().log_softmax(-1)
    chosen = torch.tensor(answer)[:, None]
    gap = logprobs.gather(1, chosen)[:, 0] - logprobs.scatter(1, chosen, float("-inf")).amax(1)
    return float(gap.min())


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--task", default="needle")
    parser.add_argument("--length", type=int, default=2000)
    parser.add_argument("--depths", default="0,25,50,75,100")
    parser.add_argument("--samples", type=int, default=3, help="samples per depth")
    parser.add_argument("--specs", required=True, help="cache specs separated by ';'")
    parser.add_argument("--max-answer-tokens", type=int, default=16)
    parser.add_argument("--out", help="write one JSON line per sample here too")
    args = parser.parse_args()
    specs = [s for s in args.specs.split(";") if s]
    if not specs:
        parser.error("--specs must name at least one cache spec, e.g. 'int4;int3'")

    model, tokenizer = load_model(args.model, dtype="float32", device="cpu")
    use_kvcompress_attention(model)
    prompt_ids = repeat_prompt_ids(tokenizer)
    depths = [float(d) for d in args.depths.split(",")]
    rows = build_samples(tokenizer, [args.task], [args.length], depths, samples_per_cell=args.samples)
    builders = {spec: (lambda spec=spec: make_cache(spec, model.config)) for spec in ["dynamic", *specs]}
    margins_table(model, tokenizer, rows, builders, prompt_ids, args.max_answer_tokens, args.out,
                  f"{args.model}, {args.task} at {args.length} tokens")


def margins_table(model, tokenizer, rows, builders: dict, prompt_ids, max_answer_tokens: int, out: str | None,
                  title: str) -> dict[str, list[float]]:
    """Each cache's answer margin (`builders[name]()` makes a fresh one; "dynamic" the uncompressed baseline) on
    every sample of `rows` the uncompressed cache answers; prints a JSON line per sample (and writes it to `out`)
    and then each cache's flips, minimum, median and mean drop against "dynamic"."""
    margins: dict[str, list[float]] = {name: [] for name in builders}
    sink = open(out, "w") if out else None
    for sample in rows:
        document, question = encode(tokenizer, sample)
        ids = torch.tensor([document + question])
        generated = model.generate(ids, attention_mask=torch.ones_like(ids),
                                   past_key_values=make_cache("dynamic", model.config),
                                   max_new_tokens=max_answer_tokens, do_sample=False)  # fmt: skip
        answer = generated[0, ids.shape[1] :].tolist()
        reference = sample["references"][0]
        upto = next((i + 1 for i in range(len(answer)) if reference in tokenizer.decode(answer[: i + 1])), None)
        if upto is None:  # uncompressed misses it: nothing to retain
            print(f"{sample['sample_id']}: uncompressed answer {tokenizer.decode(answer)!r} misses {reference}")
            continue
        row = {"sample": sample["sample_id"]}
        for name, build in builders.items():
            row[name] = answer_margin(model, build(), document, question, answer[:upto], prompt_ids)
            margins[name].append(row[name])
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        if sink:
            sink.write(json.dumps(row) + "\n")
    if sink:
        sink.close()
    base = margins["dynamic"]
    if not base:
        print("the uncompressed cache answered no sample: no margins to compare")
        return margins
    print(f"\n{title}, {len(base)} samples answered uncompressed")
    print(f"{'cache':50s} {'flips':>5s} {'min':>7s} {'median':>7s} {'mean drop vs uncompressed':>26s}")
    for name, values in margins.items():
        drop = statistics.mean(b - v for b, v in zip(base, values, strict=True))
        flips = sum(v < 0 for v in values)
        print(f"{name:50s} {flips:5d} {min(values):7.2f} {statistics.median(values):7.2f} {drop:26.2f}")
    return margins

if __name__ == "__main__":
    main()
