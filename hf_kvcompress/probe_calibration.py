"""Fit KVzap's score probes (arXiv:2601.07891) on calibration prose: KVzip's scores as the target, the hidden state
entering each full-attention layer's attention as the input, one ridge regression per layer (probes.py holds the
file format and the probe the policy runs).

The text (`text`): "hotpotqa" (the default), "novel", or "both" (their documents alternating):
- "hotpotqa": the package's calibration paragraphs (Wikipedia, `calibration.calibration_text`, as the low-rank bases
  and KVzip's floors are fitted on), which hold names, dates and numbers. A probe fitted on the novel alone ranked
  a needle's digits in the lowest third of Gemma-3's layer 11, where KVzip keeps them; on Gemma-3's development half
  at a quarter the probe fitted here kept 9 of 11 answers, "both" 8, the novel alone 4 (docs/results.md, "KVzap on
  Gemma-3: the calibration text").
- "novel": consecutive passages of chapters I-VI of the suite's novel (Natsume Soseki's *Botchan*, eval/data.py
  `book_words("dev")`): the development half's haystack, which no test document reads (the test half's comes from
  chapters VII-XI, the needle tasks' from Paul Graham's essays, the QA tasks' from SQuAD and HotpotQA). SmolLM2's
  shipped probe is fitted on it.
Each document is about `tokens` tokens (KVzap fits on documents of about 1k tokens), rendered as the suite renders a
document (the chat template's user turn up to the document's end); the last `held_out` documents are kept out of the
fit to report it (with "both", one of each source when `held_out` is 2).
"""

from __future__ import annotations

import torch

from .caches.compressed import CompressedCache
from .calibration import CALIBRATION_TEXT as HOTPOTQA_TEXT
from .calibration import calibration_text, model_identity, ridge
from .eval.data import book_words
from .eval.prompts import render
from .generation import prefill, repeat_prompt_ids
from .hf.attention import use_kvcompress_attention
from .hf.compat import text_config
from .hf.hidden_states import attention_modules
from .policies.kvzip import KVzipPolicy
from .probes import PROBE_FORMAT

NOVEL_TEXT = "Botchan, chapters I-VI (the suite's dev-half novel text; Project Gutenberg #8868, public domain)"
TEXTS = ("hotpotqa", "novel", "both")
# Words per token of each source (English prose; Wikipedia's names and numbers split into more tokens).
WORDS_PER_TOKEN = {"novel": 0.7, "hotpotqa": 0.58}
# The log of a score below this is the log of this: attention probabilities that small rank last anyway.
SCORE_FLOOR = 1e-6
ALPHAS = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)  # ridge strengths tried, relative to the mean variance of a feature


