"""`make bench`: prefill time, decode speed, peak memory and KV bytes of every cache and of its peers, as ratios to
DynamicCache.

    python benchmarks/harness/bench.py [--quick | --full] [--lengths 1024,4096,8192] [--batches 1,8] [--repeats 2]
                               [--new-tokens 16] [--specs "dynamic;int4;..."] [--peers all|none|quanto-int4,...]
                               [--dtypes float32,bfloat16] [--threads N] [--clock wall|cpu] [--compare-code DIR]
                               [--out benchmarks/results]
                               [--quantized-venv DIR] [--kvpress-venv DIR]

Each (cache, prompt length, batch) run happens in a fresh worker process, so its peak memory is its own; runs are
interleaved (every cache once per repeat, then the next repeat), so machine load hits every cache alike, and each
figure is the median over repeats. Ratios compare with DynamicCache at the same length and batch in the same run.
A run that fails is a row that names its error (and is not repeated), not the end of the bench.

The path measured is the user's: `load_model(dtype=...)`, `make_cache(spec, model.config)` and plain forward calls
(what `model.generate` runs), with `use_kvcompress_attention(model)` only for the policies the README asks it for
(attention-scored ones and KVzip, as `hf-kvcompress generate` does): the cache engages the package's attention itself
where it needs it. Each dtype of `--dtypes` (default float32 and bfloat16) is a table of its own, its ratios against
DynamicCache in that dtype.

Peers (`--peers`; bench_peer_worker.py): transformers' QuantizedCache with quanto int4 and int2, HQQ int4 and int2
and its fp8 backend (`quanto-int4`, `quanto-int2`, `hqq-int4`, `hqq-int2`, `transformers-fp8`), and kvpress 0.5.5's
SnapKV, StreamingLLM, TOVA, KVzip and ObservedAttention (H2O) presses keeping a quarter of the prompt
(`kvpress-snapkv`, `kvpress-streaming_llm`, `kvpress-tova`, `kvpress-kvzip`, `kvpress-observed_attention`:
compression_ratio 0.75, the share kvzip:ratio=0.25 keeps and the 1,024-token budgets keep at 4k). optimum-quanto and
hqq are no dependencies of this package and kvpress pins transformers < 5.3, so each family runs in a virtual
environment of its own (peer_envs.py; built with pip on first use, then reused), measured the same way, and each
peer's ratios are against DynamicCache run in that environment in the same run, interleaved with the rest (rows
`dynamic@quantized`, `dynamic@kvpress`; the table's "baseline env" column). A peer whose backend does not install
or does not run is a row with its error. Default: every peer; `--quick`: quanto-int4 and kvpress-snapkv;
`--compare-code`: none.

After the tables, the speed targets of issues 29 and 30 (bench_targets.py): for each target, in each dtype and
batch, the measured ratio to DynamicCache and whether it is met, not met, failed or not measured in this run. The
default caches include every cache a target names (`snapkv:ratio=0.25` for that reason, where kvpress's SnapKV peer
keeps the same quarter; `lowrank:ratio=0.5` and `lowrank`, issue 30's).

Cost, with `--threads 1` on a quiet 2-core CPU (estimates from the single-thread prefills measured here: batch 1 at
1k / 4k / 8k tokens about 3 / 17 / 48 s in float32 and 1.4 / 11 / 37 s in bfloat16, a batch-8 prefill of 4k tokens
185-235 s in float32, KVzip's 3-4.5x a prefill, and ~7 s per worker to load the model; batch 8 at 8k, never run,
taken as 8x batch 1): the default grid, 11 caches at 1k, 4k and 8k tokens with batch 1 and at 1k and 4k with batch 8,
both dtypes, takes about 2.1 hours a repeat, so 4.2 hours at the default 2 repeats, over two thirds of it batch 8; the
10 peers with their 2 baselines add about one and a half times as much again (at 1k and 4k, batch 1, one repeat:
1,000 s with 4 of our caches, of which 730 s were the peers; kvpress's KVzip replays the prompt at 5.5x a prefill,
ObservedAttention runs eager attention at 3.5x; kvpress's KVzip scores batch 1 only and fails at batch 8 after its
prefill); `--full` adds batch 8 at 8k tokens (the issue's whole grid), whose prefills add about 2.5 hours a repeat.
`--targets` runs only the 17 (cache, length) runs the targets read (DynamicCache at 1k, 4k and 8k; int4 and int2 at
each; fp8, int8, snapkv, kvzip and the two low-rank caches at 4k; sink_window at 8k) at batch 1 and 8 in both dtypes,
no peers: 17-22 minutes a repeat at batch 1 (`--targets --batches 1`) and 1.9 hours at batch 8, where its 8k runs
are half the time.
`--quick` (1k and 4k tokens, batch 1, 8 new tokens, two peers) takes about a quarter of an hour. On a shared machine
use `--threads 1 --clock cpu`: the CPU time of a single-threaded worker is what other processes disturb least.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "results"  # benchmarks/results, wherever it runs from; new files there are git-ignored
sys.path.insert(0, str(HERE))  # its neighbours, also when imported from elsewhere (the tests)

from bench_peer_worker import PEERS  # noqa: E402
from bench_targets import BATCHES as TARGET_BATCHES  # noqa: E402
from bench_targets import CELLS as TARGET_CELLS  # noqa: E402
from bench_targets import targets_table  # noqa: E402
from peer_envs import DEFAULT_PATHS, prepare  # noqa: E402

PEER_ENVS = ["quantized", "kvpress"]  # the order of their rows
QUICK_PEERS = ["quanto-int4", "kvpress-snapkv"]

SPECS = [
    "dynamic", "int8", "int4", "int2", "fp8",
    "sink_window:sink_tokens=4,window=1020", "h2o:budget=1024,recent=128", "snapkv:ratio=0.25",
    "kvzip:ratio=0.25", "lowrank:ratio=0.5", "lowrank",
]
QUICK = dict(lengths=[1024, 4096], batches=[1], repeats=2, new_tokens=8)
MIB = 1 << 20


def bench_cache(spec: str, config):
    """The cache a row measures. The baseline `dynamic` is what a user compares against: transformers' own
    DynamicCache, not this package's keep-all cache (`keep_all`, a row of its own when asked for), whose overhead
    would otherwise flatter every ratio."""
    import transformers

    from hf_kvcompress import make_cache

    return transformers.DynamicCache(config=config) if spec == "dynamic" else make_cache(spec, config)


def worker(spec: str, length: int, batch: int, new_tokens: int, model_name: str | None, clock: str,
           dtype: str = "float32") -> dict:
    """One prefill and `new_tokens` greedy decode steps with cache `spec` on the user's path; what they cost."""
    import torch
    import transformers
    from bench_measure import prompt_ids, timed_run

    import hf_kvcompress
    from hf_kvcompress import load_model, measured_kv_bytes, use_kvcompress_attention
    from hf_kvcompress.generation import prefill, repeat_prompt_ids
    from hf_kvcompress.hf.compat import cache_kwargs
    from hf_kvcompress.registry import needs_attention, needs_own_prefill

    model, tokenizer = load_model(model_name, dtype=dtype)
    if needs_attention(spec):  # as the README and `hf-kvcompress generate` do; nothing else asks for it
        use_kvcompress_attention(model)
    ids = prompt_ids(tokenizer.vocab_size, length, batch).to(model.device)
    repeat = repeat_prompt_ids(tokenizer) if needs_own_prefill(spec) else None
    cache = bench_cache(spec, model.config)
    result = timed_run(
        model, ids, lambda prompt: prefill(model, prompt, None, cache, repeat_prompt_ids=repeat),
        lambda token, _: model(input_ids=token, use_cache=True, **cache_kwargs(cache)), new_tokens, clock,
    )
    return result | {
        "kv_bytes": measured_kv_bytes(cache),
        "kept": cache.stored_tokens if spec != "dynamic" else cache.get_seq_length(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "hf-kvcompress": hf_kvcompress.__version__},
    }


