"""Long-context evaluation tasks: each turns (length, depth, index) into one sample, deterministically for a seed.

Lengths are counted in the model's own tokens (the whole prompt, as `prompts.encode` renders it without
`query_aware`); depth is the percent of the document before the fact that is asked about. A task is a frozen
dataclass whose fields are its parameters, named in specs as `multi_needle:keys=4,values=2`.
Formats follow RULER (arXiv:2404.06654) for the needles and QA, and Lost in the Middle (arXiv:2307.03172) for
key-value retrieval.

Every task's samples come in two disjoint halves, a development half to tune methods and defaults on and a test
half to report (`sample_split`): sample `index` i of a cell is in `dev` when i is even and in `test` when it is
odd. A sample's half is thus a pure function of its identity, the same for every task, seed and cell, so asking for
more samples per cell only adds samples to each half and never moves one; and each half has exactly half of
every cell. The samples themselves are drawn from (seed, task, length, depth, index) as before, so `split="all"`
(indices 0, 1, 2, ...) gives the samples the suite always gave.
"""

from __future__ import annotations

import hashlib
import random
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import ClassVar

from . import data
from .prompts import PromptFormat, encode

# A small built-in vocabulary for needle keys (RULER draws adjective-noun pairs from wonderwords' lists).
_ADJECTIVES = (
    "ancient amber bitter brave calm clever crimson curious dusty eager electric elegant fierce fragile gentle "
    "golden hollow humble icy jolly lively lonely lucky mellow misty narrow nimble noisy odd pale patient polite "
    "proud quiet rapid rustic scarlet shiny silent silver sleepy slow smooth solemn spicy steady stormy sturdy "
    "swift tender tiny velvet violet wandering warm wild witty wooden"
).split()
_NOUNS = (
    "anchor badger banjo beacon bison blanket bridge cactus canyon castle cedar comet compass copper cottage "
    "crystal dolphin falcon feather fiddle forest fountain garden glacier harbor helmet island jacket kettle "
    "lantern lemon lighthouse maple meadow mirror mountain needle orchard otter panther pebble pepper piano "
    "pigeon planet pocket quartz rabbit river saddle shovel spider squirrel teapot thimble tiger tulip violin "
    "walnut whistle window"
).split()

Measure = Callable[[dict], int]  # fields of a sample -> tokens of its whole prompt

SPLITS = ("dev", "test", "all")
# Depth bands of a document (percent of it before the fact), for scores per band.
BANDS = (("start", 0, 33.4), ("middle", 33.4, 66.7), ("end", 66.7, 100.1))