def calibration_documents(
    tokenizer, tokens: int = 1024, documents: int = 12, text: str = "hotpotqa"
) -> list[torch.Tensor]:
    """Up to `documents` [1, <= tokens] id tensors of consecutive passages of the calibration `text` (TEXTS; "both"
    alternates a novel passage and a HotpotQA one, as long as both last)."""
    if text not in TEXTS:
        raise ValueError(f"text must be one of {', '.join(TEXTS)}, got {text!r}")
    if text != "both":
        return _documents(tokenizer, text, tokens, documents)
    novel = _documents(tokenizer, "novel", tokens, (documents + 1) // 2)
    hotpotqa = _documents(tokenizer, "hotpotqa", tokens, documents // 2)
    paired = [d for pair in zip(novel, hotpotqa, strict=False) for d in pair]
    return paired + novel[len(hotpotqa) :] + hotpotqa[len(novel) :]


def _documents(tokenizer, source: str, tokens: int, documents: int) -> list[torch.Tensor]:
    per_document = max(int(tokens * WORDS_PER_TOKEN[source]), 16)  # and the chat header
    if source == "novel":
        words = list(book_words("dev"))
    else:  # paragraph breaks stay inside the words, as the floors' documents keep them (one document more of
        # paragraphs than asked: a break joins two of calibration_text's words into one here)
        words = calibration_text(words=per_document * (documents + 1)).split(" ")
    out = []
    for start in range(0, len(words) - per_document + 1, per_document):
        body = " ".join(words[start : start + per_document])
        document, _ = render(tokenizer, {"instruction": "", "document": body, "question": ""})
        ids = tokenizer(document, return_tensors="pt", add_special_tokens=not getattr(tokenizer, "chat_template", None))
        out.append(ids.input_ids[:, :tokens])
        if len(out) == documents:
            break
    return out


def full_attention_layers(config) -> list[int]:
    decoder = text_config(config)
    types = getattr(decoder, "layer_types", None) or ["full_attention"] * decoder.num_hidden_layers
    return [i for i, kind in enumerate(types) if kind == "full_attention"]


@torch.no_grad()
def kvzip_targets(
    model, input_ids: torch.Tensor, prompt_ids: list[int]
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """(hidden, targets) of one document [1, T], per full-attention layer: the hidden state entering attention
    [T, hidden] at prefill, and log KVzip score [T, H_kv] (this package's KVzip: the most attention each pair
    receives while the model repeats the document after `prompt_ids`, its reconstruction prompt; span 0, nothing
    evicted)."""
    use_kvcompress_attention(model)
    layers = full_attention_layers(model.config)
    modules = attention_modules(model)
    hidden: dict[int, torch.Tensor] = {}

    def record(index):
        def hook(module, args, kwargs):
            if index not in hidden:  # the prefill's call; the reconstruction pass's come after
                state = kwargs.get("hidden_states", args[0] if args else None)
                hidden[index] = state[0].float().cpu()
        return hook

    handles = [modules[i].register_forward_pre_hook(record(i), with_kwargs=True) for i in layers]
    try:
        cache = CompressedCache(KVzipPolicy(ratio=1.0, budgets="uniform", span=0), config=model.config)
        prefill(model, input_ids.to(model.device), None, cache, repeat_prompt_ids=prompt_ids)
    finally:
        for handle in handles:
            handle.remove()
    # the pass scored every slot: each scored layer holds its accumulated scores
    targets = {
        i: _scores(cache.layers[i].slots.accumulated)[0].T.float().clamp(min=SCORE_FLOOR).log().cpu() for i in layers
    }
    return hidden, targets


def r_squared(predicted: torch.Tensor, target: torch.Tensor) -> float:
    """1 - residual / total variance, over every entry (each head's mean removed)."""
    residual = ((predicted - target) ** 2).sum()
    total = ((target - target.mean(0)) ** 2).sum()
    return float(1 - residual / total)


def _ranks(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x).scatter_(0, x.argsort(0), torch.arange(x.shape[0], dtype=x.dtype)[:, None].expand_as(x))


def spearman(predicted: torch.Tensor, target: torch.Tensor) -> float:
    """Rank correlation of one document's [T, H_kv] scores, per head, averaged over heads."""
    p, t = _ranks(predicted.double()), _ranks(target.double())
    p, t = p - p.mean(0), t - t.mean(0)
    return float(((p * t).sum(0) / (p.norm(dim=0) * t.norm(dim=0))).mean())


def fit_layer(train: list[tuple[torch.Tensor, torch.Tensor]], test: list[tuple[torch.Tensor, torch.Tensor]],
              alphas=ALPHAS) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """One layer's ridge probe: the strength whose fit on `train` documents [(hidden [T, d], target [T, k])] best
    predicts `test` (R^2); the fit on `train` is the probe. Returns (weight, bias, report)."""
    x = torch.cat([h for h, _ in train])
    y = torch.cat([t for _, t in train])
    scale = float((x.double() - x.double().mean(0)).pow(2).sum(0).mean())  # a feature's summed variance
    tx = torch.cat([h for h, _ in test])
    ty = torch.cat([t for _, t in test])
    best = None
    for alpha in alphas:
        weight, bias = ridge(x, y, alpha * scale)
        score = r_squared(tx.double() @ weight + bias, ty.double())
        if best is None or score > best[0]:
            best = (score, alpha, weight, bias)
    assert best is not None  # `alphas` is never empty
    score, alpha, weight, bias = best
    train_r2 = r_squared(x.double() @ weight + bias, y.double())
    rho = sum(spearman(h.double() @ weight + bias, t) for h, t in test) / len(test)
    report = {"alpha": alpha, "r2_train": train_r2, "r2_held_out": score, "spearman_held_out": rho}
    return weight.float(), bias.float(), report


def calibrate_probe(model, tokenizer, tokens: int = 1024, documents: int = 12, held_out: int = 2,
                    progress=None, text: str = "hotpotqa") -> tuple[dict, dict, list[dict]]:
    """Fit every full-attention layer's probe; returns (tensors, metadata, report rows per layer)."""
    if not 1 <= held_out < documents:
        raise ValueError(f"held_out must be between 1 and documents - 1 ({documents - 1}), got {held_out}")
    docs = calibration_documents(tokenizer, tokens, documents, text)
    if len(docs) <= held_out:
        raise ValueError(
            f"the calibration text gives {len(docs)} documents of {tokens} tokens; need more than {held_out}"
        )
    per_doc, prompt_ids = [], repeat_prompt_ids(tokenizer)
    for n, ids in enumerate(docs):
        per_doc.append(kvzip_targets(model, ids, prompt_ids))
        if progress is not None:
            progress(n + 1, len(docs))
    layers = full_attention_layers(model.config)
    tensors, report = {}, []
    for i in layers:
        pairs = [(hidden[i], targets[i]) for hidden, targets in per_doc]
        weight, bias, row = fit_layer(pairs[:-held_out], pairs[-held_out:])
        tensors[f"layers.{i}.weight"] = weight.contiguous()
        tensors[f"layers.{i}.bias"] = bias.contiguous()
        report.append({"layer": i, **row})
    decoder = text_config(model.config)
    kv_heads = getattr(decoder, "num_key_value_heads", None) or decoder.num_attention_heads
    metadata = {
        "format": PROBE_FORMAT, "model": model_identity(model.config), "layers": str(decoder.num_hidden_layers),
        "kv_heads": str(kv_heads), "hidden_size": str(decoder.hidden_size),
        "probe_layers": ",".join(map(str, layers)), "form": "ridge",
        "shapes": f"weight [{decoder.hidden_size}, {kv_heads}], bias [{kv_heads}] per probed layer",
        "input": "hidden state entering attention", "target": "log KVzip score (span 0)",
        "documents": str(len(docs)), "held_out": str(held_out), "tokens": str(sum(d.shape[1] for d in docs)),
        "text": {"novel": NOVEL_TEXT, "hotpotqa": HOTPOTQA_TEXT}.get(text, f"{NOVEL_TEXT}; {HOTPOTQA_TEXT}"),
    }
    return tensors, metadata, report


def _scores(accumulated: torch.Tensor | None) -> torch.Tensor:
    if accumulated is None:
        raise RuntimeError("KVzip's pass left a layer without scores: nothing to fit the probe on")
    return accumulated
