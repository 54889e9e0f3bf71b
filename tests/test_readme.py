"""The README's Python snippet runs as written (answers shortened to 8 tokens) and every cache in it answers."""

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).parent.parent / "README.md"


def test_the_generate_snippet_answers_with_each_cache():
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Caches in `generate()`") :]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert snippet.count("print(tokenizer.decode(") == 1 and "apply_chat_template" in snippet
    shown = snippet.replace("max_new_tokens=200", "max_new_tokens=8")
    lines, answers = [], []
    for line in shown.splitlines():
        lines.append(line)
        if line.startswith("out = model.generate("):  # keep each cache's answer, not only the last one printed
            lines.append("answers.append(tokenizer.decode(out[0, inputs['input_ids'].shape[1]:], skip_special_tokens=True))")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec("\n".join(lines), {"answers": answers})  # noqa: S102
    assert len(answers) == 3
    assert all(answer.strip() for answer in answers), answers  # without the chat template they were all empty
    assert "Paris" in answers[0] and printed.getvalue().strip()


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
    assert len(lines) == 3 and lines[0].startswith("Document(") and "kvzip:ratio=0.25+int4" in lines[0], lines
    assert lines[1].strip()
    batch = eval(lines[2])  # noqa: S307  (the printed list of two answers)
    assert len(batch) == 2 and all(answer.strip() for answer in batch), batch
    uncompressed = compress_document(names["model"], names["tokenizer"], names["text"], "dynamic")
    questions = ["Who is the tower named after?", "How tall is the tower?",
                 "Which building became the tallest in 1930?"]
    named, tall, finished = uncompressed.ask(questions, max_new_tokens=32)
    assert "Eiffel" in named and "330" in tall and "Chrysler" in finished, (named, tall, finished)
