"""Which flex_attention kernel options compile and run at head_dim 256 and 512, prefill and decode.

Gemma-4-E2B shape: 8 query heads, 1 KV head, bf16. Prefill: one packed row of 4096 tokens with a
causal mask. Decode, as the engine runs it: batch 1, 8 and 64 (flag), one query token per row over
a paged pool of 1024 pages of 128 tokens, each row seeing 3 pages (the rollout benchmark's mean
context of 384 tokens); the block mask lists the pages as partial blocks only (the engine's
`visible_logical_blocks`), and once with the same pages as full blocks (what flex's decode kernel
then splits: the whole pool length, not the row's pages). Each candidate is checked against SDPA
(float32 math) and timed inside a CUDA graph (20 calls a replay), so launch overhead stays out.

    python -m scripts.benchmarks.flex_kernel_options --out results.json
"""

import argparse
import json
import sys
import time

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

PREFILL_CANDIDATES = [
    {},
    {"BLOCK_M": 64, "BLOCK_N": 64},
    {"BLOCK_M": 64, "BLOCK_N": 32},
    {"BLOCK_M": 32, "BLOCK_N": 32},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 1},
    {"BLOCK_M": 64, "BLOCK_N": 32, "num_stages": 1},
    {"BLOCK_M": 32, "BLOCK_N": 32, "num_stages": 1},
    {"BLOCK_M": 128, "BLOCK_N": 32, "num_stages": 1, "num_warps": 8},
]
DECODE_CANDIDATES = [
    {},
    {"BLOCK_N": 64, "num_stages": 1},
    {"BLOCK_N": 32, "num_stages": 1},
    {"BLOCK_N": 16, "num_stages": 1},
    {"BLOCK_N": 32, "num_stages": 2},
    {"BLOCK_N": 32, "num_stages": 1, "SPLIT_KV": 4},
    {"BLOCK_N": 32, "num_stages": 1, "SPLIT_KV": 16},
    {"BLOCK_N": 32, "num_stages": 1, "SPLIT_KV": 32},
    {"BLOCK_N": 64, "num_stages": 1, "num_warps": 8, "SPLIT_KV": 8},
]


def time_ms(fn, iters=20):
    """GPU time per call: `iters` calls captured in one CUDA graph, so that Python and launch
    overhead (which dominate one small decode call timed eagerly) stay out of the number."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def reference(q, k, v, mask_dense):
    k = k.expand(-1, q.shape[1], -1, -1)
    v = v.expand(-1, q.shape[1], -1, -1)
    return torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask_dense, scale=1.0
    )


def try_options(compiled, q, k, v, block_mask, options, want):
    torch._dynamo.reset()
    try:
        start = time.perf_counter()
        out = compiled(q, k, v, block_mask=block_mask, scale=1.0, enable_gqa=True, kernel_options=options)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - start
        err = ((out.float() - want).norm() / want.norm()).item()
        ms = time_ms(
            lambda: compiled(q, k, v, block_mask=block_mask, scale=1.0, enable_gqa=True, kernel_options=options)
        )
        return {"ok": err < 2e-2, "rel_err": err, "ms": ms, "compile_s": compile_s}
    except Exception as error:  # report every failure mode, e.g. "out of resource"
        return {"ok": False, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--decode_batch_sizes", type=int, nargs="+", default=[1, 8, 64], help="decode rows to sweep")
    parser.add_argument("--skip_prefill", action="store_true", help="sweep decode only")
    args = parser.parse_args()
    torch.manual_seed(0)
    compiled = torch.compile(flex_attention, fullgraph=True)
    results = []
    for head_dim in (256, 512):
        # Prefill: [1, 8, T, D] causal.
        T = 4096
        q = torch.randn(1, 8, T, head_dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, 1, T, head_dim, device="cuda", dtype=torch.bfloat16) / head_dim**0.5
        v = torch.randn(1, 1, T, head_dim, device="cuda", dtype=torch.bfloat16)
        causal = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, T, T, device="cuda")
        dense = torch.ones(T, T, device="cuda", dtype=torch.bool).tril()
        want = reference(q, k, v, dense)
        for options in [] if args.skip_prefill else PREFILL_CANDIDATES:
            row = {
                "mode": "prefill",
                "head_dim": head_dim,
                "options": options,
                **try_options(compiled, q, k, v, causal, options, want),
            }
            results.append(row)
            print(json.dumps(row), flush=True)
        # Decode: [B, 8, 1, D] over a [1, 1, 1024 * 128, D] pool, 3 pages per row.
        page_size, n_pages, pages_per_row = 128, 1024, 3
        k = torch.randn(1, 1, n_pages * page_size, head_dim, device="cuda", dtype=torch.bfloat16) / head_dim**0.5
        v = torch.randn(1, 1, n_pages * page_size, head_dim, device="cuda", dtype=torch.bfloat16)
        for B in args.decode_batch_sizes:
            q = torch.randn(B, 8, 1, head_dim, device="cuda", dtype=torch.bfloat16)
            pages_BP = torch.randperm(n_pages - 1, device="cuda")[: B * pages_per_row].view(B, pages_per_row) + 1
            owner = torch.zeros(B, n_pages, dtype=torch.bool, device="cuda")
            owner.scatter_(1, pages_BP, True)

            def mask_mod(b, h, qi, ki):
                return owner[b, ki // page_size]

            num_blocks = torch.full((B, 1, 1), pages_per_row, dtype=torch.int32, device="cuda")
            indices = torch.zeros(B, 1, 1, n_pages, dtype=torch.int32, device="cuda")
            indices[:, 0, 0, :pages_per_row] = pages_BP.int()
            seq_lengths = (1, n_pages * page_size)
            masks = {
                "partial": BlockMask.from_kv_blocks(
                    num_blocks, indices, BLOCK_SIZE=page_size, mask_mod=mask_mod, seq_lengths=seq_lengths
                ),
                "full": BlockMask.from_kv_blocks(
                    torch.zeros_like(num_blocks),
                    indices,
                    num_blocks,
                    indices,
                    BLOCK_SIZE=page_size,
                    mask_mod=mask_mod,
                    seq_lengths=seq_lengths,
                ),
            }
            dense = owner.repeat_interleave(page_size, dim=1)[:, None, None, :]
            want = torch.cat([reference(q[b : b + 1], k, v, dense[b : b + 1]) for b in range(B)])
            for blocks, block_mask in masks.items():
                for options in DECODE_CANDIDATES if blocks == "partial" else DECODE_CANDIDATES[:3]:
                    row = {"mode": f"decode{B}_{blocks}", "head_dim": head_dim, "options": options}
                    row.update(try_options(compiled, q, k, v, block_mask, options, want))
                    results.append(row)
                    print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "results": results}, f, indent=1
            )
    print(f"{'mode':16} {'D':>4} {'ok':>3} {'ms':>8}  options / error")
    for row in results:
        print(
            f"{row['mode']:16} {row['head_dim']:>4} {str(row['ok'])[0]:>3} {row.get('ms', float('nan')):8.3f}  "
            f"{row['options']} {row.get('error', '')}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