def check_split(split: str) -> str:
    """`split` itself, or a ValueError naming the allowed values."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)} (dev: tune on it; test: report it; all: both), "
                         f"got {split!r}")  # fmt: skip
    return split


def sample_split(index: int) -> str:
    """The half a sample belongs to: `dev` for an even index within its cell, `test` for an odd one."""
    return "dev" if index % 2 == 0 else "test"


def split_indices(split: str, count: int) -> list[int]:
    """The indices of the first `count` samples of a cell that belong to `split`."""
    check_split(split)
    if split == "all":
        return list(range(count))
    first = 0 if split == "dev" else 1
    return [first + 2 * k for k in range(count)]


def band_of(depth: float) -> str:
    """The band (`start`, `middle` or `end`) of a depth in percent."""
    return next(name for name, low, high in BANDS if low <= depth < high)


def _key(rng: random.Random) -> str:
    return f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"


def _number(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def fit(make: Callable[[int], dict], measure: Measure, length: int, hi: int) -> dict:
    """The sample `make(n)` with the largest n in [0, hi] whose prompt has at most `length` tokens.

    `make(n)` must grow with n. If even n = 0 is too long, that sample is returned (its `n_tokens` tells).
    """
    lo, best = 0, None
    while lo <= hi:
        mid = (lo + hi) // 2
        sample = make(mid)
        tokens = measure(sample)
        if tokens <= length:
            best, lo = (sample, tokens), mid + 1
        else:
            hi = mid - 1
    if best is None:
        sample = make(0)
        best = (sample, measure(sample))
    sample, tokens = best
    return {**sample, "n_tokens": tokens}


def _sentence_starts(words: Sequence[str]) -> list[int]:
    """Word indices where a sentence starts, plus len(words): the places a needle may go."""
    starts = [0] + [i for i in range(1, len(words)) if words[i - 1][-1:] in ".!?"]
    return starts + [len(words)]


def _snap(starts: list[int], target: float) -> int:
    """The sentence boundary nearest to word position `target`."""
    return min(starts, key=lambda s: (abs(s - target), s))


def _cyclic(words: Sequence[str], start: int, n: int) -> list[str]:
    """n words from `start`, wrapping round (a short user corpus is repeated to reach long lengths)."""
    if n <= len(words) - start:
        return list(words[start : start + n])
    out = list(words[start:])
    while len(out) < n:
        out.extend(words[: n - len(out)])
    return out


def _insert(words: list[str], needles: list[tuple[float, str]]) -> str:
    """Words with each (depth percent, sentence) inserted at the sentence boundary nearest that depth."""
    starts = _sentence_starts(words)
    placed = sorted((_snap(starts, depth / 100 * len(words)), order, text)
                    for order, (depth, text) in enumerate(needles))
    pieces, last = [], 0
    for position, _, text in placed:
        pieces.extend(words[last:position])
        pieces.append(text)
        last = position
    pieces.extend(words[last:])
    return " ".join(pieces)


@dataclass(frozen=True)
class Task:
    """Base: a task's spec parameters are its dataclass fields; `build` makes one sample."""

    name: ClassVar[str]
    metric: ClassVar[str] = "string_match_all"
    uses_documents: ClassVar[bool] = False
    # True: `build_document` makes one document per (length, index) holding a fact at every depth, one sample
    # per depth; False: `build` makes one sample per (length, depth, index).
    asks_per_document: ClassVar[bool] = False
    documents: str | None = field(default=None, repr=False, compare=False)  # --documents folder, user_* only

    @property
    def spec(self) -> str:
        """Canonical spec: the name plus the parameters that differ from their defaults."""
        args = [
            f"{f.name}={getattr(self, f.name)}"
            for f in fields(self)
            if f.name != "documents" and getattr(self, f.name) != f.default
        ]
        return self.name + (":" + ",".join(args) if args else "")

    @property
    def sample_prefix(self) -> str:
        """What identifies this task's samples: the spec, plus a digest of the user's documents if it reads them."""
        if not self.uses_documents:
            return self.spec
        digest = hashlib.sha256(" ".join(data.user_document_words(self._documents())).encode()).hexdigest()[:10]
        return f"{self.spec}@{digest}"

    def haystack(self) -> Sequence[str]:
        return data.user_document_words(self._documents()) if self.uses_documents else data.essay_words()

    def _documents(self) -> str:
        if self.documents is None:
            raise ValueError(f"task {self.name!r} reads the user's documents: give their folder (--documents)")
        return self.documents

    def build(self, rng: random.Random, length: int, depth: float, measure: Measure) -> dict:
        raise NotImplementedError

    def build_document(self, rng: random.Random, length: int, depths: Sequence[float], half: str,
                       measure: Measure) -> list[dict]:
        """The samples of one document, one per depth (tasks whose `asks_per_document` is True)."""
        raise NotImplementedError


_NEEDLES = {  # kind -> (instruction, needle, question, answer_prefix); {key} and {value} are filled in
    "number": (
        "A special magic number is hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the number afterwards.",
        "The special magic number for {key} is: {value}.",
        "What is the special magic number for {key} mentioned in the provided text?",
        "The special magic number for {key} mentioned in the provided text is",
    ),
    "passkey": (
        "There is an important piece of information hidden inside a lot of irrelevant text. "
        "Find it and memorize it. I will quiz you about the important information there.",
        "The pass key is {value}. Remember it. {value} is the pass key.",
        "What is the pass key?",
        "The pass key is",
    ),
    "word": (
        "A secret code word is hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the code word afterwards.",
        "The secret code word is {key}.",
        "What is the secret code word mentioned in the provided text?",
        "The secret code word mentioned in the provided text is",
    ),
}


