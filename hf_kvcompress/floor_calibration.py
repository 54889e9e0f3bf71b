"""KVzip's per-layer floors on a hybrid model, calibrated by answering facts from compressed calibration documents.

A plain ratio on a model with sliding-window layers ranks every full-attention pair at once (caches/plan.py,
`SlidingShare`). The raw scores of some layers are larger than others' whatever the layer does for retrieval, so
at small ratios one layer can take most of the pairs while the layer the model reads a fact from keeps too few of
them. A floor (the share of the document a layer keeps at least per KV head, before the ranking shares out the rest)
corrects that; what each layer needs is measured here, per model, on text the evaluation suite does not use.

`calibrate_floors`: calibration documents (HotpotQA paragraphs, `calibration.calibration_text`) with facts written
into them (seven-digit codes and names, at a tenth, half and nine tenths of the document), each followed by a
question about one fact, as a chat turn. Each document is prefilled and scored by KVzip's reconstruction pass once
per ratio (the plan's cache, `kvzip:ratio=R,floors=none`); then, for each candidate set of floors, a copy of the
scored cache is ranked under those floors and each question is read on its own copy, with the answer teacher-forced:
a fact counts as kept when every answer token is the model's top choice. Only facts the uncompressed cache keeps
count. Coordinate ascent over the full-attention layers (each layer's floor in `FLOOR_GRID`, the others held; two
sweeps, from no floors) picks the floors under which the most answer tokens are right; as many right, at least
MIN_GAIN nats more mean log-probability, then the smaller floors' sum (`better`).
"""

from __future__ import annotations

import copy
import dataclasses
import random
from collections.abc import Callable

import torch
from transformers import DynamicCache

from .caches.compressed import CompressedCache
from .calibration import CALIBRATION_TEXT, FLOORS_FORMAT, calibration_text, model_identity
from .generation import prefill, repeat_prompt_ids
from .hf.compat import cache_kwargs, text_config
from .registry import parse_spec

FLOOR_GRID = (0.0, 0.25, 0.5, 0.75)
MIN_GAIN = 0.05  # nats of mean answer log-probability a change of floors must gain when as many tokens are right
ANSWERED = 0.75  # a fact counts when transformers' own cache gets at least this share of its answer's tokens
RATIOS = (0.5, 0.25, 0.125)
DEPTHS = (0.1, 0.5, 0.9)
_NAMES = ("Orla Vantreck", "Emeric Dulhaze", "Sabine Quorell", "Taddeo Mirvane", "Ilse Brannock", "Corvin Athel",
          "Perpetua Lindqvar", "Osric Fenwhistle", "Maelis Dortmund", "Anselm Kray")
_PLACES = ("Harrowgate", "Velmora", "Quillsby", "Drennick", "Ostrava Vale", "Pellham Cross", "Marrowick", "Tesselby",
           "Corran Reach", "Wyndmoor")


@dataclasses.dataclass(frozen=True)
class Fact:
    sentence: str
    question: str
    answer: str


def make_facts(rng: random.Random, count: int) -> list[Fact]:
    """`count` facts about made-up places: a seven-digit code or a person's name, alternately."""
    places = rng.sample(_PLACES, count)
    facts = []
    for i, place in enumerate(places):
        if i % 2 == 0:
            code = str(rng.randrange(1_000_000, 10_000_000))
            facts.append(Fact(f"The archive code of {place} is {code}.", f"What is the archive code of {place}?",
                              code))
        else:
            name = rng.choice(_NAMES)
            facts.append(Fact(f"The lighthouse keeper of {place} is {name}.",
                              f"Who is the lighthouse keeper of {place}?", name))
    return facts