class Row(NamedTuple):
    """One line of the table: a cache run in environment `env`, compared with the row labelled `baseline`."""

    label: str  # the cache spec (ours, with " @DIR" for --compare-code), a peer's name, or "dynamic@<env>"
    env: str  # "ours" (this package's environment) or a peer environment of peer_envs.py
    baseline: str  # label of DynamicCache measured in the same environment


def plan_rows(specs: list[str], peers: list[str]) -> list[Row]:
    """Our caches against our DynamicCache; each peer environment's DynamicCache, then its peers against it."""
    rows = [Row(spec, "ours", "dynamic") for spec in specs]
    for env in PEER_ENVS:
        chosen = [peer for peer in peers if PEERS[peer][0] == env]
        if chosen:
            rows += [Row(f"dynamic@{env}", env, f"dynamic@{env}")] + [Row(p, env, f"dynamic@{env}") for p in chosen]
    return rows


def _failure(done: subprocess.CompletedProcess) -> dict:
    """A failed run as a result: the last line of its error output (the exception), and that output's end."""
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    last = lines[-1].strip() if lines else "no error output (killed? out of memory?)"
    return {"error": f"{last[:300]} (exit {done.returncode})", "stderr": done.stderr[-3000:]}


def _dtype(args) -> str:
    """The dtype the workers run now (`args.dtype`, set for each of --dtypes in turn)."""
    return getattr(args, "dtype", "float32")


