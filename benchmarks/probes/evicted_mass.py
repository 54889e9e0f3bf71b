"""Does keeping the evicted pairs' attention mass stop KVzip from answering another needle's number? (issue 27)

Question: on multi_needle (four "The special magic number for {key} is: {value}." sentences, one asked) KVzip loses
answers at a half and a quarter, always to another needle's number, whatever ranking keeps the pairs. If the cause
is that the softmax renormalises over what is left (the remaining, alike needles take a larger share of each head's
attention), then keeping one merged pair per group of evicted pairs, weighted by its count, should keep those
answers. n identical copies of a pair (k, v) contribute what one pair with an additive logit bias of log(n) does, so
"evict, but keep a group's mean key and value with its count" is simulated exactly in a full-length DynamicCache:
the group's first slot holds its mean key and value (post-RoPE keys, as cached) with a bias of log(n), the rest of
the group is masked out, through an attention function that adds a per-(layer, KV head) bias over the document's
keys (registered with transformers' AttentionInterface; nothing in the library changes).
Command:
    PYTHONPATH=. python benchmarks/probes/evicted_mass.py [--model smollm2-135m] [--split dev] [--samples 4] \\
        [--ratios 0.5 0.25 0.125] [--caps all 64 16] [--margins] [--keeps DIR] [--out results/evicted-mass.jsonl]
Written up: docs/results.md, "Keeping the evicted pairs' mass on multi_needle, development half (issue 27,
session 31; helper i27m)".

Per prompt (built as the eval builds it: build_samples, encode, the eval's reconstruction prompt):
  dynamic      the uncompressed cache's answer (the eval's path: CompressedDocument);
  plain        the real `kvzip:ratio=R` cache's answer (the eval's: below a half that is the byte plan, int4 pairs);
  exact        the real cache at ratio R with exact pairs (`ratio_bytes=False`, the plan before the byte target);
               its kept set per (layer, KV head) is read when the cache ranks (`rank_heads`'s `keep`);
  masked       a DynamicCache of the document with exact's evicted pairs masked out (must answer as `exact`);
  merged/c     each evicted group (a run of consecutive evicted tokens of one layer and KV head, cut every c
               tokens; "all": never cut) as one pair, its mean key and value, weighted by its count;
  neighbour    each evicted run merged into the kept pair before it (the first kept pair for a run at the start):
               that pair's key and value become the mean of it and the run, weighted by 1 + the run's length;
  neighbour/flat  the same merged keys and values without the weight (what the content does without the mass).
A lost answer is labelled by what it says: another needle's number, or digits. `extra` is what merged/c would add:
groups over the document's pairs (the kept share is R). `--margins`: each simulated cache's teacher-forced
log-probability of every needle's number (" {value}") after the question, and the margin of the asked one over the
best other needle's (nats; > 0: the asked number is the likelier), a graded view of answers that flip on little.
`--keeps DIR` saves the exact caches' kept sets, so a rerun (e.g. with `--margins --no-plain`) skips their passes.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION = "evicted_mass_sdpa"
RULES = ("masked", "merged", "neighbour", "neighbour/flat")  # see `merged_layer`
NEEDLE = r"special magic number for (.+?) is: (\d+)"  # each needle sentence's key and number


class DocumentBias:
    """SDPA with an additive logit bias over the document's keys, per layer and KV head: `table[layer]` [H_kv, T]
    (0: as is, -inf: masked out, log n: a pair standing for n copies). Keys past the document (the question, the
    answer) and layers without an entry are attended as plain SDPA does. Batch 1, no padding: the queries are the
    last keys (decode and a prefill after the document), which the causal mask is built from when none is given."""

    def __init__(self):
        self.table: dict[int, torch.Tensor] = {}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if kwargs.get("softcap") is not None:
            raise ValueError("this probe's attention has no softcap")
        q_heads, q_len, kv_len = query.shape[1], query.shape[2], key.shape[2]
        groups = q_heads // key.shape[1]
        if attention_mask is None:  # SDPA's implicit causal mask, queries aligned to the end of the keys
            ahead = torch.arange(kv_len, device=query.device)[None, :] > (
                torch.arange(q_len, device=query.device)[:, None] + kv_len - q_len)
            mask = torch.zeros(q_len, kv_len, dtype=query.dtype, device=query.device)
            mask = mask.masked_fill(ahead, float("-inf"))[None, None]
        elif attention_mask.dtype == torch.bool:
            mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device)
            mask = mask.masked_fill(~attention_mask, float("-inf"))[..., :kv_len]
        else:
            mask = attention_mask[..., :kv_len].to(query.dtype)
        bias = self.table.get(module.layer_idx)
        if bias is not None:
            doc = bias.shape[-1]
            full = torch.zeros(q_heads, kv_len, dtype=query.dtype, device=query.device)
            full[:, :doc] = bias.to(query.dtype).repeat_interleave(groups, dim=0)  # query head h reads KV head h // g
            mask = mask + full[None, :, None, :]
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout,
                                                               scale=scaling)
        return out.transpose(1, 2).contiguous(), None


@contextmanager
def captured_keeps(into: dict):
    """Record, per cache layer object, the `keep` [B, H_kv, T] its ranking chose (CompressedLayer.rank_heads)."""
    from hf_kvcompress.caches.layer import CompressedLayer

    original = CompressedLayer.rank_heads

    def recording(layer, scores, keep):
        into[id(layer)] = keep.clone()
        return original(layer, scores, keep)

    CompressedLayer.rank_heads = recording
    try:
        yield
    finally:
        CompressedLayer.rank_heads = original


def run_cache(model, tok, spec, cache, doc, question, max_new, repeat_ids) -> tuple[str, float]:
    """The eval's protocol on one row (CompressedDocument): prefill and compress the document at once, then append
    the question and decode greedily; the answer (cut at EOS) and the cache's bytes after the document."""
    from hf_kvcompress.eval.runner import AttentionSwitch, eos_ids
    from hf_kvcompress.generation import generate, prefill
    from hf_kvcompress.measure import measured_kv_bytes

    ids = torch.tensor([doc])
    with torch.inference_mode(), AttentionSwitch(model, spec):
        prefill(model, ids, None, cache, chunk_size=len(doc), repeat_prompt_ids=repeat_ids)
        held = measured_kv_bytes(cache)
        result = generate(model, torch.tensor([doc + question]), None, cache, max_new_tokens=max_new,
                          prefill_chunk_size=len(doc))
    return cut(tok, model, result.new_tokens[0].tolist(), eos_ids), held