def fact_documents(tokenizer, documents: int, tokens: int, seed: int = 0) -> list[tuple[list[int], list]]:
    """`documents` calibration documents of about `tokens` tokens, each with one fact per depth in DEPTHS:
    [(document ids, [(question ids, answer ids), ...])], as a chat turn (document, then the question) when the
    tokenizer has a chat template. The documents use disjoint paragraphs."""
    rng = random.Random(seed)
    words = calibration_text(words=int(documents * tokens * 0.58)).split(" ")  # about 1.7 tokens a word
    chat = bool(getattr(tokenizer, "chat_template", None))
    marker = "\x00"
    if chat:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=True,
                                                 tokenize=False)
        before, after = rendered.split(marker, 1)
    else:
        before, after = "", "\nAnswer:"
    out = []
    per_doc = len(words) // documents
    for d in range(documents):
        chunk = words[d * per_doc : (d + 1) * per_doc]
        facts = make_facts(rng, len(DEPTHS))
        for depth, fact in sorted(zip(DEPTHS, facts, strict=True), key=lambda pair: -pair[0]):
            at = int(depth * len(chunk))
            chunk = chunk[:at] + [fact.sentence] + chunk[at:]
        document = before + " ".join(chunk)
        doc_ids = tokenizer(document, add_special_tokens=not chat).input_ids
        questions = []
        for fact in facts:
            question_ids = tokenizer(f"\n\nAnswer with the answer only. {fact.question}{after}",
                                     add_special_tokens=False).input_ids
            answer_ids = tokenizer(" " + fact.answer, add_special_tokens=False).input_ids
            questions.append((question_ids, answer_ids))
        out.append((doc_ids, questions))
    return out


@torch.inference_mode()
def answer_score(model, cache, seen: int, question: list[int], answer: list[int]) -> tuple[float, float]:
    """(share of the answer's tokens that are the model's top choice, their mean log-probability) after `question`
    on `cache`, which holds a `seen`-token document; the answer is teacher-forced."""
    ids = torch.tensor([question + answer[:-1]], device=model.device)
    total = seen + ids.shape[1]
    out = model(input_ids=ids, attention_mask=torch.ones(1, total, dtype=torch.long, device=model.device),
                position_ids=torch.arange(seen, total, device=model.device)[None], use_cache=True,
                **cache_kwargs(cache))
    logits = out.logits[0, len(question) - 1 :].float().log_softmax(-1)
    target = torch.tensor(answer, device=logits.device)
    chosen = logits.gather(-1, target[:, None])[:, 0]
    return float((logits.argmax(-1) == target).double().mean()), float(chosen.mean())


@torch.inference_mode()
def uncompressed_scores(model, doc: list[int], questions) -> list[tuple[float, float]]:
    """`answer_score` of each question on transformers' own cache of the document (nothing compressed)."""
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([doc], device=model.device), use_cache=True, **cache_kwargs(cache))
    return [answer_score(model, copy.deepcopy(cache), len(doc), q, a) for q, a in questions]


def scored_cache(model, doc: list[int], spec: str, repeat):
    """The cache of `spec` after the document and KVzip's scoring pass (`repeat`: its prompt, `repeat_prompt_ids`),
    before its ranking evicts anything: `end_reconstruction()` ranks it. A plain ratio is planned by its own rule
    (`SlidingShare`, whose floors these are), not as the byte target a plain ratio now is (plan.py `ratio_as_bytes`)."""
    cache = CompressedCache(*parse_spec(spec), config=model.config, ratio_bytes=False)
    # The pass ends by ranking and evicting (CompressedCache.end_reconstruction); here the ranking is run once
    # per candidate set of floors on copies, so this cache keeps every scored pair until then.
    cache.end_reconstruction = lambda evict=True: None  # type: ignore[method-assign]  # the instance's, deleted below
    try:
        prefill(model, torch.tensor([doc], device=model.device), None, cache, repeat_prompt_ids=repeat)
    finally:
        del cache.end_reconstruction
    return cache


def kept_facts(model, scored, questions, seen: int, floors: dict[int, float]) -> list[tuple[float, float]]:
    """Each question's `answer_score` on a copy of `scored` ranked under `floors` (layer: share of the document)."""
    cache = copy.deepcopy(scored)
    cache.sliding_share = dataclasses.replace(
        cache.sliding_share, floors=tuple((layer, f) for layer, f in sorted(floors.items()) if f > 0))
    cache.end_reconstruction()
    return [answer_score(model, copy.deepcopy(cache), seen, q, a) for q, a in questions]