def _code_env(code: str) -> dict:
    """The environment our workers run in: the package from checkout `code` first on the path (--compare-code),
    or as installed when `code` is empty."""
    env = dict(os.environ)
    if code:
        env["PYTHONPATH"] = os.pathsep.join([code, env.get("PYTHONPATH", "")])
    return env


def build_kernels(rows: list[Row]) -> None:
    """Build the CPU decode kernel of every checkout the rows run (ours, and each --compare-code DIR) before any
    worker runs: it is compiled on first use (about 40 s) and cached across processes, so without this the first
    worker that reads a quantized store would time the compile as decode on a fresh clone."""
    codes = sorted({row.label.partition(" @")[2] for row in rows if row.env == "ours"})
    for code in codes:
        check = "from hf_kvcompress.ops import cpu_decode; print(cpu_decode.available())"
        done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=_code_env(code))
        built = done.stdout.strip().splitlines()[-1:] == ["True"]
        print(f"CPU decode kernel{' of ' + code if code else ''}: {'built' if built else 'not available'}", flush=True)


def _run_worker(args, row: Row, length: int, batch: int) -> dict:
    if row.env == "ours":
        spec, _, code = row.label.partition(" @")
        command = [sys.executable, __file__, "--worker", spec, "--lengths", str(length), "--batches", str(batch)]
        command += ["--new-tokens", str(args.new_tokens), "--clock", args.clock, "--dtypes", _dtype(args)]
        command += ["--model", args.model] if args.model else []
        env = _code_env(code)
    else:  # the peer's own environment: nothing of ours on its path
        peer = "dynamic" if row.label == row.baseline else row.label
        command = [str(args.peer_python[row.env]), str(HERE / "bench_peer_worker.py"), "--peer", peer]
        command += ["--model-dir", str(args.model_dir), "--length", str(length), "--batch", str(batch)]
        command += ["--new-tokens", str(args.new_tokens), "--clock", args.clock, "--dtype", _dtype(args)]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if args.threads:
        env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        return _failure(done)
    return json.loads(done.stdout.strip().splitlines()[-1])


COLUMNS = [  # (key, header, scale, format)
    ("prefill_s", "prefill s", 1, "{:.2f}"),
    ("decode_ms", "decode ms/token", 1, "{:.1f}"),
    ("decode_peak", "decode peak MiB", MIB, "{:.0f}"),
    ("prefill_peak", "prefill peak MiB", MIB, "{:.0f}"),
    ("kv_bytes", "KV MiB", MIB, "{:.1f}"),
]


def _medians(runs: list[dict]) -> dict | None:
    good = [r for r in runs if "error" not in r]
    return {key: statistics.median(r[key] for r in good) for key, *_ in COLUMNS} if good else None


