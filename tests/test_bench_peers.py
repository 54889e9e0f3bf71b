"""benchmarks/harness/bench.py's peers: each ratio against its own environment's DynamicCache, failures as rows, and
the peers' worker counting the bytes a cache holds (no peer environment is built here: the workers' code runs in this
one)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

HARNESS = Path(__file__).resolve().parent.parent / "benchmarks" / "harness"
sys.path.insert(0, str(HARNESS))

import bench  # noqa: E402
import bench_peer_worker  # noqa: E402
import peer_envs  # noqa: E402
from bench import Row  # noqa: E402
from bench_measure import held_bytes  # noqa: E402


def _run(decode_ms: float, kv_bytes: int = 1 << 20) -> dict:
    return {"prefill_s": 1.0, "decode_ms": decode_ms, "decode_peak": 1 << 20, "prefill_peak": 1 << 20,
            "kv_bytes": kv_bytes, "kept": 1024}


def _cells(text: str, label: str) -> list[str]:
    line = next(line for line in text.splitlines() if f"| `{label}` |" in line)
    return [cell.strip() for cell in line.strip("|").split("|")]


DECODE_RATIO = 8  # column of "decode ms/token | x dyn"'s ratio: tokens, batch, cache, env, kept, prefill, x, decode, x


def test_a_peer_is_compared_with_dynamic_of_its_own_environment():
    rows = bench.plan_rows(["dynamic", "int4"], ["quanto-int4", "kvpress-snapkv"])
    assert [(r.label, r.env, r.baseline) for r in rows] == [
        ("dynamic", "ours", "dynamic"), ("int4", "ours", "dynamic"),
        ("dynamic@quantized", "quantized", "dynamic@quantized"), ("quanto-int4", "quantized", "dynamic@quantized"),
        ("dynamic@kvpress", "kvpress", "dynamic@kvpress"), ("kvpress-snapkv", "kvpress", "dynamic@kvpress"),
    ]
    decode = {"dynamic": 100.0, "int4": 80.0, "dynamic@quantized": 60.0, "quanto-int4": 90.0,
              "dynamic@kvpress": 200.0, "kvpress-snapkv": 100.0}
    results = {(label, 1024, 1): [_run(ms), _run(ms)] for label, ms in decode.items()}
    text = bench.table(results, rows, [(1024, 1)])
    assert _cells(text, "int4")[DECODE_RATIO] == "0.80"
    assert _cells(text, "quanto-int4")[3:5] == ["quantized", "1024"]
    assert _cells(text, "quanto-int4")[DECODE_RATIO] == "1.50"  # against our DynamicCache it would read 0.90
    assert _cells(text, "kvpress-snapkv")[DECODE_RATIO] == "0.50"  # 1.00
    assert _cells(text, "dynamic@kvpress")[DECODE_RATIO] == "1.00"


def test_a_failed_peer_is_a_row_with_its_error_and_a_failed_baseline_leaves_no_ratio():
    rows = bench.plan_rows(["dynamic"], ["quanto-int4", "transformers-fp8", "kvpress-tova"])
    results = {(row.label, 4096, 1): [_run(50.0)] for row in rows}
    results[("quanto-int4", 4096, 1)] = [{"error": "ImportError: optimum-quanto is not installed (exit 1)"}]
    results[("dynamic@kvpress", 4096, 1)] = [{"error": "environment could not be built"}]
    text = bench.table(results, rows, [(4096, 1)])
    failed = _cells(text, "quanto-int4")
    assert failed[4] == "failed [1]" and set(failed[5:]) == {"-"}
    assert "[1] `quanto-int4` (quantized): ImportError: optimum-quanto is not installed (exit 1)" in text
    assert _cells(text, "transformers-fp8")[DECODE_RATIO] == "1.00"
    assert _cells(text, "kvpress-tova")[DECODE_RATIO] == "n/a"
    assert _cells(text, "dynamic@kvpress")[4] == "failed [2]"


def test_the_bench_goes_on_past_a_failed_or_unavailable_peer_and_does_not_rerun_it(tmp_path):
    # A worker that dies with a traceback is a result that names the exception, not an exception in the bench.
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'Traceback (most recent call last):' >&2\necho 'ImportError: no quanto' >&2\n"
                    "exit 3\n")
    fake.chmod(0o755)
    args = type("Args", (), dict(peer_python={"quantized": fake}, model_dir=tmp_path, new_tokens=2, clock="cpu",
                                 threads=1))()
    assert bench._run_worker(args, Row("quanto-int4", "quantized", "dynamic@quantized"), 64, 1)["error"] == (
        "ImportError: no quanto (exit 3)")

    rows = bench.plan_rows(["dynamic"], ["hqq-int4", "kvpress-kvzip"])
    calls = []

    def run(row, length, batch):
        calls.append((row.label, length, batch))
        return {"error": "RuntimeError: batch 1 only"} if (row.label, batch) == ("kvpress-kvzip", 8) else _run(10.0)

    results = bench.measure(rows, [(1024, 1), (1024, 8)], 2, run, {"hqq-int4": "pip install hqq failed"})
    assert ("hqq-int4", 1024, 1) not in {c for c in calls}
    assert results[("hqq-int4", 1024, 1)] == [{"error": "pip install hqq failed"}]
    assert calls.count(("kvpress-kvzip", 1024, 8)) == 1 and len(results[("kvpress-kvzip", 1024, 8)]) == 1
    assert calls.count(("kvpress-kvzip", 1024, 1)) == 2 and calls.count(("dynamic@kvpress", 1024, 8)) == 2
    # interleaved: every row once at every cell before the second repeat starts
    assert calls.index(("dynamic", 1024, 1), 1) > calls.index(("kvpress-kvzip", 1024, 8))


def test_an_environment_that_cannot_be_built_takes_its_peers_and_baseline_out(monkeypatch, tmp_path):
    def no_pip(path):
        raise subprocess.CalledProcessError(1, ["pip", "install", "kvpress==0.5.5"])

    monkeypatch.setattr(peer_envs, "ensure_kvpress_venv", no_pip)
    _, failed = peer_envs.prepare("kvpress", tmp_path / "venv", tmp_path / "pip.log")
    kvpress_peers = {name for name, (env, _) in bench_peer_worker.PEERS.items() if env == "kvpress"}
    assert set(failed) == kvpress_peers | {"dynamic"} and "CalledProcessError" in failed["dynamic"]

    monkeypatch.setattr(peer_envs, "_quantized", lambda path, log: {"hqq": "pip install hqq failed"})
    _, failed = peer_envs.prepare("quantized", tmp_path / "venv", tmp_path / "pip.log")
    assert failed == {"hqq-int4": "pip install hqq failed", "hqq-int2": "pip install hqq failed"}


def test_peers_option():
    quick = bench.peer_names(None, quick=True, compare_code=False)
    assert {bench_peer_worker.PEERS[name][0] for name in quick} == {"quantized", "kvpress"}
    assert any(name.startswith("quanto") for name in quick)
    assert bench.peer_names(None, quick=False, compare_code=False) == list(bench_peer_worker.PEERS)
    assert bench.peer_names(None, quick=False, compare_code=True) == []
    assert bench.peer_names("none", quick=True, compare_code=False) == []
    assert bench.peer_names("hqq-int2,kvpress-tova", quick=False, compare_code=False) == ["hqq-int2", "kvpress-tova"]
    with pytest.raises(ValueError, match="kvpress-nope"):
        bench.peer_names("kvpress-nope", quick=False, compare_code=False)


@pytest.fixture(scope="module")
def tiny_model():
    """A random-weight Llama small enough to prefill in milliseconds: 2 layers, 2 KV heads of 16 channels."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(config).eval()


