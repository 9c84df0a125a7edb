"""Run by tests/test_skinny_linear.py in a subprocess with TRITON_INTERPRET=1 (it must be set
before triton is imported): skinny_matmul_triton with every SkinnyConfig on CPU tensors, against
an fp64 reference, over row counts, shapes that are and are not multiples of the block sizes, and
float32 / bfloat16.

    TRITON_INTERPRET=1 python -m tests.skinny_kernel_check   # from the repo root

Prints one JSON list: per case {"config", "M", "N", "K", "dtype", "rel_err", "tickets_left"} with
rel_err = ||out - ref|| / ||ref|| and the split-K ticket counters not back at 0 after the launch,
or {..., "error"} where the launch raised.
"""

import dataclasses
import itertools
import json

import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter

from qwen3_flex_inference import SKINNY_CONFIGS, _skinny_tickets, skinny_matmul_triton

ROWS = (1, 2, 3, 8, 16, 40)  # 40: BLOCK_M 64, the kernel's largest row bucket (SKINNY_KERNEL_MAX_ROWS)
SHAPES_NK = ((40, 96), (40, 1536), (256, 96), (256, 1536))
DTYPES = (torch.float32, torch.bfloat16)


def interpret_bf16_as_the_gpu() -> None:
    """NOTE: triton's interpreter (3.9) holds bfloat16 as uint16 bit patterns. Its tl.dot feeds
    them to np.matmul as integers: widen bf16 operands to fp32 first (products of two bf16 values
    are exact in fp32, as in the GPU's bf16 MMA with fp32 accumulation). Its fp32 -> bf16 cast
    truncates: round to nearest even instead, as the GPU's cvt.rn.bf16.f32 (and torch) do."""
    create_dot = interpreter.InterpreterBuilder.create_dot
    cast_impl = interpreter.InterpreterBuilder.cast_impl

    def widen(handle):
        if handle.dtype.scalar != tl.bfloat16 or handle.data.dtype != np.uint16:
            return handle
        return interpreter.TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot_widened(self, a, b, *args):
        return create_dot(self, widen(a), widen(b), *args)

    def cast_rounded(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return cast_impl(self, src, dst_type)
        rounded = torch.from_numpy(np.ascontiguousarray(src.data)).bfloat16().view(torch.int16).numpy()
        return interpreter.TensorHandle(rounded.view(np.uint16), tl.bfloat16)

    interpreter.InterpreterBuilder.create_dot = create_dot_widened
    interpreter.InterpreterBuilder.cast_impl = cast_rounded


def interpret_without_overflow_checks() -> None:
    """NOTE: triton's interpreter checks every int32 add, sub and mul for overflow, a third of an
    engine run in it; the GPU build checks nothing. These checks' offsets stay far below 2**31, so
    they run without it."""
    interpreter.interpreter_builder.options = dataclasses.replace(
        interpreter.interpreter_builder.options, sanitize_overflow=False
    )


def main() -> None:
    interpret_bf16_as_the_gpu()
    interpret_without_overflow_checks()
    generator = torch.Generator().manual_seed(0)
    results = []
    for (idx, config), M, (N, K), dtype in itertools.product(enumerate(SKINNY_CONFIGS), ROWS, SHAPES_NK, DTYPES):
        x_MK = torch.randn(M, K, generator=generator).to(dtype)
        w_NK = torch.randn(N, K, generator=generator).to(dtype)
        ref_MN = x_MK.double() @ w_NK.double().T
        case = {"config": idx, "M": M, "N": N, "K": K, "dtype": str(dtype).removeprefix("torch.")}
        try:
            out_MN = skinny_matmul_triton(x_MK, w_NK, config)
        except Exception as error:  # reported per case, so one failure does not hide the others
            results.append({**case, "error": f"{type(error).__name__}: {error}"})
            continue
        assert out_MN.dtype == dtype and out_MN.shape == (M, N), f"{case=} {out_MN.dtype=} {out_MN.shape=}"
        tickets = _skinny_tickets.get(torch.device("cpu"))
        results.append({
            **case,
            "rel_err": ((out_MN.double() - ref_MN).norm() / ref_MN.norm()).item(),
            "tickets_left": 0 if tickets is None else int(tickets.count_nonzero()),
        })  # fmt: skip
    print(json.dumps(results))


if __name__ == "__main__":
    main()