def table(results: dict, rows: list[Row], grid: list[tuple[int, int]]) -> str:
    """Markdown: each figure's median and its ratio to DynamicCache at the same length and batch measured in the
    row's own environment; a failed run is a row whose error is a note under the table; then each environment's
    versions."""
    head = ["tokens", "batch", "cache", "baseline env", "kept"] + [f"{h} | x dyn" for _, h, _, _ in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * (5 + 2 * len(COLUMNS))]
    notes: dict[str, int] = {}  # note text -> its number
    for length, batch in grid:
        for row in rows:
            runs = results.get((row.label, length, batch))
            if runs is None:
                continue  # not a run of this grid (--targets)
            errors = sorted({r["error"] for r in runs if "error" in r})
            marks = "".join(f" [{notes.setdefault(f'`{row.label}` ({row.env}): {e}', len(notes) + 1)}]" for e in errors)
            value, base = _medians(runs), _medians(results.get((row.baseline, length, batch), []))
            cells = [str(length), str(batch), f"`{row.label}`", row.env]
            if value is None:
                lines.append("| " + " | ".join(cells + [f"failed{marks}"] + ["-"] * 2 * len(COLUMNS)) + " |")
                continue
            kept = next(r["kept"] for r in reversed(runs) if "error" not in r)
            failed = sum("error" in r for r in runs)
            cells.append(f"{kept} (failed {failed} of {len(runs)}{marks})" if failed else str(kept))
            for key, _, scale, fmt in COLUMNS:
                ratio = value[key] / base[key] if base is not None and base[key] > 0 else None
                cells += [fmt.format(value[key] / scale), "n/a" if ratio is None else f"{ratio:.2f}"]
            lines.append("| " + " | ".join(cells) + " |")
    if notes:
        lines += [""] + [f"[{number}] {text}" for text, number in notes.items()]
    versions: dict[str, dict] = {}
    env_of = {row.label: row.env for row in rows}
    for (label, _, _), runs in results.items():
        for r in runs:
            versions.setdefault(env_of.get(label), {}).update(r.get("versions", {}))
    described = [f"{env}: " + ", ".join(f"{k} {v}" for k, v in versions[env].items()) for env in versions if env]
    lines += ["", "Baseline env: each row's ratios are against DynamicCache run in the row's environment, in this "
              "run (`dynamic`, `dynamic@<env>`). " + "; ".join(described) + "."]
    return "\n".join(lines)


