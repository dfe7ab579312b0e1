# SPDX-License-Identifier: Apache-2.0
"""Under TRITON_INTERPRET=1 a Triton fp32 -> fp8 cast rounds like the GPU
(nearest-even, with carry) once the harness shim is installed."""

import os

import pytest
import torch

from scripts.harness.tree import applied_tree

TREE = applied_tree("base")

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "checks the Triton interpreter (TRITON_INTERPRET=1)", allow_module_level=True
    )

from vllm.triton_utils import tl, triton  # noqa: E402


@triton.jit
def _cast_kernel(src, dst, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    mask = offsets < n
    values = tl.load(src + offsets, mask=mask)
    tl.store(dst + offsets, values.to(dst.dtype.element_ty), mask=mask)


def test_casts_round_to_nearest_even_with_carry():
    values = torch.tensor(
        [31.625, 30.0, 31.0, 15.5, 0.0, -0.0, 1e-3, -448.0, 0.1015625, 3.25, 2.75],
        dtype=torch.float32,
    )
    values = torch.cat([values, torch.randn(245) * 50])
    out = torch.empty_like(values, dtype=torch.float8_e4m3fn)
    _cast_kernel[(1,)](values, out, values.numel(), BLOCK=256)
    expected = values.to(torch.float8_e4m3fn)
    assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))
    assert float(out[0].float()) == 32.0  # the carry the interpreter drops