@dataclass(frozen=True)
class NeedleTask(Task):
    """One fact in real prose at a chosen depth: the classic needle-in-a-haystack grid (RULER niah_single_2).

    `kind`: `number` (a 7-digit magic number for a key), `passkey` (a 5-digit pass key) or `word` (a code word).
    """

    name: ClassVar[str] = "needle"
    kind: str = "number"

    def __post_init__(self):
        if self.kind not in _NEEDLES:
            raise ValueError(f"needle: kind must be one of {sorted(_NEEDLES)}, got {self.kind!r}")

    def build(self, rng, length, depth, measure):
        words = self.haystack()
        starts = _sentence_starts(words)[:-1]
        start = rng.choice(starts)
        key = _key(rng)
        value = _number(rng, 5 if self.kind == "passkey" else 7)
        instruction, needle, question, prefix = (text.format(key=key, value=value) for text in _NEEDLES[self.kind])
        answer = key if self.kind == "word" else value

        def make(n: int) -> dict:
            document = _insert(_cyclic(words, start, n), [(depth, needle)])
            return {"instruction": instruction, "document": document, "question": question,
                    "answer_prefix": prefix, "references": [answer], "max_new_tokens": 16}  # fmt: skip

        return fit(make, measure, length, hi=length)


@dataclass(frozen=True)
class MultiNeedleTask(Task):
    """Several needles, only one asked about: RULER's niah_multikey_1 (keys > 1) and niah_multivalue (values > 1).

    The other keys' needles are distractors at random depths; the asked key's first value sits at `depth`,
    its other values at random depths, and every value must be recalled (string_match_all).
    """

    name: ClassVar[str] = "multi_needle"
    keys: int = 4
    values: int = 1

    def __post_init__(self):
        if self.keys < 1 or self.values < 1:
            raise ValueError(f"multi_needle: keys and values must be >= 1, got keys={self.keys}, values={self.values}")

    def build(self, rng, length, depth, measure):
        words = self.haystack()
        start = rng.choice(_sentence_starts(words)[:-1])
        keys = []
        while len(keys) < self.keys:
            candidate = _key(rng)
            if candidate not in keys:
                keys.append(candidate)
        values = [[_number(rng) for _ in range(self.values)] for _ in keys]
        one = self.values == 1
        template = ("The special magic number for {key} is: {value}." if one
                    else "One of the special magic numbers for {key} is: {value}.")
        needles = []
        for k, key in enumerate(keys):
            for v, value in enumerate(values[k]):
                at = depth if (k, v) == (0, 0) else rng.uniform(0, 100)
                needles.append((at, template.format(key=key, value=value)))
        asked = keys[0]
        instruction = ("Some special magic numbers are hidden within the following text. Make sure to memorize "
                       "them. I will quiz you about the numbers afterwards.")  # fmt: skip
        if one:
            question = f"What is the special magic number for {asked} mentioned in the provided text?"
            prefix = f"The special magic number for {asked} mentioned in the provided text is"
        else:
            question = f"What are all the special magic numbers for {asked} mentioned in the provided text?"
            prefix = f"The special magic numbers for {asked} mentioned in the provided text are"

        def make(n: int) -> dict:
            return {"instruction": instruction, "document": _insert(_cyclic(words, start, n), needles),
                    "question": question, "answer_prefix": prefix, "references": values[0],
                    "max_new_tokens": 12 * self.values + 8}  # fmt: skip

        return fit(make, measure, length, hi=length)


@dataclass(frozen=True)
class KVRetrievalTask(Task):
    """Lost in the Middle's key-value retrieval: a JSON object of UUID pairs; return the value of the key at `depth`."""

    name: ClassVar[str] = "kv_retrieval"

    def build(self, rng, length, depth, measure):
        most = max(2, length // 16)  # a pair costs > 16 tokens with any BPE vocabulary
        pairs = [(_uuid(rng), _uuid(rng)) for _ in range(most)]

        def make(n: int) -> dict:
            n = max(n, 1)
            asked = pairs[round(depth / 100 * (n - 1))]
            body = ",\n ".join(f'"{k}": "{v}"' for k, v in pairs[:n])
            return {"instruction": "Extract the value corresponding to the specified key in the JSON object below.",
                    "document": "JSON data:\n{" + body + "}", "question": f'Key: "{asked[0]}"',
                    "answer_prefix": "Corresponding value:", "references": [asked[1]],
                    "max_new_tokens": 48}  # fmt: skip

        return fit(make, measure, length, hi=most)


_QA_INSTRUCTION = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other words."
)