def plot(results: dict, rows: list[Row], grid: list[tuple[int, int]], path: Path) -> None:
    """Decode time and KV bytes as ratios to DynamicCache in each row's environment, one panel per batch size;
    peers dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({b for _, b in grid})
    fig, axes = plt.subplots(2, len(batches), figsize=(6 * len(batches) + 3, 8), squeeze=False)
    colors = {row.label: plt.get_cmap("tab20")(i % 20) for i, row in enumerate(rows)}  # up to 20 lines apart
    for col, batch in enumerate(batches):
        lengths = [n for n, b in grid if b == batch]
        for line, key in enumerate(("decode_ms", "kv_bytes")):
            ax = axes[line][col]
            for row in rows:
                if row.label == row.baseline and row.env != "ours":
                    continue  # a peer environment's DynamicCache: 1.0 by definition, as ours
                points = []
                for n in lengths:
                    value = _medians(results.get((row.label, n, batch), []))
                    base = _medians(results.get((row.baseline, n, batch), []))
                    if value is not None and base is not None and base[key] > 0:
                        points.append((n, value[key] / base[key]))
                if points:
                    ax.plot(*zip(*points, strict=True), marker="o", ls="-" if row.env == "ours" else "--",
                            color=colors[row.label], label=row.label if (line, col) == (0, 0) else None)
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel(("decode time" if key == "decode_ms" else "KV bytes") + " / DynamicCache (same env)")
            ax.set_title(f"batch {batch}")
    fig.legend(loc="center right", fontsize=7)
    fig.tight_layout(rect=(0, 0, 1 - 3 / (6 * len(batches) + 3), 1))
    fig.savefig(path, dpi=120)


def planned(row: Row, length: int, only: set[tuple[str, int]] | None) -> bool:
    """Whether `row` runs at `length`: always without `only`, else where `only` lists (spec, length) for our caches
    (a --compare-code row as its spec) and at every length for the peers."""
    return only is None or row.env != "ours" or (row.label.partition(" @")[0], length) in only


def measure(rows: list[Row], grid: list[tuple[int, int]], repeats: int, run, unavailable: dict[str, str],
            only: set[tuple[str, int]] | None = None) -> dict:
    """{(label, length, batch): [result of each repeat]}: `run(row, length, batch)` for every row at every grid cell
    (of our caches only the (spec, length) pairs in `only` when given), then again for the next repeat (interleaved).
    A row in `unavailable` is its reason as an error, without a run; a run that failed is not repeated (the same error
    would come back)."""
    results = {(row.label, n, b): [] for row in rows for n, b in grid if planned(row, n, only)}
    started = time.time()
    for rep in range(repeats):
        for length, batch in grid:
            for row in rows:
                runs = results.get((row.label, length, batch))
                if runs is None or any("error" in r for r in runs):
                    continue
                runs.append({"error": unavailable[row.label]} if row.label in unavailable else run(row, length, batch))
                r = runs[-1]
                what = (f"failed: {r['error'][:200]}" if "error" in r else
                        f"prefill {r['prefill_s']:7.2f} s  decode {r['decode_ms']:8.1f} ms")
                print(f"[{time.time() - started:7.0f} s] repeat {rep + 1}/{repeats} {length:6d} x {batch} "
                      f"{row.label:40s} {what}", flush=True)
    return results


def peer_names(value: str | None, quick: bool, compare_code: bool) -> list[str]:
    """`--peers`: "all", "none" or a comma-separated list; unset: all, the quick pair with --quick, none with
    --compare-code (a before/after of our code)."""
    if value is None:
        value = ",".join(QUICK_PEERS) if quick else "none" if compare_code else "all"
    if value == "none":
        return []
    names = list(PEERS) if value == "all" else [name for name in value.split(",") if name]
    unknown = [name for name in names if name not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer(s) {unknown}; known: {', '.join(PEERS)} (or all, none)")
    return names


def _model_dir(model: str | None) -> Path:
    """The folder of transformers files the peers load: a directory as given, else what our loader converted."""
    if model and Path(model).is_dir():
        return Path(model)
    from hf_kvcompress.models import ensure_converted

    return ensure_converted(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1k and 4k tokens, batch 1, 2 repeats, 8 new tokens")
    parser.add_argument("--full", action="store_true", help="also batch 8 at 8k tokens (the whole 3 x 2 grid)")
    parser.add_argument("--targets", action="store_true", help="only the runs the speed targets read, at batch 1 "
                        "and 8 (--lengths and --batches narrow it), no peers unless --peers")
    parser.add_argument("--lengths", default=None, help="prompt lengths, comma-separated (default 1024,4096,8192)")
    parser.add_argument("--batches", default=None, help="batch sizes, comma-separated (default 1,8)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats per run (default 2)")
    parser.add_argument("--new-tokens", type=int, default=None, help="decode steps per run (default 16)")
    parser.add_argument("--specs", default=None, help="cache specs separated by ';' (dynamic is added; default: "
                        "the 11 caches of SPECS, or with --targets those the targets name)")
    parser.add_argument("--model", default=None, help="model alias or path (default: the embedded SmolLM2-135M)")
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help="model dtypes, comma-separated, each a table of its own (default float32,bfloat16)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per worker (0: torch's default)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="wall time or process CPU time")
    parser.add_argument("--out", default=str(RESULTS), help="folder for the table and the plot")
    parser.add_argument("--compare-code", default=None, help="also run every cache but dynamic with the package "
                        "found in this folder (e.g. `git archive COMMIT | tar -x -C DIR`), interleaved: before/after")
    parser.add_argument("--peers", default=None, help="peers: all, none or a comma-separated list of "
                        f"{', '.join(PEERS)} (default all; --quick: {','.join(QUICK_PEERS)}; --compare-code: none)")
    parser.add_argument("--quantized-venv", default=str(DEFAULT_PATHS["quantized"]),
                        help="environment of transformers' QuantizedCache backends (built there if missing)")
    parser.add_argument("--kvpress-venv", default=str(DEFAULT_PATHS["kvpress"]),
                        help="environment of kvpress (built there if missing)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.targets and (args.quick or args.full or args.specs):
        parser.error("--targets chooses its own runs: not with --quick, --full or --specs")
    quick = QUICK if args.quick else {}
    if args.targets:
        quick = dict(lengths=sorted({n for _, n in TARGET_CELLS}), batches=TARGET_BATCHES)
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else quick.get("lengths", [1024, 4096, 8192])
    batches = [int(x) for x in args.batches.split(",")] if args.batches else quick.get("batches", [1, 8])
    args.repeats = args.repeats or quick.get("repeats", 2)
    args.new_tokens = args.new_tokens or quick.get("new_tokens", 16)
    if args.worker is not None:
        dtype = args.dtypes.split(",")[0]
        print(json.dumps(worker(args.worker, lengths[0], batches[0], args.new_tokens, args.model, args.clock, dtype)))
        return
    try:
        peers = peer_names(args.peers or ("none" if args.targets else None), args.quick, bool(args.compare_code))
    except ValueError as error:
        parser.error(str(error))
    only = set(TARGET_CELLS) if args.targets else None
    chosen = sorted({spec for spec, _ in TARGET_CELLS}, key=lambda s: (s != "dynamic", s)) if args.targets else SPECS
    specs = ["dynamic"] + [s for s in (args.specs or ";".join(chosen)).split(";") if s and s != "dynamic"]
    if args.compare_code:
        code = str(Path(args.compare_code).resolve())
        specs = ["dynamic"] + [v for s in specs[1:] for v in (f"{s} @{code}", s)]
    grid = [(n, b) for b in batches for n in lengths]
    if not (args.full or args.targets or args.lengths or args.batches):  # default: batch 8 up to 4k (the cost above)
        grid = [(n, b) for n, b in grid if b == 1 or n <= 4096]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    rows = plan_rows(specs, peers)
    unavailable = {}  # label -> why it is not run (its environment or backend could not be built)
    args.peer_python = {}
    if peers:
        args.model_dir = _model_dir(args.model)
        for env in sorted({row.env for row in rows} - {"ours"}):
            print(f"preparing the {env} environment", flush=True)
            python, failed = prepare(env, Path(getattr(args, f"{env}_venv")), out / "peers-pip.log")
            args.peer_python[env] = python
            unavailable.update({(f"dynamic@{env}" if name == "dynamic" else name): why for name, why in failed.items()})
    build_kernels(rows)
    started = time.time()
    results, sections = {}, []
    for dtype in [d for d in args.dtypes.split(",") if d]:
        args.dtype = dtype
        print(f"dtype {dtype}", flush=True)
        measured = measure(rows, grid, args.repeats, lambda row, n, b: _run_worker(args, row, n, b), unavailable,
                           only)
        results.update({(dtype, *key): runs for key, runs in measured.items()})
        sections.append(f"### {dtype}\n\n" + table(measured, rows, grid) + "\n")
        plot(measured, rows, grid, out / f"bench-{stamp}-{dtype}.png")
    header = (
        f"`{' '.join(sys.argv)}`: medians of {args.repeats} interleaved repeats, {args.new_tokens} decoded tokens, "
        f"clock {args.clock}, threads {args.threads or 'default'}, {time.time() - started:.0f} s in all. Peak MiB: "
        "resident memory above the worker's level after loading the model and one warm-up forward.\n\n"
    )
    ours = [row.label for row in rows if row.env == "ours" and " @" not in row.label]
    sections.append(
        "### Speed targets (issues 29 and 30)\n\nRatios to DynamicCache in the same dtype, batch and run (decode "
        "ms/token, prefill s), the worst of its runs where a target reads several; not measured: no such run in this "
        "grid (`--targets` runs every one).\n\n" + targets_table(results, ours) + "\n")
    text = header + "\n".join(sections)
    (out / f"bench-{stamp}.md").write_text(text)
    (out / f"bench-{stamp}.json").write_text(json.dumps({"|".join(map(str, k)): v for k, v in results.items()}))
    print(text)
    print(f"wrote {out}/bench-{stamp}.md, .json and a .png per dtype")


if __name__ == "__main__":
    main()