LENGTH, BATCH, NEW = 40, 2, 3
ELEMENTS = 2 * 2 * BATCH * 2 * (LENGTH + NEW) * 16  # layers x (keys, values) x batch x KV heads x tokens x channels


def _measure(model, peer: str) -> dict:
    return bench_peer_worker.run_model(model, peer, 256, LENGTH, BATCH, NEW, "cpu")


def test_peer_worker_counts_dynamic_and_fp8_bytes_as_held(tiny_model):
    from hf_kvcompress import measured_kv_bytes

    dynamic = _measure(tiny_model, "dynamic")
    assert dynamic["kv_bytes"] == 4 * ELEMENTS and dynamic["kept"] == LENGTH + NEW
    assert dynamic["decode_ms"] > 0 and dynamic["prefill_s"] > 0
    fp8 = _measure(tiny_model, "transformers-fp8")  # one byte a value, and one float32 scale per tensor and layer
    assert fp8["kv_bytes"] == ELEMENTS + 2 * 2 * 4

    # the same count as the package's own measure on a cache both can read, views counted by their whole buffer
    from transformers import DynamicCache

    cache = DynamicCache()
    buffer = torch.randn(1, 2, 100, 16)
    cache.update(buffer[:, :, :30], buffer[:, :, 30:60].clone(), 0)
    cache.layers[0].keys = buffer[:, :, :30]
    assert held_bytes(cache) == measured_kv_bytes(cache) == buffer.numel() * 4 + 30 * 32 * 4


def test_peer_worker_counts_quanto_tensors_through_their_parts(tiny_model):
    pytest.importorskip("optimum.quanto", reason="optimum-quanto is a peer's library, not installed in this venv")
    quanto = _measure(tiny_model, "quanto-int4")
    codes = ELEMENTS // 2  # 4 bits a value; the scales, shifts and the float32 residual come on top
    assert codes < quanto["kv_bytes"] < 4 * ELEMENTS // 2


def test_peer_worker_counts_hqq_tensors_and_their_scales(tiny_model):
    pytest.importorskip("hqq", reason="hqq is a peer's library, not installed in this venv")
    hqq = _measure(tiny_model, "hqq-int2")
    assert ELEMENTS // 4 < hqq["kv_bytes"] < 4 * ELEMENTS // 2


def test_the_cpu_kernel_is_built_once_per_checkout_before_any_worker_is_timed(monkeypatch, capsys):
    calls = []

    def fake_run(command, capture_output, text, env):
        calls.append((command, env.get("PYTHONPATH", "")))
        return subprocess.CompletedProcess(command, 0, stdout="True\n", stderr="")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    rows = bench.plan_rows(["dynamic", "int4 @/tmp/before", "int4", "int2 @/tmp/before"], [])
    bench.build_kernels(rows)
    assert len(calls) == 2  # our checkout and /tmp/before, each once
    assert all("cpu_decode.available()" in command[-1] for command, _ in calls)
    assert sum(path.startswith("/tmp/before") for _, path in calls) == 1  # the other checkout first on its path
    assert "CPU decode kernel of /tmp/before: built" in capsys.readouterr().out


def test_the_baseline_row_is_transformers_dynamic_cache_and_keep_all_is_ours(tiny_model):
    # Every ratio is "x DynamicCache": the baseline must be transformers' class, not this package's keep-all cache.
    from transformers import DynamicCache

    from hf_kvcompress.caches.compressed import CompressedCache

    baseline = bench.bench_cache("dynamic", tiny_model.config)
    assert type(baseline) is DynamicCache
    assert isinstance(bench.bench_cache("keep_all", tiny_model.config), CompressedCache)
    assert isinstance(bench.bench_cache("int4:group_size=16", tiny_model.config), CompressedCache)
