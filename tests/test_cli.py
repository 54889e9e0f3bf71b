"""The command line: generate with any cache, the study at a tiny size, and one-line errors for bad input."""

import re

import pytest

from hf_kvcompress.cli import main


def test_generate_streams_an_answer_and_reports_speed_and_bytes(capsys):
    assert main(["generate", "--prompt", "What is the capital of France?", "--cache", "int4", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "Paris" in out
    assert re.search(r"\[cache int4\] prefill \d+ tokens at [\d.]+ tok/s; decode \d+ tokens at [\d.]+ tok/s; "
                     r"KV cache holds [\d,]+ bytes", out)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["generate", "--prompt", "hi", "--cache", "nope"], "unknown cache spec name 'nope'"),
        (["generate", "--prompt", "hi", "--cache", "int4:bits=3"], "unknown codec argument"),
        (["generate", "--prompt", "hi", "--cache", "sink_window:window=0"], "window must be a positive integer"),
        (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["generate", "--prompt", "hi", "--model", "no-such-model-anywhere"], "name_or_path"),
        (["study", "--lengths", "0"], "--lengths"),
        (["study", "--depths", "120"], "--depths"),
    ],
)
def test_user_errors_are_one_line_without_traceback(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_study_reports_formula_measured_bytes_bands_and_a_recommendation(tmp_path, capsys):
    out = tmp_path / "study"
    code = main(["study", "--model", "smollm2-135m", "--lengths", "250", "--depths", "10,50,90", "--tasks", "needle",
                 "--plans", "int8;sink_window:sink_tokens=4,window=32", "--samples-per-cell", "1", "--out", str(out)])
    assert code == 0
    text = (out / "study.md").read_text()
    assert capsys.readouterr().out.strip().endswith(text.strip().splitlines()[-1])
    for needle in ("formula", "measured", "start", "middle", "end", "Users per GPU", "Recommended:"):
        assert needle in text
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith(("dynamic ", "int8 ", "sink_window"))}
    assert set(rows) == {"dynamic", "int8", "sink_window:sink_tokens=4,window=32"}
    assert float(rows["dynamic"][1]) == float(rows["dynamic"][2])  # uncompressed: measured == formula
    assert (out / "smollm2-135m" / "quality_vs_memory.png").exists()