@dataclass(frozen=True)
class DocQATask(Task):
    """Real questions over real paragraphs: the gold paragraph(s) at `depth` among distractors (RULER qa_1/qa_2).

    `source`: `squad` (SQuAD v2, one gold paragraph; distractors come from other articles) or `hotpotqa`
    (the two supporting paragraphs of a two-hop question, kept together, among other questions' paragraphs).
    Scored with string_match_part: any of the reference answers.
    """

    name: ClassVar[str] = "doc_qa"
    metric: ClassVar[str] = "string_match_part"
    source: str = "squad"

    def __post_init__(self):
        if self.source not in ("squad", "hotpotqa"):
            raise ValueError(f"doc_qa: source must be 'squad' or 'hotpotqa', got {self.source!r}")

    def build(self, rng, length, depth, measure):
        if self.source == "squad":
            questions, paragraphs, article_of = data.squad_questions()
            item = rng.choice(questions)
            gold = [item["paragraph"]]
            pool = [i for i in range(len(paragraphs)) if article_of[i] != item["article"]]
        else:
            questions, paragraphs = data.hotpotqa_questions()
            item = rng.choice(questions)
            gold = list(item["paragraphs"])
            pool = [i for i in rng.sample(range(len(paragraphs)), length // 20 + 80) if i not in set(gold)]
        candidates = rng.sample(pool, min(len(pool), length // 20 + 40))

        def make(distractors: list[int]) -> dict:
            docs = list(distractors)
            at = round(depth / 100 * len(docs))
            docs[at:at] = gold
            text = "\n\n".join(f"Document {i + 1}:\n{paragraphs[d]}" for i, d in enumerate(docs))
            return {"instruction": _QA_INSTRUCTION, "document": text,
                    "question": f"{_QA_INSTRUCTION}\n\nQuestion: {item['question']}", "answer_prefix": "Answer:",
                    "references": list(item["answers"]), "max_new_tokens": 32}  # fmt: skip

        # Paragraphs differ in length, so fill greedily: add each candidate that still fits, and stop when
        # the prompt is within a short paragraph of the length or 20 candidates in a row did not fit.
        chosen: list[int] = []
        sample = make(chosen)
        tokens = measure(sample)
        misses = 0
        for candidate in candidates:
            if length - tokens < 40 or misses >= 20:
                break
            trial = make(chosen + [candidate])
            trial_tokens = measure(trial)
            if trial_tokens <= length:
                chosen.append(candidate)
                sample, tokens, misses = trial, trial_tokens, 0
            else:
                misses += 1
        return {**sample, "n_tokens": tokens}


@dataclass(frozen=True)
class UserNeedleTask(NeedleTask):
    """The needle task with the user's documents (--documents) as the haystack."""

    name: ClassVar[str] = "user_needle"
    uses_documents: ClassVar[bool] = True


@dataclass(frozen=True)
class UserRecallTask(Task):
    """Recall of the user's own text: quote the opening words of a sentence at `depth`, ask for what follows.

    The references are the next `words` words in chunks of three; string_match_all gives the fraction recalled.
    """

    name: ClassVar[str] = "user_recall"
    uses_documents: ClassVar[bool] = True
    words: int = 9

    def build(self, rng, length, depth, measure):
        corpus = self.haystack()
        start = rng.choice(_sentence_starts(corpus)[:-1])

        def make(n: int) -> dict:
            hay = _cyclic(corpus, start, n)
            cue_len = 6
            starts = [s for s in _sentence_starts(hay) if s + cue_len + 3 <= len(hay)] or [0]
            at = _snap(starts, depth / 100 * len(hay))
            cue = " ".join(hay[at : at + cue_len])
            rest = hay[at + cue_len : at + cue_len + self.words]
            chunks = [" ".join(rest[i : i + 3]) for i in range(0, len(rest), 3)] or [cue]
            return {"instruction": "Read the following text carefully. I will ask you to quote part of it afterwards.",
                    "document": " ".join(hay),
                    "question": f'Continue the passage that starts with "{cue}", word for word.',
                    "answer_prefix": f'"{cue}', "references": chunks, "max_new_tokens": 2 * self.words + 8}  # fmt: skip

        return fit(make, measure, length, hi=length)


# The multi_question task's facts: invented places and people, so a model cannot know them from its training.
_FOUNDERS = ("Harwick Ellery Corbin Fairholt Greyhaven Kestrel Linford Marlow Norcastle Oakhurst Pellam Redmayne "
             "Saltash Thornbury Upwell Varley Westcombe Yardley Ambrose Blackwood").split()  # fmt: skip
_BUILDINGS = ("lighthouse|observatory|clock tower|paper mill|rope works|glassworks|bell foundry|botanical garden|"
              "ferry pier|railway bridge|grain exchange|music hall|printing house|canal lock|public library|"
              "orphanage|tannery|brewery").split("|")  # fmt: skip
_FIRST_NAMES = ("Eleanor Tobias Margaret Silas Beatrice Ambrose Cordelia Jasper Harriet Ezekiel Lavinia Barnaby "
                "Philippa Cornelius Rosamund Thaddeus Winifred Lucius Imogen Percival").split()  # fmt: skip
_LAST_NAMES = ("Whitcombe Ashdown Penhallow Quarrington Fennimore Dunstable Hollingsworth Merriweather Brackenbury "
               "Ravenscroft Tillinghast Wetherell Cavendish Pettigrew Stanbridge Larkspur Winterbourne "
               "Oddington").split()  # fmt: skip
_MONTHS = "January February March April May June July August September October November December".split()
_PLACES = ("Brindlecombe Caddington Dunwold Eastmere Farrowdale Glenbarrow Ivelmoor Kettleby Lowerbrook Moorcastle "
           "Nettlecombe Pendleford Quenby Rushmere Stallingford Tarrowby Wendlebury Ashby Cross").split()  # fmt: skip
_MOTTOS = (
    "patience outlasts the storm", "light for every traveller", "we build for our grandchildren",
    "steady hands and honest work", "the river remembers", "strength in small things", "no tide without a turn",
    "order brings its own reward", "every voice a song", "the lamp is never late", "wisdom waits at the door",
    "bread before glory", "seeds of a second spring", "the bell calls us home", "slow paper holds the truth",
    "rope and courage bind", "through fire comes clarity", "green is the oldest colour",
)
# kind -> (fact sentence, question, answer prefix); {subject} is "the <founder> <building>", {Subject} the same
# capitalised; each fact's answer is made by `_fact_value` and given to the templates as {value} (and {month},
# {year} for a date).
_FACTS = {
    "number": ("Exactly {value} workers were hired to build {subject}.",
               "How many workers were hired to build {subject}?",
               "The number of workers hired to build {subject} was"),
    "name": ("{Subject} was designed by an architect named {value}.",
             "What was the name of the architect who designed {subject}?",
             "The architect who designed {subject} was named"),
    "date": ("{Subject} opened to the public in {month} {year}.",
             "In which month and year did {subject} open to the public?",
             "{Subject} opened to the public in"),
    "place": ("The stone for {subject} was brought by cart from the quarry at {value}.",
              "From the quarry at which place was the stone for {subject} brought?",
              "The stone for {subject} was brought from the quarry at"),
    "phrase": ('Above the door of {subject}, the builders carved the words "{value}".',
               "What words did the builders carve above the door of {subject}?",
               'The builders carved the words "'),
}


def _fact_value(rng: random.Random, kind: str, month: str, year: str) -> str:
    """A value of `kind` for a fact; draws from `rng` only what that kind needs (a date is `month year`)."""
    return {"number": lambda: str(rng.randint(1000, 9999)),
            "name": lambda: f"{rng.choice(_FIRST_NAMES)} {rng.choice(_LAST_NAMES)}",
            "date": lambda: f"{month} {year}", "place": lambda: rng.choice(_PLACES),
            "phrase": lambda: rng.choice(_MOTTOS)}[kind]()  # fmt: skip


def _fact(rng: random.Random, kind: str, subject: str, used: set[str]) -> tuple[str, str, str, list[str]]:
    """(fact sentence, question, answer prefix, references) of one fact of `kind` about `subject`; a value in
    `used` is drawn again, so no two facts of a document share an answer."""
    while True:
        month, year = rng.choice(_MONTHS), str(rng.randint(1720, 1899))
        value = _fact_value(rng, kind, month, year)
        if value not in used:
            used.add(value)
            break
    fields = {"subject": subject, "Subject": subject[0].upper() + subject[1:], "value": value, "month": month,
              "year": year}  # fmt: skip
    fact, question, prefix = (text.format(**fields) for text in _FACTS[kind])
    return fact, question, prefix, [month, year] if kind == "date" else [value]


@dataclass(frozen=True)
class MultiQuestionTask(Task):
    """A long document of real prose holding one fact at each depth of the grid, asked one question per fact.

    The facts are of different kinds (a number, a name, a month and year, a place, a short phrase), each about its
    own invented building, in a public-domain novel (data.book_words: the development half's documents come from
    its first chapters, the test half's from the rest). All questions of a document share its prompt up to the end
    of the document, so the runner prefills and compresses it once and answers each question on an untouched
    copy of that cache; each question is a sample of its own (its depth is its fact's), scored per band. `kinds`
    chooses the kinds (joined by `+`), used in turn from a shuffled start.
    """

    name: ClassVar[str] = "multi_question"
    asks_per_document: ClassVar[bool] = True
    kinds: str = "number+name+date+place+phrase"

    def __post_init__(self):
        unknown = [k for k in self.kinds.split("+") if k not in _FACTS]
        if unknown or not self.kinds:
            raise ValueError(
                f"multi_question: kinds must be some of {'+'.join(_FACTS)} joined by '+', got {self.kinds!r}"
            )

    def haystack(self, half: str = "test") -> Sequence[str]:
        return data.book_words(half)

    def build_document(self, rng: random.Random, length: int, depths: Sequence[float], half: str,
                       measure: Measure) -> list[dict]:
        """One sample per depth, all on one document of at most `length` tokens with each prompt."""
        words = self.haystack(half)
        starts = _sentence_starts(words)[:-1]
        start = rng.choice([s for s in starts if s <= len(words) - length] or starts)
        kinds = self.kinds.split("+")
        offset = rng.randrange(len(kinds))
        pairs = [(f, b) for f in _FOUNDERS for b in _BUILDINGS]
        chosen: list[tuple[str, str]] = []
        while len(chosen) < len(depths):  # every fact about another founder's name and another kind of building
            founder, building = rng.choice(pairs)
            distinct = all(founder != f and building != b for f, b in chosen)
            if distinct or len(chosen) >= min(len(_FOUNDERS), len(_BUILDINGS)):
                chosen.append((founder, building))
        used: set[str] = set()
        facts = [_fact(rng, kinds[(offset + k) % len(kinds)], f"the {founder} {building}", used)
                 for k, (founder, building) in enumerate(chosen)]  # fmt: skip
        instruction = "Read the following text carefully. I will ask you a question about it afterwards."

        def make(n: int) -> list[dict]:
            placed = [(depth, fact[0]) for depth, fact in zip(depths, facts, strict=True)]
            document = _insert(_cyclic(words, start, n), placed)
            return [{"instruction": instruction, "document": document, "question": question, "answer_prefix": prefix,
                     "references": references, "max_new_tokens": 16}
                    for _, question, prefix, references in facts]  # fmt: skip

        lo, hi, best = 0, length, None
        while lo <= hi:  # the longest n whose every prompt fits `length` (the prompts grow with n)
            mid = (lo + hi) // 2
            rows = make(mid)
            if max(measure(row) for row in rows) <= length:
                best, lo = rows, mid + 1
            else:
                hi = mid - 1
        rows = best if best is not None else make(0)
        return [{**row, "n_tokens": measure(row)} for row in rows]


TASKS: dict[str, type[Task]] = {
    cls.name: cls
    for cls in (NeedleTask, MultiNeedleTask, KVRetrievalTask, DocQATask, UserNeedleTask, UserRecallTask,
                MultiQuestionTask)
}


def parse_task(spec: str, documents: str | None = None) -> Task:
    """`multi_needle:keys=4,values=2` -> MultiNeedleTask(keys=4, values=2); raises ValueError on a bad spec."""
    name, _, args = spec.strip().partition(":")
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose from {', '.join(TASKS)}")
    cls = TASKS[name]
    types = {f.name: f.type for f in fields(cls) if f.name != "documents"}
    kwargs = {}
    for item in filter(None, args.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in types:
            raise ValueError(f"task {name}: unknown parameter {key!r}; it takes {', '.join(types) or 'none'}")
        kwargs[key] = int(value) if types[key] in ("int", int) else value
    if cls.uses_documents and documents is None:
        raise ValueError(f"task {name} reads your documents: pass --documents DIR")
    return cls(documents=str(documents) if documents is not None else None, **kwargs)


def split_specs(text: str) -> list[str]:
    """Split a comma-separated list of specs whose own parameters are comma-separated ("a:x=1,y=2,b").

    A ';' is refused rather than read: `bench.py --specs` separates with ';', and a list pasted from there would
    otherwise reach the spec parser as one spec whose last parameter swallows the rest.
    """
    if ";" in text:
        raise ValueError(f"separate specs and tasks with ',' (got ';' in {text!r}); e.g. 'dynamic,int4,kvzip:ratio=0.5'"
                         )
    specs: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if specs and "=" in part and ":" not in part.split("=")[0]:
            specs[-1] += "," + part  # a parameter of the previous spec
        else:
            specs.append(part)
    return specs


def sample_rng(seed: int, task: Task, length: int, depth: float, index: int) -> random.Random:
    """One generator per sample, so a sample does not depend on which other samples are built. The depth is seeded as
    a float (the CLI's and lm-eval's form), so `depths=[10]` builds the samples that `[10.0]` does, as their ids say."""
    return random.Random(f"{seed}|{task.sample_prefix}|{length}|{float(depth)}|{index}")


def document_rng(seed: int, task: Task, length: int, depths: Sequence[float], index: int) -> random.Random:
    """One generator per document of a task that asks several questions of it (one per depth)."""
    return random.Random(f"{seed}|{task.sample_prefix}|{length}|{','.join(f'{d:g}' for d in depths)}|{index}")


COLUMNS = ("sample_id", "task", "metric", "length", "depth", "index", "seed", "split", "instruction", "document",
           "question", "answer_prefix", "references", "max_new_tokens", "n_tokens")  # fmt: skip


def build_samples(
    tokenizer,
    tasks: Sequence[str | Task],
    lengths: Sequence[int],
    depths: Sequence[float],
    *,
    samples_per_cell: int = 1,
    seed: int = 0,
    split: str = "test",
    documents: str | None = None,
    prompt_format: PromptFormat = "auto",
    limit: int | None = None,
):
    """The evaluation samples as a `datasets.Dataset`, one row per (task, length, depth, index).

    Lengths count `tokenizer`'s tokens of the whole prompt (document and question, rendered with
    `prompt_format`); `split` chooses the half (`dev`, `test` or `all`, see `sample_split`) and
    `samples_per_cell` counts the samples of that half in each cell; `limit` keeps the first `limit` samples of
    each task. Each row records its `split`.
    """
    import datasets  # the eval extra's: the samples are built only by the lab

    check_split(split)

    def measure(sample: dict) -> int:
        document_ids, question_ids = encode(tokenizer, sample, prompt_format=prompt_format)
        return len(document_ids) + len(question_ids)

    def checked(task: Task, length: int, sample: dict) -> dict:
        if sample["n_tokens"] > length:  # the scaffolding alone is longer: the length would be a lie
            raise ValueError(
                f"--lengths {length} is too short for task {task.spec}: its instruction, question, "
                f"needed facts and prompt format already take {sample['n_tokens']} tokens; use lengths "
                f"of at least {sample['n_tokens']} (a few hundred leave room for a document)"
            )
        return sample

    def row(task: Task, length: int, depth: float, index: int, sample: dict) -> dict:
        depth_label = int(depth) if float(depth).is_integer() else depth
        return {"sample_id": f"{task.sample_prefix}/L{length}/d{depth_label}/i{index}/s{seed}", "task": task.spec,
                "metric": task.metric, "length": int(length), "depth": float(depth), "index": index, "seed": seed,
                "split": sample_split(index), **sample}  # fmt: skip

    for depth in depths:
        if not 0 <= depth <= 100:
            raise ValueError(f"depths are percents of the document, 0 to 100; got {depth}")
    indices = split_indices(split, samples_per_cell)
    rows = []
    for task in tasks:
        task = parse_task(task, documents) if isinstance(task, str) else task
        if task.uses_documents and task.documents is None and documents is not None:
            task = replace(task, documents=str(documents))
        made: list[dict] = []

        def full(made: list[dict] = made) -> bool:
            return limit is not None and len(made) >= limit

        for length in lengths:
            if task.asks_per_document:
                for index in indices:
                    if full():
                        break
                    rng = document_rng(seed, task, length, depths, index)
                    questions = task.build_document(rng, length, depths, sample_split(index), measure)
                    made += [row(task, length, d, index, checked(task, length, q))
                             for d, q in zip(depths, questions, strict=False)]
                continue
            for depth in depths:
                for index in indices:
                    if full():
                        break
                    sample = task.build(sample_rng(seed, task, length, depth, index), length, depth, measure)
                    made.append(row(task, length, depth, index, checked(task, length, sample)))
        rows += made[:limit] if limit is not None else made
    return datasets.Dataset.from_list([{c: r[c] for c in COLUMNS} for r in rows])
