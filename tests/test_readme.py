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
