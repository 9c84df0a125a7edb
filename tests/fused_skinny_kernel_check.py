"""Run by tests/test_skinny_linear.py in a subprocess with TRITON_INTERPRET=1 (it must be set
before triton is imported): the fused skinny GEMM (skinny_matmul_triton with a SkinnyFusion) on
CPU tensors, every prologue / epilogue, with and without split-K, against the same computation in
torch ops (fused_skinny_linear_reference) in the same dtype, and against it in float64.

    TRITON_INTERPRET=1 python -m tests.fused_skinny_kernel_check   # from the repo root

Prints one JSON list: per case {"fusion", "config", "M", "N", "K", "dtype", "rel_err",
"rel_err_fp64", "ref_rel_err_fp64", "tickets_left"}, rel_err = ||out - ref|| / ||ref|| against
the reference in the same dtype, the fp64 ones the kernel's and that reference's against float64;
or {..., "error"}.
"""

import dataclasses
import itertools
import json

import torch

from qwen3_flex_inference import (
    SKINNY_CONFIGS,
    SkinnyFusion,
    _skinny_tickets,
    fused_skinny_linear_reference,
    skinny_matmul_triton,
)
from tests.skinny_kernel_check import interpret_bf16_as_the_gpu

ROWS = (1, 3, 16)
SHAPES_NK = ((40, 96), (256, 640))  # N not a multiple of BLOCK_N, and several tiles and K chunks
# the one-launch config of tiny weights, and a split-K one (the ticketed reduction)
CONFIGS = {7: SKINNY_CONFIGS[7], 5: SKINNY_CONFIGS[5]}
DTYPES = (torch.float32, torch.bfloat16)
FUSIONS = ("prologue_norm", "gelu_gated", "gelu_mul", "norm_residual", "norm_residual_scalar", "all_but_gelu")


def make_fusion(kind: str, M: int, N: int, K: int, dtype, generator) -> tuple[SkinnyFusion, int]:
    """The fusion of one kind with random tensors, and the weight's rows (2N when gated)."""

    def rand(*shape, offset=0.0):
        return (torch.randn(shape, generator=generator) + offset).to(dtype)

    fusion = SkinnyFusion(eps=1e-6)
    if kind in ("prologue_norm", "all_but_gelu"):
        fusion = dataclasses.replace(fusion, prologue_norm_weight=rand(K, offset=1.0))
    if kind == "gelu_gated":
        return dataclasses.replace(fusion, is_gated=True, prologue_norm_weight=rand(K, offset=1.0)), 2 * N
    if kind == "gelu_mul":
        # a strided view, as a layer's slice of the per-layer inputs [M, layers, N]
        fusion = dataclasses.replace(fusion, multiplier=rand(M, 3, N)[:, 1])
    if kind in ("norm_residual", "norm_residual_scalar", "all_but_gelu"):
        fusion = dataclasses.replace(fusion, post_norm_weight=rand(N, offset=1.0), residual=rand(M, N))
    if kind in ("norm_residual_scalar", "all_but_gelu"):
        fusion = dataclasses.replace(fusion, scalar=rand(1, offset=0.5))
    return fusion, N


def as_double(fusion: SkinnyFusion) -> SkinnyFusion:
    return SkinnyFusion(
        **{
            f.name: getattr(fusion, f.name).double()
            if torch.is_tensor(getattr(fusion, f.name))
            else getattr(fusion, f.name)
            for f in dataclasses.fields(fusion)
        }
    )


def main() -> None:
    interpret_bf16_as_the_gpu()
    generator = torch.Generator().manual_seed(0)
    results = []
    for kind, (idx, config), M, (N, K), dtype in itertools.product(FUSIONS, CONFIGS.items(), ROWS, SHAPES_NK, DTYPES):
        fusion, weight_rows = make_fusion(kind, M, N, K, dtype, generator)
        x_MK = torch.randn(M, K, generator=generator).to(dtype)
        w_NK = (torch.randn(weight_rows, K, generator=generator) / K**0.5).to(dtype)
        case = {"fusion": kind, "config": idx, "M": M, "N": N, "K": K, "dtype": str(dtype).removeprefix("torch.")}
        try:
            out_MN = skinny_matmul_triton(x_MK, w_NK, config, fusion)
        except Exception as error:  # reported per case, so one failure does not hide the others
            results.append({**case, "error": f"{type(error).__name__}: {error}"})
            continue
        assert out_MN.dtype == dtype and out_MN.shape == (M, N), f"{case=} {out_MN.dtype=} {out_MN.shape=}"
        ref_MN = fused_skinny_linear_reference(x_MK, w_NK, fusion).double()
        ref64_MN = fused_skinny_linear_reference(x_MK.double(), w_NK.double(), as_double(fusion))
        tickets = _skinny_tickets.get(torch.device("cpu"))
        results.append({
            **case,
            "rel_err": ((out_MN.double() - ref_MN).norm() / ref_MN.norm()).item(),
            "rel_err_fp64": ((out_MN.double() - ref64_MN).norm() / ref64_MN.norm()).item(),
            "ref_rel_err_fp64": ((ref_MN - ref64_MN).norm() / ref64_MN.norm()).item(),
            "tickets_left": 0 if tickets is None else int(tickets.count_nonzero()),
        })  # fmt: skip
    print(json.dumps(results))


if __name__ == "__main__":
    main()
