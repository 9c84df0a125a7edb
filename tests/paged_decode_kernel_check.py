"""Run by tests/test_paged_decode_kernel.py in a subprocess with TRITON_INTERPRET=1 (it must be set
before triton is imported): paged_decode_attention_triton on CPU tensors against an fp64
reference over the same pages, for GQA groups of 1-8 heads, head_dim 64-512 (and one that is no
power of two), sliding windows, page sizes 16 and 32, one split and several, float32 / bfloat16.

    TRITON_INTERPRET=1 python -m tests.paged_decode_kernel_check   # from the repo root

Prints one JSON list: per case its parameters and rel_err = ||out - ref|| / ||ref|| (the worst
row), or {..., "error"} where the launch raised.
"""

import json

import torch

from qwen3_flex_inference import paged_decode_attention_triton
from tests.skinny_kernel_check import interpret_bf16_as_the_gpu, interpret_without_overflow_checks

# (rows, query heads, KV heads, head_dim, page size, sliding window, dtype, splits)
CASES = [
    (4, 8, 1, 256, 32, None, torch.bfloat16, 1),
    (4, 8, 1, 256, 32, None, torch.bfloat16, 4),
    (3, 8, 1, 512, 16, None, torch.float32, 1),
    (3, 8, 1, 512, 16, None, torch.float32, 2),
    (3, 8, 1, 512, 32, None, torch.bfloat16, 2),
    (4, 8, 1, 256, 16, 40, torch.float32, 4),
    (4, 4, 2, 64, 16, 33, torch.bfloat16, 1),
    (3, 32, 8, 128, 16, None, torch.float32, 2),
    (2, 2, 2, 80, 16, None, torch.float32, 1),
]
N_PAGES = 40


def reference(q_BHD, k_cache, v_cache, logical_to_physical, input_pos_B, page_size, window, scale):
    """fp64 attention of each row's query over its visible logical positions, read through its pages."""
    B, H, D = q_BHD.shape
    group = H // k_cache.shape[1]
    out = torch.empty(B, H, D, dtype=torch.float64)
    for b in range(B):
        end = int(input_pos_B[b]) + 1
        start = max(0, end - window) if window else 0
        positions = torch.arange(start, end)
        rows = logical_to_physical[b, positions // page_size].long() * page_size + positions % page_size
        for h in range(H):
            k = k_cache[0, h // group, rows].double()
            v = v_cache[0, h // group, rows].double()
            weights = torch.softmax(k @ q_BHD[b, h].double() * scale, dim=0)
            out[b, h] = weights @ v
    return out


def main() -> None:
    interpret_bf16_as_the_gpu()
    interpret_without_overflow_checks()
    generator = torch.Generator().manual_seed(0)
    results = []
    for B, H, H_kv, D, page_size, window, dtype, splits in CASES:
        case = {"B": B, "H": H, "H_kv": H_kv, "D": D, "page_size": page_size, "window": window}
        case |= {"dtype": str(dtype).removeprefix("torch."), "splits": splits}
        k_cache = torch.randn(1, H_kv, N_PAGES * page_size, D, generator=generator).to(dtype)
        v_cache = torch.randn(1, H_kv, N_PAGES * page_size, D, generator=generator).to(dtype)
        q = torch.randn(B, H, 1, D, generator=generator).to(dtype)
        # positions: the first of a page, the last of a page, and longer rows; pages in random order
        input_pos_B = torch.tensor([0, page_size - 1, 3 * page_size, 5 * page_size + 7][:B])
        max_blocks = N_PAGES // B
        logical_to_physical = torch.randperm(N_PAGES, generator=generator)[: B * max_blocks].view(B, max_blocks)
        first_block_B = (
            (input_pos_B + 1 - window).clamp(min=0) if window else torch.zeros(B, dtype=torch.long)
        ) // page_size
        pages_BP = torch.zeros(B, max_blocks, dtype=torch.int32)
        for b in range(B):
            visible = logical_to_physical[b, first_block_B[b] :]
            pages_BP[b, : len(visible)] = visible.int()
        scale = D**-0.5
        ref = reference(q[:, :, 0], k_cache, v_cache, logical_to_physical, input_pos_B, page_size, window, scale)
        try:
            out = paged_decode_attention_triton(
                q, k_cache, v_cache, pages_BP, input_pos_B, page_size, window, scale, splits
            )
        except Exception as error:  # reported per case, so one failure does not hide the others
            results.append({**case, "error": f"{type(error).__name__}: {error}"})
            continue
        assert out.dtype == dtype and out.shape == q.shape, f"{case=} {out.dtype=} {out.shape=}"
        errors = [((out[b, :, 0].double() - ref[b]).norm() / ref[b].norm()).item() for b in range(B)]
        results.append({**case, "rel_err": max(errors)})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
