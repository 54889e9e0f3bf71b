"""benchmarks/ is code too: every probe is a script with a header (the question it answers, the command that runs it,
where its answer is written up) and a `main()`, nothing but imports, definitions and constants at module level, and it
answers `--help`; so does the maintained harness (benchmarks/harness/, `make bench`)."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
PROBES = sorted((BENCHMARKS / "probes").glob("*.py"))
HARNESS = sorted((BENCHMARKS / "harness").glob("*.py"))
HEADER = ("Question:", "Command:", "Written up:")
# Calls a module-level constant may make: building a path, a collection, a number (nothing that loads or runs).
CONSTANT_CALLS = {"Path", "resolve", "dict", "list", "tuple", "set", "frozenset", "range", "int", "float", "str"}


def _is_main_guard(node: ast.stmt) -> bool:
    """`if __name__ == "__main__":` whose body is one call of `main()`."""
    return (isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'"
            and [ast.unparse(n) for n in node.body] == ["main()"] and not node.orelse)


def _is_path_setup(node: ast.stmt) -> bool:
    """`sys.path.insert(0, ...)`: where a script finds its neighbours (benchmarks/harness/ for the probes that share
    the bench's environments), before it imports them."""
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
            and ast.unparse(node.value.func) == "sys.path.insert")


def _is_constant(node: ast.stmt) -> bool:
    """`NAME = value` (or `A, B = ...`, annotated or not), upper-case names, the value built by CONSTANT_CALLS only."""
    if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
        return False
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    names = [n for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    if not names or any(not n.id.isupper() for n in names) or any(isinstance(n, ast.Attribute) for t in targets
                                                                   for n in ast.walk(t)):
        return False
    for call in (n for n in ast.walk(node.value) if isinstance(n, ast.Call)):
        name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", None)
        if name not in CONSTANT_CALLS:
            return False
    return True


def layout_problems(source: str, name: str) -> list[str]:
    """What keeps the probe `name` (its source) from being a script with a header and a main(); [] if nothing."""
    tree = ast.parse(source)
    problems = []
    doc = ast.get_docstring(tree) or ""
    problems += [f"its docstring has no {field!r} line" for field in HEADER if f"\n{field}" not in f"\n{doc}"]
    if f"python benchmarks/probes/{name}" not in doc:
        problems.append(f"its docstring's command does not run benchmarks/probes/{name}")
    if not any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body):
        problems.append("it defines no main()")
    if not any(_is_main_guard(node) for node in tree.body):
        problems.append('it does not end in `if __name__ == "__main__": main()`')
    for node in tree.body[1:] if doc else tree.body:
        allowed = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        if isinstance(node, allowed) or _is_main_guard(node) or _is_path_setup(node) or _is_constant(node):
            continue
        problems.append(f"line {node.lineno} runs at import: {ast.unparse(node).splitlines()[0][:80]}")
    return problems


def test_there_are_probes_and_a_harness():
    assert len(PROBES) >= 10 and {"bench.py", "bench_measure.py", "bench_peer_worker.py", "peer_envs.py"} <= {
        path.name for path in HARNESS}
    assert not list(BENCHMARKS.glob("*.py")), "a script at the top of benchmarks/: a probe or part of the harness?"


@pytest.mark.parametrize("path", PROBES, ids=lambda path: path.name)
def test_a_probe_is_a_script_with_a_header_and_a_main(path):
    assert layout_problems(path.read_text(), path.name) == []


def test_the_check_catches_a_one_off_script():
    # kvzip_cost.py as it was committed before benchmarks/probes/: a usage line and module-level code.
    old = ('"""KVzip\'s cost as a ratio to one plain prefill.\n\nUsage: python benchmarks/kvzip_cost.py smollm2-135m '
           '2000\n"""\nimport sys, time, torch\ntorch.set_num_threads(1)\nfrom hf_kvcompress import load_model\n'
           'name, n = sys.argv[1], int(sys.argv[2])\nmodel, tok = load_model(name)\nfor rep in range(2):\n'
           '    print(name, n)\n')
    problems = layout_problems(old, "kvzip_cost.py")
    assert "it defines no main()" in problems and any("'Question:'" in p for p in problems)
    ran = [p.split(" runs")[0] for p in problems if p.startswith("line")]
    assert ran == ["line 6", "line 8", "line 9", "line 10"]  # set_num_threads, argv, the model, the loop


def test_harness_scripts_answer_help():
    """bench.py and the peers' worker import nothing heavy before parsing: each in a process of its own."""
    for name in ("bench.py", "bench_peer_worker.py"):
        done = subprocess.run([sys.executable, str(BENCHMARKS / "harness" / name), "--help"], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0 and "usage:" in done.stdout, (name, done.stderr[-2000:])


# One process runs every probe's `--help` in turn (runpy, as `python benchmarks/probes/X.py --help` would): the
# package, torch and transformers are imported once rather than once a probe.
HELP_ALL = """
import contextlib, io, json, runpy, sys
results = {}
for path in sys.argv[1:]:
    sys.argv, out = [path, "--help"], io.StringIO()
    sys.path[0] = path.rsplit("/", 1)[0]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
        results[path] = "returned without printing help"
    except SystemExit as stop:
        results[path] = "ok" if stop.code in (0, None) and "usage:" in out.getvalue() else f"exit {stop.code}"
    except BaseException as error:
        results[path] = f"{type(error).__name__}: {error}"
print(json.dumps(results))
"""


def test_every_probe_imports_and_answers_help():
    done = subprocess.run([sys.executable, "-c", HELP_ALL, *map(str, PROBES)], capture_output=True, text=True,
                          timeout=300, cwd=BENCHMARKS.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert {Path(path).name: why for path, why in results.items() if why != "ok"} == {}


def test_the_gpu_generate_probe_runs_on_cpu():
    """The GPU probes are run in the sessions that are lent a GPU, once: their dry run must work before then."""
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "probes" / "gpu_generate_speed.py"), "--device", "cpu", "--tiny",
         "--lengths", "64", "--batches", "1", "--new-tokens", "3", "--specs", "int4;snapkv:ratio=0.25"],
        capture_output=True, text=True, timeout=300, cwd=BENCHMARKS.parent,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.strip().startswith("64")]
    assert [row[2] for row in rows] == ["dynamic", "int4", "snapkv:ratio=0.25"]
    for row in rows:  # a difference of two timings: on a tiny model it can come out negative; only its form is checked
        float(row[3]), float(row[4].rstrip("x"))
