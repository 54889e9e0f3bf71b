"""The command line: generate with any cache, the study at a tiny size, and one-line errors for bad input."""

import argparse
import json
import re
from pathlib import Path

import pytest
import torch

from hf_kvcompress.cli import build_parser, main, run_command


def test_generate_streams_an_answer_and_reports_speed_and_bytes(capsys):
    assert main(["generate", "--prompt", "What is the capital of France?", "--cache", "int4",
                 "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "Paris" in out
    assert re.search(r"\[cache int4\] prefill \d+ tokens at [\d.]+ tok/s; decode \d+ tokens at [\d.]+ tok/s; "
                     r"KV cache holds [\d,]+ bytes", out)
    # Issue 25.7: the ratio is against the 16-bit cache the model is served in, not this CPU run's float32 one.
    served = re.search(r"\[cache int4\] ([\d,]+) bytes at bfloat16, the dtype the model is served in \(it ran in "
                       r"float32 here; keys and values counted at bfloat16's width\): ([\d.]+) of the ([\d,]+) bytes "
                       r"an uncompressed bfloat16 cache holds for the same (\d+) tokens", out)
    assert served, out
    tokens = int(served[4])
    assert int(served[3].replace(",", "")) == 2 * 30 * 3 * 64 * 2 * tokens
    assert float(served[2]) > 0.9  # within the full-precision residual: about the uncompressed bytes (was 1/2 of fp32)
    # A short prompt lies entirely within int4's full-precision residual: the summary says so.
    assert re.search(r"\[cache int4\] int4: keeps \d+ tokens per layer, all within int4's full-precision residual "
                     r"\(residual_length=128\): nothing is quantized", out)


def test_generate_builds_int2_with_the_models_config(capsys):
    # int2's pre_rope reads the RoPE frequencies from the config: the spec check before loading must not need it.
    assert main(["generate", "--prompt", "What is the capital of France?", "--cache", "int2",
                 "--max-new-tokens", "2"]) == 0
    assert "[cache int2]" in capsys.readouterr().out


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["budget"], ["calibrate", "--out", "x"]])
def test_an_unknown_model_lists_the_embedded_names_not_the_hubs_connection_error(capsys, monkeypatch, command):
    import transformers

    asked = []

    def unreachable(name, **kwargs):  # what transformers says when the Hub cannot be reached and nothing is cached
        asked.append(kwargs.get("local_files_only", False))
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", unreachable)
    assert main([*command, "--model", "smollm2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "couldn't connect" not in err
    assert "unknown model 'smollm2' (did you mean smollm2-135m?)" in err
    assert "smollm2-135m (the default; also smollm2-135m-instruct) and gemma-3-270m (also gemma3-270m)" in err
    assert "a local directory, a .gguf file, or a Hub id (owner/name) with the Hub reachable" in err
    assert asked == [True]  # a name without an owner is looked up in the local cache only: no Hub retries
    assert main([*command, "--model", "someone/no-such-model"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown model 'someone/no-such-model': not a local path, and the Hub gave no config" in err
    assert "couldn't connect" not in err and asked == [True, False]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["generate", "--prompt", "hi", "--cache", "nope"], "unknown cache spec name 'nope'"),
        (["generate", "--prompt", "hi", "--cache", "kvzip:ratio=0.5;int4"], "holds ';': give one spec"),
        (["generate", "--prompt", "hi", "--cache", "int4:bits=3"], "unknown codec argument"),
        (["generate", "--prompt", "hi", "--cache", "sink_window:window=0"], "window must be an integer >= 1"),
        (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["generate", "--prompt", "hi", "--model", "no-such-model-anywhere"], "unknown model 'no-such-model-anywhere'"),
        (["study", "--lengths", "0"], "--lengths"),
        (["study", "--depths", "120"], "--depths"),
        (["calibrate", "--floors", "--ratios", "0.25,1.5", "--out", "x"], "--ratios must be numbers between 0 and 1"),
        (["calibrate", "--floors", "--ratios", "a", "--out", "x"], "--ratios must be numbers between 0 and 1"),
    ],
)
def test_user_errors_are_one_line_without_traceback(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_study_reports_formula_measured_bytes_bands_and_a_recommendation(tmp_path, capsys):
    out = tmp_path / "study"
    code = main(["study", "--model", "smollm2-135m", "--lengths", "250", "--depths", "10,50,90", "--tasks", "needle",
                 "--plans", "int8;sink_window:sink_tokens=4,window=32", "--samples-per-cell", "1", "--batch-size", "1",
                 "--out", str(out)])  # batch 1: no padding, so the uncompressed cache holds exactly the formula's bytes
    assert code == 0
    text = (out / "study.md").read_text()
    assert capsys.readouterr().out.strip().endswith(text.strip().splitlines()[-1])
    for needle in ("formula", "measured", "start", "middle", "end", "Users per GPU", "Recommended:"):
        assert needle in text
    rows = {line.split()[0]: line.split() for line in text.splitlines()
            if line.startswith(("dynamic ", "int8 ", "sink_window"))}
    assert set(rows) == {"dynamic", "int8", "sink_window:sink_tokens=4,window=32"}
    assert float(rows["dynamic"][1]) == float(rows["dynamic"][2])  # uncompressed: measured == formula
    assert (out / "smollm2-135m" / "quality_vs_memory.png").exists()
    assert "Full-precision residual" in text and "int8: the 128 most recent of" in text
    # 3 plans (the baseline is always added) x 3 samples, each plan from the same shared document prefill.
    assert re.search(r"1 samples per cell: 3 scored samples per plan; .*; 9 runs in \d+ s", text)
    # The study reports the test half, and says so.
    assert "Split: test (the held-out half" in text
    assert json.loads((out / "smollm2-135m" / "study.json").read_text())["split"] == "test"
    assert {json.loads(line)["split"] for line in (out / "smollm2-135m" / "records.jsonl").open()} == {"test"}


@pytest.mark.parametrize(
    "argv,message",
    [
        (["eval", "--methods", "int5"], "unknown cache spec name 'int5'"),
        # A ';' list (bench.py's and the study's separator) would parse as one spec: refused by name.
        (["eval", "--methods", "dynamic;kvzip:probe=a;int4"], "separate specs and tasks with ','"),
        (["eval", "--tasks", "needle:kind=color"], "kind must be one of"),
        (["eval", "--samples", "0"], "--samples must be at least 1"),
        (["eval", "--lengths", "9000"], "--lengths 9000: the model's context is 8,192 tokens"),
        (["study", "--plans", "dynamic;int5"], "unknown cache spec name 'int5'"),
    ],
)
def test_eval_and_study_check_their_input_before_any_work(capsys, tmp_path, argv, message):
    out = tmp_path / "out"
    assert main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists()  # nothing ran, nothing was written


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a torch without CUDA")
@pytest.mark.parametrize("command", ["eval", "generate"])
def test_cuda_device_without_cuda_is_one_line(capsys, tmp_path, command):
    extra = ["--out", str(tmp_path)] if command == "eval" else ["--prompt", "hi"]
    assert main([command, "--device", "cuda", *extra]) == 2
    err = capsys.readouterr().err
    assert "--device cuda: this torch" in err and "has no CUDA" in err and len(err.strip().splitlines()) == 1


def test_ctrl_c_is_a_short_message_that_says_results_are_kept(capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    args = argparse.Namespace(func=interrupted, out="results/eval")
    assert run_command(args, "hf-kvcompress eval") == 130
    err = capsys.readouterr().err.strip()
    assert err == ("hf-kvcompress eval: interrupted; finished results are kept in results/eval, and the same command "
                   "resumes from them")


def _subparser(name):
    parser = build_parser()
    return next(a for a in parser._subparsers._group_actions if isinstance(a, argparse._SubParsersAction)).choices[name]


def test_help_describes_every_option_and_shows_defaults():
    generate = _subparser("generate")
    assert generate.description
    assert [a.dest for a in generate._actions if not a.help] == []
    study = " ".join(_subparser("study").format_help().split())
    assert "(default: demo)" in study and "(default: results/study)" in study
    assert "(default 512)" in " ".join(_subparser("eval").format_help().split())


def _parsers(parser, path=("hf-kvcompress",)):
    """Every (path, parser) of the argparse tree, sub-commands of sub-commands included."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _parsers(child, (*path, name))


def test_every_command_and_option_has_help_text():
    missing = []
    for path, parser in _parsers(build_parser()):
        if len(path) > 1 and not parser.description:
            missing.append(" ".join(path) + " (no description for --help)")
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                missing += [f"{' '.join(path)} {c.dest} (no line in the list)" for c in action._choices_actions
                            if not c.help]
            elif not action.help:
                missing.append(f"{' '.join(path)} {'/'.join(action.option_strings) or action.dest}")
    assert missing == []


def test_lm_eval_help_names_the_cache_argument_and_the_shipped_tasks(capsys):
    assert main(["lm-eval", "--help"]) == 0
    out = capsys.readouterr().out
    assert "cache=SPEC" in out and "kvc_needle" in out and "kvc_multi_needle" in out
    assert "lm-eval's own help follows" in out and "--model_args" in out


def test_lm_eval_run_and_ls_find_the_shipped_tasks_without_include_path():
    from hf_kvcompress.commands.lm_eval import _default_include_path, lm_eval_argv

    include = _default_include_path()
    assert include is not None and (Path(include) / "kvc_needle" / "kvc_needle.yaml").exists()
    assert lm_eval_argv(["ls", "tasks"]) == ["ls", "tasks", "--include_path", include]
    assert lm_eval_argv(["--model", "hf-kvcompress", "--tasks", "kvc_needle"])[-2:] == ["--include_path", include]
    assert lm_eval_argv(["ls", "tasks", "--include_path", "mine"]) == ["ls", "tasks", "--include_path", "mine"]
    assert lm_eval_argv(["--help"]) == ["--help"]


def test_help_of_every_command_imports_neither_torch_nor_transformers():
    """`hf-kvcompress [COMMAND] --help` reads no torch, so it prints in a fraction of a second (it took 4-7 s)."""
    import subprocess
    import sys

    script = (
        "import sys, contextlib, io\n"
        "from hf_kvcompress.cli import COMMANDS, main\n"
        "for argv in [[]] + [[name.replace('_', '-')] for name in COMMANDS]:\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        main(argv + ['--help'])\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'matplotlib') if m in sys.modules)\n"
        "print(heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).parent.parent)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