def better(new: tuple[float, float, float], old: tuple[float, float, float]) -> bool:
    """Whether floors scoring `new` (answer tokens right, mean log-probability, minus the floors' sum) beat `old`:
    more answer tokens right, or as many and at least MIN_GAIN nats more (a smaller gain is noise on a dozen facts,
    and a floor that changes nothing must not be shipped), or the same with smaller floors."""
    if new[0] != old[0]:
        return new[0] > old[0]
    if abs(new[1] - old[1]) >= MIN_GAIN:
        return new[1] > old[1]
    return new[1] >= old[1] and new[2] > old[2]


def calibrate_floors(model, tokenizer, documents: int = 4, tokens: int = 2000, ratios=RATIOS, sweeps: int = 2,
                     progress: Callable[[str], None] | None = None) -> tuple[dict, dict, list[dict]]:
    """Floors per ratio for `model`'s full-attention layers (module docstring). Returns (tensors, metadata, report
    rows: per ratio, the floors, the facts kept with them and with none, of those kept uncompressed)."""
    decoder = text_config(model.config)
    types = getattr(decoder, "layer_types", None) or []
    if "sliding_attention" not in types:
        raise ValueError("layer floors share a hybrid model's pairs (sliding-window and full-attention layers); "
                         f"this model's layer types are {sorted(set(types)) or ['full_attention']}")
    for ratio in ratios:
        if not 0 < ratio < 1:
            raise ValueError(f"ratios must be between 0 and 1 (exclusive), got {ratio!r}")
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    docs = fact_documents(tokenizer, documents, tokens)
    repeat = repeat_prompt_ids(tokenizer)
    say = progress or (lambda _: None)
    answered_by_doc = []
    for doc, questions in docs:  # the facts transformers' own cache gets (nearly) right: only those count
        base = uncompressed_scores(model, doc, questions)
        answered_by_doc.append([q for q, (accuracy, _) in zip(questions, base, strict=True) if accuracy >= ANSWERED])
    say(f"uncompressed: {sum(map(len, answered_by_doc))} of {sum(len(q) for _, q in docs)} facts answered")
    if not any(answered_by_doc):
        raise ValueError("the uncompressed cache answered none of the calibration facts: no floors to fit")
    floors = torch.zeros(len(ratios), len(full), dtype=torch.float64)
    report = []
    for r, ratio in enumerate(ratios):
        scored = []
        for n, ((doc, _), answered) in enumerate(zip(docs, answered_by_doc, strict=True)):
            if answered:
                scored.append((scored_cache(model, doc, f"kvzip:ratio={ratio},floors=none", repeat), answered,
                               len(doc)))
                say(f"ratio {ratio}: document {n + 1}/{len(docs)} scored")

        def value(candidate: dict[int, float], _scored=scored) -> tuple[float, float, float]:
            results = [x for cache, answered, seen in _scored
                       for x in kept_facts(model, cache, answered, seen, candidate)]
            return (round(sum(acc for acc, _ in results) / len(results), 6),
                    sum(lp for _, lp in results) / len(results), -sum(candidate.values()))

        best = dict.fromkeys(full, 0.0)
        best_value = none_value = value(best)
        for _ in range(sweeps):
            changed = False
            for layer in full:
                for f in FLOOR_GRID:
                    if f == best[layer]:
                        continue
                    candidate = {**best, layer: f}
                    v = value(candidate)
                    say(f"ratio {ratio}: floors {candidate}: accuracy {v[0]:.3f}, log-prob {v[1]:.3f}")
                    if better(v, best_value):
                        best, best_value, changed = candidate, v, True
            if not changed:
                break
        floors[r] = torch.tensor([best[layer] for layer in full], dtype=torch.float64)
        total = sum(len(answered) for _, answered, _ in scored)
        report.append({"ratio": ratio, "floors": best, "accuracy": best_value[0], "accuracy_without": none_value[0],
                       "log_prob": best_value[1], "log_prob_without": none_value[1], "answered": total})
    metadata = {"format": FLOORS_FORMAT, "model": model_identity(model.config), "layers": str(len(types)),
                "kv_heads": str(getattr(decoder, "num_key_value_heads", None) or decoder.num_attention_heads),
                "documents": str(documents), "tokens": str(tokens), "grid": ",".join(map(str, FLOOR_GRID)),
                "text": CALIBRATION_TEXT}
    tensors = {"ratios": torch.tensor(list(ratios), dtype=torch.float64), "layers": torch.tensor(full),
               "floors": floors}
    return tensors, metadata, report
