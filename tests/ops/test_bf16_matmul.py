"""ops.bf16_matmul: whether a device multiplies bf16 natively: read from the CPU's flags where the OS lists them, else
measured once per process, unless forced."""

import pytest
import torch

from hf_kvcompress.ops import bf16_matmul


def test_measured_once_per_process(monkeypatch):
    monkeypatch.delenv(bf16_matmul.ENV, raising=False)
    first = bf16_matmul.fast_bfloat16_matmul(torch.device("cpu"))
    assert isinstance(first, bool)
    calls = []
    monkeypatch.setattr(bf16_matmul, "_best_time", lambda a, b: calls.append(a.dtype) or 1.0)
    assert bf16_matmul.fast_bfloat16_matmul(torch.device("cpu")) is first and calls == []  # the kept answer


def test_measurement_compares_the_two_products(monkeypatch):
    monkeypatch.delenv(bf16_matmul.ENV, raising=False)
    monkeypatch.setattr(bf16_matmul, "_x86_flags", lambda: None)  # no flags to read: timed
    for bf16_seconds, fast in ((0.5, True), (0.9, False)):
        bf16_matmul._cpu_is_fast.cache_clear()
        monkeypatch.setattr(bf16_matmul, "_best_time",
                            lambda a, b, s=bf16_seconds: s if a.dtype == torch.bfloat16 else 1.0)
        assert bf16_matmul.fast_bfloat16_matmul(torch.device("cpu")) is fast
    bf16_matmul._cpu_is_fast.cache_clear()


def test_other_devices_and_the_override(monkeypatch):
    monkeypatch.delenv(bf16_matmul.ENV, raising=False)
    assert bf16_matmul.fast_bfloat16_matmul(torch.device("meta")) is False  # not a CPU: never unasked
    monkeypatch.setenv(bf16_matmul.ENV, "1")
    assert bf16_matmul.fast_bfloat16_matmul(torch.device("meta")) is True
    monkeypatch.setenv(bf16_matmul.ENV, "0")
    assert bf16_matmul.fast_bfloat16_matmul(torch.device("cpu")) is False
    monkeypatch.setenv(bf16_matmul.ENV, "yes")
    with pytest.raises(ValueError, match="HF_KVCOMPRESS_BF16_MATMUL must be '0' or '1'"):
        bf16_matmul.fast_bfloat16_matmul(torch.device("cpu"))


CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu sse2 avx2 avx512f {extra}
bugs\t\t: spectre_v1

processor\t: 1
flags\t\t: fpu sse2 avx2 avx512f {extra}
"""


def test_the_cpu_flags_answer_without_timing_where_the_os_lists_them(monkeypatch, tmp_path):
    # The same answer in every process of one machine: a timing near the threshold no longer flips what lowrank
    # stores (`compute=auto`: bf16 or float32 latents, other bytes and other answers).
    monkeypatch.delenv(bf16_matmul.ENV, raising=False)
    monkeypatch.setattr(bf16_matmul, "_best_time", lambda a, b: pytest.fail("timed where the flags answer"))
    read = bf16_matmul._x86_flags
    for extra, fast in (("avx512_bf16 avx512_vnni", True), ("amx_bf16 amx_tile", True), ("avx512_vnni", False)):
        info = tmp_path / f"cpuinfo-{fast}-{len(extra)}"
        info.write_text(CPUINFO.format(extra=extra))
        flags = read(str(info))
        assert flags is not None and "avx2" in flags and ("avx512_bf16" in flags) == ("avx512_bf16" in extra)
        monkeypatch.setattr(bf16_matmul, "_x86_flags", lambda flags=flags: flags)
        bf16_matmul._cpu_is_fast.cache_clear()
        assert bf16_matmul.fast_bfloat16_matmul(torch.device("cpu")) is fast
    bf16_matmul._cpu_is_fast.cache_clear()


def test_no_flags_list_means_no_answer_from_flags(tmp_path):
    arm = tmp_path / "cpuinfo-arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n")
    assert bf16_matmul._x86_flags(str(arm)) is None  # ARM lists "Features": timed there
    assert bf16_matmul._x86_flags(str(tmp_path / "missing")) is None
