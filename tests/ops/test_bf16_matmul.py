"""ops.bf16_matmul: whether a device multiplies bf16 natively, measured once per process unless forced."""

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