def cut(tok, model, tokens: list[int], eos_ids) -> str:
    eos = eos_ids(model)
    end = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tok.decode(tokens[:end], skip_special_tokens=True)


def groups_of(evicted: torch.Tensor, cap: int | None) -> torch.Tensor:
    """[T] group id of each evicted token (-1: kept): runs of consecutive evicted tokens, cut every `cap` tokens."""
    idx = torch.arange(evicted.numel())
    before = torch.cat([evicted.new_zeros(1), evicted[:-1]])
    starts = evicted & ~before
    run_start = torch.cummax(torch.where(starts, idx, 0), 0).values
    new = starts if cap is None else starts | (evicted & ((idx - run_start) % cap == 0))
    gid = torch.cumsum(new.long(), 0) - 1
    return torch.where(evicted, gid, -1)


def merged_layer(keys, values, keep, rule: str, cap: int | None):
    """keys/values [H, T, D] of one layer's document, keep [H, T] bool -> (keys, values, bias [H, T], groups).
    rule "masked": evicted pairs masked out; "merged": each group's mean at its first slot with bias log n, the rest
    masked; "neighbour": each evicted run folded into the kept pair before it (the first kept pair for a leading
    run), bias log(1 + n) there; "neighbour/flat": the same keys and values with no bias (the content without the
    mass)."""
    keys, values = keys.clone(), values.clone()
    heads, tokens = keep.shape
    bias = torch.zeros(heads, tokens, dtype=torch.float32)
    bias[~keep] = float("-inf")
    count = 0
    if rule == "masked":
        return keys, values, bias, count
    idx = torch.arange(tokens)
    for h in range(heads):
        evicted = ~keep[h]
        if not bool(evicted.any()):
            continue
        if rule == "merged":
            gid = groups_of(evicted, cap)
            n = int(gid.max()) + 1
            first = idx[evicted][torch.cat([torch.ones(1, dtype=torch.bool), gid[evicted][1:] != gid[evicted][:-1]])]
            size = torch.bincount(gid[evicted], minlength=n).float()
            k_sum = keys.new_zeros(n, keys.shape[-1]).index_add_(0, gid[evicted], keys[h, evicted])
            v_sum = values.new_zeros(n, values.shape[-1]).index_add_(0, gid[evicted], values[h, evicted])
            keys[h, first] = k_sum / size[:, None].to(keys.dtype)
            values[h, first] = v_sum / size[:, None].to(values.dtype)
            bias[h, first] = size.log()
            count += n
        else:  # neighbour(/flat): the kept pair before each evicted token (or the first kept pair)
            kept_at = torch.where(keep[h], idx, -1)
            before = torch.cummax(kept_at, 0).values
            first_kept = int(idx[keep[h]][0]) if bool(keep[h].any()) else None
            if first_kept is None:
                continue
            target = torch.where(before >= 0, before, first_kept)[evicted]
            size = 1 + torch.bincount(target, minlength=tokens).float()
            k_sum = keys[h].clone().index_add_(0, target, keys[h, evicted])
            v_sum = values[h].clone().index_add_(0, target, values[h, evicted])
            hit = size > 1
            keys[h, hit] = k_sum[hit] / size[hit, None].to(keys.dtype)
            values[h, hit] = v_sum[hit] / size[hit, None].to(values.dtype)
            bias[h, hit] = size[hit].log() if rule == "neighbour" else 0.0  # "neighbour/flat": no count
    return keys, values, bias, count


