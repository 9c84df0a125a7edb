"""Decode attention over the paged cache, the engine's op with each backend: flex_attention's
decode kernel (the BlockMask rebuilt from the block tensors, the engine's kernel options) against
the project's Triton kernel (`paged_decode_attention_triton`), and the Triton kernel at every
split count.

Shapes as the engine runs them: a pool of 1,024 pages of 128 tokens, pages from a PageTable, one
query token per row at position `--context` - 1; E2B's two attention kinds (8 query heads, 1 KV
head; head_dim 256 with the 512-token window, head_dim 512 full) and Qwen3-4B's (32 / 8, 128).
Each output is checked against float32 SDPA over the row's visible positions, and timed inside a
CUDA graph (20 calls a replay), so launch overhead stays out, as in the engine's graphs.

    python -m scripts.benchmarks.bench_decode_attention --batch_sizes 1 8 64 128 256 --out attention.json
    python -m scripts.benchmarks.bench_decode_attention --kinds e2b_full --batch_sizes 64 256 --tiles

--tiles also times the Triton kernel at every TILE_SWEEP option (positions a loop step, warps,
stages) at the engine's split count.
"""

import argparse
import importlib.util
import json
import shlex
import sys
from pathlib import Path

if __name__ == "__main__" and importlib.util.find_spec("qwen3_flex_inference") is None:
    # NOTE: run by path, the repository root (the engine modules, scripts.*) is not on sys.path
    sys.exit(
        f"run it from the repository root ({Path(__file__).resolve().parents[2]}) as: "
        + shlex.join(["python", "-m", "scripts.benchmarks.bench_decode_attention", *sys.argv[1:]])
    )

import torch

from qwen3_flex_inference import (
    KernelOptions,
    PageTable,
    compile_settings,
    paged_decode_attention,
    paged_decode_attention_triton,
    paged_decode_splits,
)
from scripts.benchmarks.flex_kernel_options import time_ms

# (name, query heads, KV heads, head_dim, sliding window)
KINDS = [("e2b_sliding", 8, 1, 256, 512), ("e2b_full", 8, 1, 512, None), ("qwen3_4b", 32, 8, 128, None)]
PAGE_SIZE, N_PAGES = 128, 1024
# (positions a loop step, warps, pipeline stages) of the Triton kernel, at the engine's split count
TILE_SWEEP = [(n, w, s) for n in (16, 32, 64) for w in (4, 8) for s in (1, 2, 3)]


def reference(q, k_cache, v_cache, rows_BT, scale):
    """float32 SDPA of each row over its visible cache rows."""
    group = q.shape[1] // k_cache.shape[1]
    out = []
    for b, rows in enumerate(rows_BT):
        k = k_cache[0, :, rows].float().repeat_interleave(group, 0)[None]
        v = v_cache[0, :, rows].float().repeat_interleave(group, 0)[None]
        out.append(torch.nn.functional.scaled_dot_product_attention(q[b : b + 1].float(), k, v, scale=scale))
    return torch.cat(out)


def sweep(batch_sizes: list[int], context: int, device: torch.device, kinds: list[str], tiles: bool) -> list[dict]:
    """One row per attention kind, batch and backend: rel_err against SDPA and us per call."""
    results = []
    for name, H, H_kv, D, window in (kind for kind in KINDS if kind[0] in kinds):
        k_cache = torch.randn(1, H_kv, N_PAGES * PAGE_SIZE, D, device=device, dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        options = KernelOptions.pick(D, device, torch.bfloat16, PAGE_SIZE, False, None, None).decode
        for B in batch_sizes:
            table = PageTable(PAGE_SIZE, N_PAGES, B + 1, 8192, device)
            for slot in range(1, B + 1):
                table.reserve(slot, context)
            table.flush()
            input_pos_B = torch.full((B,), context - 1, device=device)
            batch_idx_B = torch.arange(1, B + 1, device=device)
            kv_num_blocks, kv_indices = table.decode_blocks(input_pos_B, batch_idx_B, window)
            q = torch.randn(B, H, 1, D, device=device, dtype=torch.bfloat16)
            scale = D**-0.5
            start = max(0, context - window) if window else 0
            rows_BT = [table.physical_slots(slot, start, context) for slot in range(1, B + 1)]
            want = reference(q, k_cache, v_cache, rows_BT, scale)
            mask_args = (kv_num_blocks, kv_indices, input_pos_B, batch_idx_B, table.physical_to_logical)

            def op(backend):
                return paged_decode_attention(
                    q, k_cache, v_cache, *mask_args, PAGE_SIZE, window, scale, options, backend
                )

            calls = {"flex": lambda: op("flex"), "triton": lambda: op("triton")}
            splits = 1
            while splits <= 16:
                calls[f"triton_splits{splits}"] = lambda s=splits: paged_decode_attention_triton(
                    q, k_cache, v_cache, kv_indices.view(B, -1), input_pos_B, PAGE_SIZE, window, scale, s
                )
                splits *= 2
            if tiles:
                splits = paged_decode_splits(B, H_kv, device)
                for block_n, num_warps, num_stages in TILE_SWEEP:
                    calls[f"triton_n{block_n}_w{num_warps}_s{num_stages}"] = (
                        lambda n=block_n, w=num_warps, st=num_stages: paged_decode_attention_triton(
                            q, k_cache, v_cache, kv_indices.view(B, -1), input_pos_B, PAGE_SIZE, window, scale,
                            splits, n, w, st,
                        )
                    )  # fmt: skip
            for backend, call in calls.items():
                try:
                    err = ((call().float() - want).norm() / want.norm()).item()
                    row = {"kind": name, "batch": B, "backend": backend, "rel_err": err, "us": 1e3 * time_ms(call)}
                except Exception as error:  # a tile config out of shared memory: report it and go on
                    row = {"kind": name, "batch": B, "backend": backend, "error": f"{type(error).__name__}"}
                if backend == "triton":
                    row["splits"] = paged_decode_splits(B, H_kv, device)
                results.append(row)
                print(json.dumps(row), flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 8, 64, 128, 256], help="decode rows")
    parser.add_argument("--context", type=int, default=384, help="visible positions of each row (before a window)")
    parser.add_argument("--kinds", nargs="+", default=[kind[0] for kind in KINDS], help="attention kinds")
    parser.add_argument("--tiles", action="store_true", help="also time the Triton kernel at every TILE_SWEEP option")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    with compile_settings():  # flex compiles per kind and batch, as the engine's op does
        results = sweep(args.batch_sizes, args.context, device, args.kinds, args.tiles)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)
    print(f"{'kind':12} {'batch':>5} {'flex us':>8} {'triton us':>9} {'best split us':>13}")
    for name in args.kinds:
        for B in args.batch_sizes:
            rows = {r["backend"]: r for r in results if r["kind"] == name and r["batch"] == B and "us" in r}
            best = min((r for k, r in rows.items() if k.startswith("triton_splits")), key=lambda r: r["us"])
            print(
                f"{name:12} {B:>5} {rows['flex']['us']:8.1f} {rows['triton']['us']:9.1f} "
                f"{best['us']:8.1f} ({best['backend']})",
                end="",
            )
            tiled = [r for k, r in rows.items() if k.startswith("triton_n")]
            if tiled:
                best_tile = min(tiled, key=lambda r: r["us"])
                print(f"   best tiles {best_tile['us']:.1f} ({best_tile['backend']})", end="")
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
