"""`make bench`: prefill time, decode speed, peak memory and KV bytes of every cache, as ratios to DynamicCache.

    python benchmarks/bench.py [--quick | --full] [--lengths 1024,4096,8192] [--batches 1,8] [--repeats 2]
                               [--new-tokens 16] [--specs "dynamic;int4;..."] [--threads N] [--clock wall|cpu]
                               [--compare-code DIR] [--out benchmarks/results]

Each (cache, prompt length, batch) run happens in a fresh worker process, so its peak memory is its own; runs are
interleaved (every cache once per repeat, then the next repeat), so machine load hits every cache alike, and each
figure is the median over repeats. Ratios compare with DynamicCache at the same length and batch in the same run.

Cost (estimates for a quiet 2-core CPU from the prefill rates measured here; every run also loads the model): the
default grid, 9 caches at 1k, 4k and 8k tokens with batch 1 and at 1k and 4k with batch 8, 2 repeats, takes about
an hour; `--full` adds batch 8 at 8k tokens (the issue's whole grid), whose prefills alone add about as much again;
`--quick` (1k and 4k tokens, batch 1, 8 new tokens) takes about ten minutes. On a shared machine use `--threads 1
--clock cpu`: the CPU time of a single-threaded worker is what other processes disturb least.

Peers: transformers' own QuantizedCache needs optimum-quanto or hqq, and kvpress pins transformers < 5.3; neither is
installed by this package, so they are not in the table (see benchmarks/NOTES.md).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

SPECS = [
    "dynamic", "int8", "int4", "int2", "fp8",
    "sink_window:sink_tokens=4,window=1020", "h2o:budget=1024,recent=128", "snapkv:budget=1024",
    "kvzip:ratio=0.25",
]
QUICK = dict(lengths=[1024, 4096], batches=[1], repeats=2, new_tokens=8)
MIB = 1 << 20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PeakSampler:
    """The largest resident set seen while active, sampled every millisecond (ru_maxrss cannot be reset)."""

    def __init__(self):
        self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss())

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def worker(spec: str, length: int, batch: int, new_tokens: int, model_name: str | None, clock: str) -> dict:
    """One prefill and `new_tokens` greedy decode steps with cache `spec`; what they cost."""
    import torch

    from hf_kvcompress import load_model, make_cache, measured_kv_bytes, use_kvcompress_attention
    from hf_kvcompress.generation import prefill, repeat_prompt_ids
    from hf_kvcompress.hf.compat import cache_kwargs
    from hf_kvcompress.registry import needs_own_prefill

    tick = time.process_time if clock == "cpu" else time.perf_counter
    model, tokenizer = load_model(model_name)
    use_kvcompress_attention(model)
    generator = torch.Generator().manual_seed(length * 31 + batch)
    ids = torch.randint(100, min(tokenizer.vocab_size, 20000), (batch, length + 1), generator=generator)
    ids = ids.to(model.device)
    repeat = repeat_prompt_ids(tokenizer) if needs_own_prefill(spec) else None
    cache = make_cache(spec, model.config)
    with torch.inference_mode():
        model(input_ids=ids[:, :16], use_cache=False)  # warm-up: the weights become resident, kernels initialise
        baseline = _rss()
        with _PeakSampler() as prefill_peak:
            start = tick()
            prefill(model, ids[:, :-1], None, cache, repeat_prompt_ids=repeat)
            prefill_s = tick() - start
        token = ids[:, -1:]
        with _PeakSampler() as decode_peak:
            start = tick()
            for _ in range(new_tokens):
                out = model(input_ids=token, use_cache=True, **cache_kwargs(cache))
                token = out.logits[:, -1:].argmax(-1)
            decode_s = tick() - start
    return {
        "prefill_s": prefill_s,
        "decode_ms": 1000 * decode_s / new_tokens,
        "prefill_peak": prefill_peak.peak - baseline,
        "decode_peak": decode_peak.peak - baseline,
        "process_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "kv_bytes": measured_kv_bytes(cache),
        "kept": cache.stored_tokens,
    }


def _run_worker(args, spec: str, length: int, batch: int) -> dict:
    spec, _, code = spec.partition(" @")
    command = [
        sys.executable, __file__, "--worker", spec, "--lengths", str(length), "--batches", str(batch),
        "--new-tokens", str(args.new_tokens), "--clock", args.clock,
    ] + (["--model", args.model] if args.model else [])
    env = dict(os.environ)
    if code:  # the package from another checkout (--compare-code), first on the path
        env["PYTHONPATH"] = os.pathsep.join([code, env.get("PYTHONPATH", "")])
    if args.threads:
        env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"worker for {spec!r} at {length} x {batch} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


COLUMNS = [  # (key, header, scale, format)
    ("prefill_s", "prefill s", 1, "{:.2f}"),
    ("decode_ms", "decode ms/token", 1, "{:.1f}"),
    ("decode_peak", "decode peak MiB", MIB, "{:.0f}"),
    ("prefill_peak", "prefill peak MiB", MIB, "{:.0f}"),
    ("kv_bytes", "KV MiB", MIB, "{:.1f}"),
]


def table(results: dict, specs: list[str], grid: list[tuple[int, int]]) -> str:
    """Markdown: each figure's median and its ratio to DynamicCache at the same length and batch."""
    head = "| tokens | batch | cache | kept | " + " | ".join(f"{h} | x dyn" for _, h, _, _ in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for length, batch in grid:
        base = {key: statistics.median(r[key] for r in results[("dynamic", length, batch)]) for key, *_ in COLUMNS}
        for spec in specs:
            runs = results[(spec, length, batch)]
            cells = [str(length), str(batch), f"`{spec}`", str(runs[-1]["kept"])]
            for key, _, scale, fmt in COLUMNS:
                value = statistics.median(r[key] for r in runs)
                ratio = value / base[key] if base[key] > 0 else float("nan")
                cells += [fmt.format(value / scale), f"{ratio:.2f}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict, specs: list[str], grid: list[tuple[int, int]], path: Path) -> None:
    """Decode time and KV bytes as ratios to DynamicCache, one panel per batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({b for _, b in grid})
    fig, axes = plt.subplots(2, len(batches), figsize=(6 * len(batches), 8), squeeze=False)
    for col, batch in enumerate(batches):
        lengths = [n for n, b in grid if b == batch]
        for row, key in enumerate(("decode_ms", "kv_bytes")):
            ax = axes[row][col]
            for spec in specs:
                ratios = []
                for n in lengths:
                    base = statistics.median(r[key] for r in results[("dynamic", n, batch)])
                    ratios.append(statistics.median(r[key] for r in results[(spec, n, batch)]) / base)
                ax.plot(lengths, ratios, marker="o", label=spec)
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel(("decode time" if key == "decode_ms" else "KV bytes") + " / DynamicCache")
            ax.set_title(f"batch {batch}")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1k and 4k tokens, batch 1, 2 repeats, 8 new tokens")
    parser.add_argument("--full", action="store_true", help="also batch 8 at 8k tokens (the whole 3 x 2 grid)")
    parser.add_argument("--lengths", default=None, help="prompt lengths, comma-separated (default 1024,4096,8192)")
    parser.add_argument("--batches", default=None, help="batch sizes, comma-separated (default 1,8)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats per run (default 2)")
    parser.add_argument("--new-tokens", type=int, default=None, help="decode steps per run (default 16)")
    parser.add_argument("--specs", default=";".join(SPECS), help="cache specs separated by ';' (dynamic is added)")
    parser.add_argument("--model", default=None, help="model alias or path (default: the embedded SmolLM2-135M)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per worker (0: torch's default)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="wall time or process CPU time")
    parser.add_argument("--out", default="benchmarks/results", help="folder for the table and the plot")
    parser.add_argument("--compare-code", default=None, help="also run every cache but dynamic with the package "
                        "found in this folder (e.g. `git archive COMMIT | tar -x -C DIR`), interleaved: before/after")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    quick = QUICK if args.quick else {}
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else quick.get("lengths", [1024, 4096, 8192])
    batches = [int(x) for x in args.batches.split(",")] if args.batches else quick.get("batches", [1, 8])
    args.repeats = args.repeats or quick.get("repeats", 2)
    args.new_tokens = args.new_tokens or quick.get("new_tokens", 16)
    if args.worker is not None:
        print(json.dumps(worker(args.worker, lengths[0], batches[0], args.new_tokens, args.model, args.clock)))
        return
    specs = ["dynamic"] + [s for s in args.specs.split(";") if s and s != "dynamic"]
    if args.compare_code:
        code = str(Path(args.compare_code).resolve())
        specs = ["dynamic"] + [v for s in specs[1:] for v in (f"{s} @{code}", s)]
    grid = [(n, b) for b in batches for n in lengths]
    if not (args.full or args.lengths or args.batches):  # the default: batch 8 up to 4k tokens (see the cost above)
        grid = [(n, b) for n, b in grid if b == 1 or n <= 4096]
    results = {(s, n, b): [] for s in specs for n, b in grid}
    started = time.time()
    for rep in range(args.repeats):
        for length, batch in grid:
            for spec in specs:
                results[(spec, length, batch)].append(_run_worker(args, spec, length, batch))
                r = results[(spec, length, batch)][-1]
                print(f"[{time.time() - started:7.0f} s] repeat {rep + 1}/{args.repeats} {length:6d} x {batch} "
                      f"{spec:40s} prefill {r['prefill_s']:7.2f} s  decode {r['decode_ms']:8.1f} ms", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    header = (
        f"`{' '.join(sys.argv)}`: medians of {args.repeats} interleaved repeats, {args.new_tokens} decoded tokens, "
        f"clock {args.clock}, threads {args.threads or 'default'}, {time.time() - started:.0f} s in all. Peak MiB: "
        "resident memory above the worker's level after loading the model and one warm-up forward.\n\n"
    )
    text = header + table(results, specs, grid) + "\n"
    (out / f"bench-{stamp}.md").write_text(text)
    (out / f"bench-{stamp}.json").write_text(json.dumps({"|".join(map(str, k)): v for k, v in results.items()}))
    plot(results, specs, grid, out / f"bench-{stamp}.png")
    print(text)
    print(f"wrote {out}/bench-{stamp}.md, .json and .png")


if __name__ == "__main__":
    main()
