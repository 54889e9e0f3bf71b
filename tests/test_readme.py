"""The README runs as printed: its Python snippets (answers shortened to 8 tokens) print an answer for every
generate() call, and every command in its shell blocks is one the set-up installs, with arguments its parser takes."""

import argparse
import contextlib
import io
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
# Sections whose snippets are tested with the features they show (the document API), not here.
ELSEWHERE = ("### Saved caches (prompt caching)", "### Compress a document once, ask several questions (KVzip)")


def _blocks(language: str) -> list[tuple[str, str]]:
    """(the heading above it, the code) of every fenced block in `language`."""
    text = README.read_text(encoding="utf-8")
    blocks = []
    for match in re.finditer(rf"```{language}\n(.*?)```", text, re.S):
        prose = re.sub(r"```.*?```", "", text[: match.start()], flags=re.S)  # a code comment is no heading
        headings = re.findall(r"^#+ .*$", prose, re.M)
        blocks.append((headings[-1] if headings else "", match.group(1)))
    return blocks


PYTHON = [(heading, code) for heading, code in _blocks("python") if heading not in ELSEWHERE]


@pytest.mark.parametrize("heading, snippet", PYTHON, ids=[f"{h} #{i}" for i, (h, _) in enumerate(PYTHON)])
def test_each_python_snippet_runs_alone_and_prints_every_answer(heading, snippet):
    shown = re.sub(r"max_new_tokens=\d+", "max_new_tokens=8", snippet)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(shown, {})  # noqa: S102  (a fresh namespace: the snippet defines every name it uses)
    lines = printed.getvalue().splitlines()
    decoded = [line for line in lines if not line.endswith("bytes of KV cache")]
    assert len(decoded) == snippet.count("model.generate(") and all(line.strip() for line in decoded), lines
    if "What is the capital of France?" in snippet:
        assert "Paris" in decoded[0]


def test_the_quick_start_activates_the_venv_before_any_command_it_installs():
    text = README.read_text(encoding="utf-8")
    assert "source .venv/bin/activate" in text
    first = min(text.index(f"```bash\n{name}") for name in ("hf-kvcompress", "accelerate", "torchrun", "python")
                if f"```bash\n{name}" in text)  # fmt: skip
    assert text.index("source .venv/bin/activate") < first


PROGRAMS = ("hf-kvcompress", "python", "accelerate", "torchrun", "make", "source", "pip")


def _commands() -> list[list[str]]:
    """Each shell command of the README's bash blocks and inline code, split as a shell would."""
    text = README.read_text(encoding="utf-8")
    lines = [line for _, code in _blocks("bash") for line in code.replace("\\\n", "").splitlines()]
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    # Inline code: a command with its arguments (`hf-kvcompress eval` alone names the command).
    lines += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)
              if span.split()[0] in PROGRAMS and len(span.split()) > (2 if span.startswith("hf-") else 1)]  # fmt: skip
    commands = []
    for line in lines:
        line = line.split(" | ")[0]  # a pipe's first command is ours; grep and the like are the system's
        line = re.sub(r"<[^>]*>", "smollm2-135m", line)  # `--model <id or path>`: a user's value
        line = re.sub(r"(?<=\s)\.\.\.(?=\s|$)", "", line)  # a bare ...: options left out
        words = shlex.split(line, comments=True)
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # OMP_NUM_THREADS=1 ...
            words.pop(0)
        # M, L, DIR, OUT: a user's model, lengths, folder (prose templates); given a value each option takes
        words = [("1000" if words[i - 1] == "--lengths" else "x") if re.fullmatch(r"[A-Z]{1,3}\d?", w) else w
                 for i, w in enumerate(words)]  # fmt: skip
        if words:
            commands.append(words)
    return commands


def test_every_readme_command_is_installed_and_its_arguments_parse():
    from hf_kvcompress.cli import build_parser
    from hf_kvcompress.commands.eval import add_arguments

    bin_dir = Path(sys.executable).parent  # the venv's bin: where `source .venv/bin/activate` points the PATH
    text = README.read_text(encoding="utf-8")
    commands = _commands()
    for words in commands:
        program, args = words[0], words[1:]
        if program == "make":
            targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M)
            assert {a for a in args if "=" not in a} <= set(targets), words  # VAR=value: make's variables
            continue
        if program == "source":
            assert args == [".venv/bin/activate"] and (bin_dir / "activate").is_file(), words
            continue
        assert (bin_dir / program).is_file(), f"{program} is not in {bin_dir}"
        if program == "python":
            assert (ROOT / args[0]).is_file(), words
        elif program == "hf-kvcompress":
            if args[0] in ("lm-eval", "lm_eval"):
                continue  # its arguments are lm-eval's
            build_parser().parse_args(args)  # SystemExit (argparse's error) fails the test
        elif program in ("accelerate", "torchrun") and "-m" in args:  # not a fragment (`accelerate launch --cpu`)
            module = args[args.index("-m") + 1]
            assert module == "hf_kvcompress.eval", words
            parser = argparse.ArgumentParser()
            add_arguments(parser)
            parser.parse_args(args[args.index("-m") + 2 :])
    assert any(w[0] == "accelerate" for w in commands) and any(w[0] == "torchrun" for w in commands)
    assert "source .venv/bin/activate" in text


def _snippet(heading: str) -> str:
    text = README.read_text(encoding="utf-8")
    section = text[text.index(heading) :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _run(snippet: str) -> tuple[dict, list[str]]:
    printed = io.StringIO()
    names: dict = {}
    with contextlib.redirect_stdout(printed):
        exec(snippet, names)  # noqa: S102  (exactly as printed)
    return names, printed.getvalue().splitlines()


def test_the_document_snippets_run_as_printed_and_answer(tmp_path, monkeypatch):
    # The recipe they replace closed the user's turn before the question and opened no assistant turn: SmolLM2
    # ended at once, for every cache, the uncompressed one included.
    from hf_kvcompress import compress_document

    monkeypatch.chdir(tmp_path)  # the snippet saves doc.safetensors where it runs
    names, lines = _run(_snippet("### Saved caches (prompt caching)"))
    assert (tmp_path / "doc.safetensors").exists()
    assert len(lines) == 1 and lines[0].strip(), lines
    model, tokenizer = names["model"], names["tokenizer"]
    uncompressed = compress_document(model, tokenizer, names["text"], "dynamic")
    assert "Pierre" in uncompressed.ask("Who was Marie Curie's husband?", max_new_tokens=16)

    names, lines = _run(_snippet("### Compress a document once, ask several questions (KVzip)"))
    # a plain ratio below a half with int4 is the byte target of its int4 pairs (caches/plan.py `ratio_as_bytes`)
    planned = "kvzip:bytes=0.078125,span=0+int4:residual_length=32"
    assert len(lines) == 3 and lines[0].startswith("Document(") and planned in lines[0], lines
    assert lines[1].strip()
    batch = eval(lines[2])  # noqa: S307  (the printed list of two answers)
    assert len(batch) == 2 and all(answer.strip() for answer in batch), batch
    uncompressed = compress_document(names["model"], names["tokenizer"], names["text"], "dynamic")
    questions = ["Who is the tower named after?", "How tall is the tower?",
                 "Which building became the tallest in 1930?"]
    named, tall, finished = uncompressed.ask(questions, max_new_tokens=32)
    assert "Eiffel" in named and "330" in tall and "Chrysler" in finished, (named, tall, finished)
