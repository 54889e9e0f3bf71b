"""The Triton decode kernel compiles for a GPU (Hopper, sm_90) on a machine without one.

Triton's interpreter (tests/ops/test_triton_decode.py) runs the kernel's Python and checks its numbers, but not what
the compiler checks: a loop-carried variable that changes shape, a type that differs between branches. Such a kernel
passes every CPU test and fails on the first GPU (session 26 shipped one to the GPU and saw it fail there). Triton
compiles for a named target without a device, down to the cubin, so the tests compile each variant the package
launches. In a process of its own: with TRITON_INTERPRET=1 (set for this test session on machines without a GPU)
`triton.jit` builds interpreted functions, which do not compile.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[triton]')")

COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hf_kvcompress.ops import triton_decode

kernel = triton_decode._kernel()
POINTERS = {"k_codes": "*u8", "v_codes": "*u8", "sink_slots": "*i32", "sink_k": "*bf16", "sink_v": "*bf16",
            "tail_k": "*bf16", "tail_v": "*bf16"}
FLOATS = ("q", "k_scale", "k_zero", "v_scale", "v_zero", "bias", "pq", "out_max", "out_sum", "out_acc", "out_plain")
results = {}
for variant in json.loads(sys.argv[1]):
    signature = {}
    for name in kernel.arg_names:
        signature[name] = ("constexpr" if name in variant else POINTERS.get(name)
                           or ("*fp32" if name in FLOATS else "i32"))
    constexprs = {(kernel.arg_names.index(name),): value for name, value in variant.items()}
    try:
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32))
        results[json.dumps(variant, sort_keys=True)] = "cubin" if compiled.asm.get("cubin") else "no cubin"
    except Exception as error:
        results[json.dumps(variant, sort_keys=True)] = f"{type(error).__name__}: {str(error)[-1500:]}"
print(json.dumps(results))
"""

# What the package launches: int4 (keys per channel over 32 tokens, values per token over 32 channels), int2 per
# token, int8; with and without a mask and exact sinks; the store-only form (decode_attention_partials) is the same
# kernel with no plain program in its grid, so the same variants.
BASE = dict(D=64, DV=64, BLOCK_M=16, BLOCK_T=64, BLOCK_S=16)
VARIANTS = [
    {**BASE, "K_BITS": 4, "K_TOKEN_GROUP": 32, "K_CHANNEL_GROUP": 64, "V_BITS": 4, "V_TOKEN_GROUP": 1,
     "V_CHANNEL_GROUP": 32, "HAS_BIAS": True, "HAS_SINKS": True},
    {**BASE, "K_BITS": 4, "K_TOKEN_GROUP": 32, "K_CHANNEL_GROUP": 64, "V_BITS": 4, "V_TOKEN_GROUP": 1,
     "V_CHANNEL_GROUP": 32, "HAS_BIAS": False, "HAS_SINKS": False},
    {**BASE, "K_BITS": 2, "K_TOKEN_GROUP": 1, "K_CHANNEL_GROUP": 16, "V_BITS": 2, "V_TOKEN_GROUP": 1,
     "V_CHANNEL_GROUP": 16, "HAS_BIAS": True, "HAS_SINKS": False},
    {**BASE, "D": 128, "DV": 128, "K_BITS": 8, "K_TOKEN_GROUP": 1, "K_CHANNEL_GROUP": 128, "V_BITS": 8,
     "V_TOKEN_GROUP": 1, "V_CHANNEL_GROUP": 128, "HAS_BIAS": False, "HAS_SINKS": True},
]


def test_the_decode_kernel_compiles_for_a_gpu():
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE, json.dumps(VARIANTS)], capture_output=True, text=True,
                          timeout=600, env=environment)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == len(VARIANTS)
    assert {variant: why for variant, why in results.items() if why != "cubin"} == {}