def candidate_logprobs(model, cache, question: list[int], candidates: list[list[int]]) -> list[float]:
    """Teacher-forced log-probability of each candidate continuation after `question`, appended to `cache` (the
    document); the cache is cropped back after each candidate, so it ends holding the document and the question."""
    from hf_kvcompress.hf.compat import cache_kwargs

    out = model(input_ids=torch.tensor([question]), use_cache=True, **cache_kwargs(cache))
    first = out.logits[0, -1].float().log_softmax(-1)
    held = cache.get_seq_length()
    scores = []
    for ids in candidates:
        total = float(first[ids[0]])
        if len(ids) > 1:
            rest = model(input_ids=torch.tensor([ids[:-1]]), use_cache=True, **cache_kwargs(cache))
            logprobs = rest.logits[0].float().log_softmax(-1)
            total += float(logprobs.gather(-1, torch.tensor(ids[1:])[:, None]).sum())
            cache.crop(held - cache.get_seq_length())  # a negative count: the tokens to remove
        scores.append(total)
    return scores


def simulated(model, tok, document: list[tuple], keeps, rule, cap, bias_fn: DocumentBias, question, doc, max_new,
              skip_layers=(), candidates=None):
    """The answer of a DynamicCache holding `document` ([(keys, values)] per layer, [1, H, T, D]) with each layer's
    evicted pairs (`keeps[layer]` [H, T]) handled by `rule` (`merged_layer`); layers in `skip_layers` (or without a
    keep) are left as they are. Returns (answer, groups added, document pairs of the handled layers, and with
    `candidates` each one's log-probability after the question, else None)."""
    from hf_kvcompress.eval.runner import eos_ids
    from hf_kvcompress.generation import generate

    cache = DynamicCache(config=model.config)
    bias_fn.table = {}
    groups = pairs = 0
    for i, (k, v) in enumerate(document):
        if i in keeps and i not in skip_layers:
            k2, v2, bias, n = merged_layer(k[0], v[0], keeps[i], rule, cap)
            bias_fn.table[i] = bias
            groups += n
            pairs += keeps[i].numel()
            k, v = k2[None], v2[None]
        cache.update(k.clone(), v.clone(), i)
    scored = None
    if candidates is not None:
        copy = DynamicCache(config=model.config)
        for i, layer in enumerate(cache.layers):
            copy.update(layer.keys.clone(), layer.values.clone(), i)
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION)
    try:
        with torch.inference_mode():
            if candidates is not None:
                scored = candidate_logprobs(model, copy, question, candidates)
            result = generate(model, torch.tensor([doc + question]), None, cache, max_new_tokens=max_new,
                              prefill_chunk_size=len(doc))
    finally:
        model.set_attn_implementation(previous)
        bias_fn.table = {}
    return cut(tok, model, result.new_tokens[0].tolist(), eos_ids), groups, pairs, scored


