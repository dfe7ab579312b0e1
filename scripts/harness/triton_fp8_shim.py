# SPDX-License-Identifier: Apache-2.0
"""Exact float -> fp8 casts under TRITON_INTERPRET=1.

Triton's interpreter (3.7, 3.8) converts fp32 to fp8 with its own bit
arithmetic, which neither rounds to nearest-even nor carries into the
exponent (31.625 becomes 16; upstream Triton issue #8322). GPUs convert with
round-to-nearest-even, so bit-exact CPU tests of vLLM's Triton kernels route
those casts through torch, which rounds like the hardware. Other conversions
are left to the interpreter.
"""

from __future__ import annotations


def install() -> None:
    """Patch the interpreter once per process (no-op when already done)."""
    import numpy as np
    import torch
    from triton.runtime import interpreter

    fp8_types = {
        "fp8e4nv": torch.float8_e4m3fn,
        "fp8e5": torch.float8_e5m2,
        "fp8e4b8": torch.float8_e4m3fnuz,
        "fp8e5b16": torch.float8_e5m2fnuz,
    }
    input_types = {"fp32": np.float32, "fp16": np.float16}

    original = interpreter._convert_float
    if getattr(original, "_dsa_fp8_shim", False):
        return

    def convert_float(input, input_dtype, output_dtype, rounding_mode):
        target = fp8_types.get(output_dtype.name)
        source = input_types.get(input_dtype.name)
        if target is None or source is None:
            return original(input, input_dtype, output_dtype, rounding_mode)
        values = torch.from_numpy(np.ascontiguousarray(input).view(source).copy())
        fp8 = values.to(torch.float32).to(target).view(torch.uint8)
        return fp8.numpy().reshape(input.shape)

    convert_float._dsa_fp8_shim = True  # type: ignore[attr-defined]
    interpreter._convert_float = convert_float