def label(text: str, reference: str, values: list[str], right: bool) -> str:
    if right:
        return "yes"
    others = [v for v in values if v != reference and v in text]
    return f"no: needle {others[0]}" if others else f"no: {text.strip()[:24]!r}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--split", default="dev", choices=["dev"], help="the development half only (issue 27)")
    parser.add_argument("--length", type=int, default=2000)
    parser.add_argument("--depths", type=float, nargs="+", default=[10.0, 50.0, 90.0])
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.25, 0.125])
    parser.add_argument("--caps", nargs="+", default=["all", "64", "16"], help="group caps of merged/c")
    parser.add_argument("--rules", nargs="+", default=list(RULES), choices=RULES,
                        help="what the simulated caches do with the evicted pairs")
    parser.add_argument("--no-plain", dest="plain", action="store_false", help="skip the plain spec's answer")
    parser.add_argument("--margins", action="store_true",
                        help="also each simulated cache's log-probability of every needle's number after the question")
    parser.add_argument("--keeps", default=None, help="a folder to save (and reuse) the exact caches' kept sets")
    parser.add_argument("--only", nargs="*", default=[], help="sample ids to run (default: every sample)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="results/evicted-mass.jsonl")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from hf_kvcompress import load_model, make_cache
    from hf_kvcompress.caches.compressed import CompressedCache
    from hf_kvcompress.eval.prompts import encode, uses_chat
    from hf_kvcompress.eval.scoring import score_all
    from hf_kvcompress.eval.tasks import build_samples
    from hf_kvcompress.generation import prefill, repeat_prompt_ids
    from hf_kvcompress.hf.compat import text_config
    from hf_kvcompress.registry import parse_spec

    bias_fn = DocumentBias()
    AttentionInterface.register(ATTENTION, bias_fn)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    model, tok = load_model(args.model)
    repeat_ids = repeat_prompt_ids(tok, chat=uses_chat(tok, "auto"))
    layer_types = getattr(text_config(model.config), "layer_types", None) or []
    sliding = {i for i, t in enumerate(layer_types) if t == "sliding_attention"}
    caps = [None if c == "all" else int(c) for c in args.caps]
    rows = [dict(r) for r in build_samples(tok, ["multi_needle"], [args.length], args.depths,
                                           samples_per_cell=args.samples, split=args.split)]  # fmt: skip
    rows = [r for r in rows if not args.only or r["sample_id"] in args.only]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tally: dict[str, list[bool]] = {}
    extra: dict[str, list[float]] = {}
    margins: dict[str, list[float]] = {}
    with out.open("a") as log:
        for row in rows:
            started = time.time()
            doc, question = encode(tok, row)
            reference, max_new = row["references"][0], row["max_new_tokens"]
            values = [v for _, v in re.findall(NEEDLE, row["document"])]

            def right(text: str, row=row) -> bool:  # the eval's own metric for this row
                return score_all([text], [row["references"]])[row["metric"]][0] >= 100.0

            record = {"sample_id": row["sample_id"], "reference": reference, "needles": values, "answers": {}}

            def note(name: str, text: str, record=record, reference=reference, values=values, right=right):
                record["answers"][name] = text
                ok = right(text)
                print(f"  {name:28s} {label(text, reference, values, ok)}  {text!r}", flush=True)
                return ok

            print(f"\n{row['sample_id']} ({reference}; needles {values})", flush=True)
            dynamic = make_cache("dynamic", model.config)
            text, _ = run_cache(model, tok, "dynamic", dynamic, doc, question, max_new, repeat_ids)
            if not note("dynamic", text):
                log.write(json.dumps(record) + "\n")
                continue  # retention counts the answers the uncompressed cache gives
            full = DynamicCache(config=model.config)
            with torch.inference_mode():
                prefill(model, torch.tensor([doc]), None, full, chunk_size=len(doc))
            document = [(layer.keys, layer.values) for layer in full.layers]
            candidates = ([tok(" " + v, add_special_tokens=False).input_ids for v in values] if args.margins
                          else None)  # fmt: skip

            def margin(name, scored, record=record, reference=reference, values=values):
                """log p(asked number) - the best other needle's; printed and recorded under `name`."""
                if scored is None:
                    return
                asked = scored[values.index(reference)]
                best = max((lp, v) for lp, v in zip(scored, values, strict=True) if v != reference)
                record.setdefault("margins", {})[name] = {"logprobs": scored, "margin": asked - best[0]}
                margins.setdefault(name, []).append(asked - best[0])
                print(f"  {'':28s} margin {asked - best[0]:+.2f} (asked {asked:.2f}, needle {best[1]} {best[0]:.2f})")

            text, _, _, scored = simulated(model, tok, document, {}, "masked", None, bias_fn, question, doc, max_new,
                                           candidates=candidates)  # fmt: skip
            tally.setdefault("dynamic (simulated)", []).append(note("dynamic (simulated)", text))
            margin("dynamic (simulated)", scored)
            for ratio in args.ratios:
                if args.plain:
                    spec = f"kvzip:ratio={ratio:g}"
                    text, _ = run_cache(model, tok, spec, make_cache(spec, model.config), doc, question, max_new,
                                        repeat_ids)
                    tally.setdefault(f"{spec} (plain)", []).append(note(f"{spec} plain", text))
                saved = None if args.keeps is None else (
                    Path(args.keeps) / f"{args.model}-{row['sample_id'].replace('/', '_')}-R{ratio:g}.pt")
                if saved is not None and saved.exists():
                    keeps = torch.load(saved)
                else:
                    keeps_by_id: dict = {}
                    cache = CompressedCache(*parse_spec(f"kvzip:ratio={ratio:g}"), config=model.config,
                                            ratio_bytes=False)  # fmt: skip
                    with captured_keeps(keeps_by_id):
                        text, _ = run_cache(model, tok, f"kvzip:ratio={ratio:g}", cache, doc, question, max_new,
                                            repeat_ids)
                    keeps = {i: keeps_by_id[id(layer)][0].cpu() for i, layer in enumerate(cache.layers)
                             if id(layer) in keeps_by_id}
                    tally.setdefault(f"R={ratio:g} exact", []).append(note(f"R={ratio:g} exact", text))
                    if saved is not None:
                        saved.parent.mkdir(parents=True, exist_ok=True)
                        torch.save(keeps, saved)
                kept = sum(int(k.sum()) for k in keeps.values()) / sum(k.numel() for k in keeps.values())
                record[f"kept_share_{ratio:g}"] = kept
                variants = [(rule, cap) for rule in args.rules for cap in (caps if rule == "merged" else [None])]
                for rule, cap in variants:
                    name = f"R={ratio:g} {rule}" + (f"/{'all' if cap is None else cap}" if rule == "merged" else "")
                    text, groups, pairs, scored = simulated(model, tok, document, keeps, rule, cap, bias_fn,
                                                            question, doc, max_new, skip_layers=sliding,
                                                            candidates=candidates)  # fmt: skip
                    tally.setdefault(name, []).append(note(name, text))
                    margin(name, scored)
                    if rule == "merged":
                        extra.setdefault(name, []).append(groups / pairs)
                        record[f"extra {name}"] = groups / pairs
            record["seconds"] = time.time() - started
            log.write(json.dumps(record) + "\n")
            log.flush()
    print("\n| variant | answered (of those dynamic answers) | mean margin (asked - best other needle, nats) | "
          "extra pairs (groups / document pairs) |")
    print("|---|---:|---:|---:|")
    for name, kept in tally.items():
        cost = f"{sum(extra[name]) / len(extra[name]):.3f}" if name in extra else ""
        mean = f"{sum(margins[name]) / len(margins[name]):+.2f}" if name in margins else ""
        print(f"| {name} | {sum(kept)}/{len(kept)} | {mean} | {cost} |")


if __name__ == "__main__":
    main()
