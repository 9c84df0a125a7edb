"""Few-row GEMMs on Gemma-4-E2B's decode weight shapes: cuBLAS against the Triton GEMV configs.

bf16; cuBLAS (F.linear) against every config of qwen3_flex_inference.SKINNY_CONFIGS, and what the
skinny_linear op's own race picks.

Each backend is timed as a CUDA graph of back-to-back calls (so launch overhead stays out; the
Triton kernels with programmatic dependent launch, as in the decode graphs) that
rotate over copies of the weight totalling at least --rotate_mb, so that L2 (50 MB on an H200)
cannot serve them: as in a decode step, where every other weight streams through between two uses
of one. Median over replays; us per call and achieved TB/s (weight bytes / time). The summary ends
with one E2B decode step's GEMM time (the per-step use counts below): cuBLAS only, the best
backend per shape, and the op's picks.

    python -m scripts.benchmarks.bench_gemv --num_rows 1 2 8 16 --out gemv.json
    python -m scripts.benchmarks.bench_gemv --num_rows 32 64 --sweep --out gemv_sweep.json

--sweep times a grid of kernel configs (SWEEP_CONFIGS, for 17-64 rows) instead of the op's own.
"""

import argparse
import dataclasses
import importlib.util
import json
import math
import shlex
import statistics
import sys
from pathlib import Path

if __name__ == "__main__" and importlib.util.find_spec("qwen3_flex_inference") is None:
    # NOTE: run by path, the repository root (the engine modules, scripts.*) is not on sys.path
    sys.exit(
        f"run it from the repository root ({Path(__file__).resolve().parents[2]}) as: "
        + shlex.join(["python", "-m", "scripts.benchmarks.bench_gemv", *sys.argv[1:]])
    )

import torch

import qwen3_flex_inference as engine

ROOT = Path(__file__).resolve().parents[2]

# name -> (N, K, uses per E2B decode step). E2B: hidden 1536; 35 layers, the last 20 KV-shared
# (q only, double-wide MLP); 8 query heads, 1 KV head, head_dim 256 (sliding) / 512 (full);
# non-shared 12 sliding + 3 full, shared 16 sliding + 4 full; per-layer embeddings (PLE) of 256 per layer.
E2B_SHAPES = {
    "qkv_sliding": (2560, 1536, 12),
    "qkv_full": (5120, 1536, 3),
    "q_shared_sliding": (2048, 1536, 16),
    "q_shared_full": (4096, 1536, 4),
    "o_sliding": (1536, 2048, 12 + 16),
    "o_full": (1536, 4096, 3 + 4),
    "gate_up": (12288, 1536, 15),
    "gate_up_double": (24576, 1536, 20),
    "down": (1536, 6144, 15),
    "down_double": (1536, 12288, 20),
    "ple_gate": (256, 1536, 35),
    "ple_proj": (1536, 256, 35),
    "per_layer_model_projection": (35 * 256, 1536, 1),
    "lm_head": (262144, 1536, 1),
}
DTYPE = torch.bfloat16
# Configs for 17-64 rows, where the x tile (BLOCK_M x BLOCK_K, from L2) is as large as the weight
# tile: wider weight tiles, split-K to keep >= ~132 programs on N = 1536, deeper pipelines.
SWEEP_CONFIGS = tuple(
    engine.SkinnyConfig(block_n, block_k, split_k, num_warps, num_stages)
    for block_n, block_k, num_warps, num_stages in (
        (64, 128, 4, 4), (128, 128, 4, 3), (128, 128, 8, 4), (128, 64, 4, 4), (256, 64, 8, 3), (64, 256, 4, 3)
    )
    for split_k in (1, 2, 4, 8, 16)
)  # fmt: skip


def graph_us_per_call(call, num_calls: int, num_replays: int) -> float:
    """call(i) for i in range(num_calls), captured in one CUDA graph: median replay time / num_calls, in us."""
    side_stream = torch.cuda.Stream()
    side_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side_stream):  # warm-up off the default stream, as torch.cuda.graph asks
        call(0)
    torch.cuda.current_stream().wait_stream(side_stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(num_calls):
            call(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times_ms = []
    for _ in range(num_replays):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times_ms.append(start.elapsed_time(end))
    return statistics.median(times_ms) * 1e3 / num_calls


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


def measure_shape(name: str, N: int, K: int, num_rows: list[int], args) -> list[dict]:
    """Rows of results for one weight shape: every M, every backend."""
    weight_bytes = N * K * DTYPE.itemsize
    num_copies = max(1, math.ceil(args.rotate_mb * 2**20 / weight_bytes))
    num_calls = max(args.min_calls, num_copies)  # every copy used once per replay at least
    # weights_CNK: [num_copies, N, K]
    weights_CNK = torch.randn(num_copies, N, K, dtype=DTYPE, device="cuda")
    rows = []
    for M in num_rows:
        x_MK = torch.randn(M, K, dtype=DTYPE, device="cuda")
        ref_MN = torch.nn.functional.linear(x_MK.float(), weights_CNK[0].float())
        backends = {"cublas": lambda w_NK: torch.nn.functional.linear(x_MK, w_NK)}
        for idx, config in enumerate(args.configs):
            backends[f"triton{idx}"] = lambda w_NK, config=config: engine.skinny_matmul_triton(x_MK, w_NK, config)
        base = {
            "shape": name,
            "N": N,
            "K": K,
            "M": M,
            "weight_MB": weight_bytes / 1e6,
            "num_copies": num_copies,
            "calls_per_graph": num_calls,
        }
        m_rows = []
        for backend, fn in backends.items():
            row = {**base, "backend": backend}
            try:
                row["rel_err_vs_fp32"] = relative_error(fn(weights_CNK[0]), ref_MN)
                if not row["rel_err_vs_fp32"] <= 2e-2:
                    raise ValueError(f"relative error {row['rel_err_vs_fp32']:.2e} against an fp32 reference")
                row["us"] = graph_us_per_call(lambda i, fn=fn: fn(weights_CNK[i % num_copies]), num_calls, args.replays)
                row["TBps"] = weight_bytes / row["us"] / 1e6
            except Exception as error:  # report every failure mode (out of resources, mismatch, capture) and go on
                row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
            m_rows.append(row)
        # The op's own race (eager back-to-back calls over weight copies), for comparison with the
        # graph numbers; above SKINNY_MAX_ROWS the op is cuBLAS.
        engine.skinny_linear(x_MK, weights_CNK[0])
        choice = engine.SKINNY_CHOICES.get((N, K, "bfloat16", engine.skinny_block_rows(M)), {"winner": "cublas"})
        winner = "cublas" if choice["winner"] == "cublas" else f"triton{choice['winner']}"
        if args.sweep and winner != "cublas":
            winner = "op's own config"  # not among the swept ones
        for row in m_rows:
            row["op_pick"] = winner
        rows += m_rows
        timed = {row["backend"]: row["us"] for row in m_rows if "us" in row}
        best = min(timed, key=timed.get) if timed else None
        print(
            f"{name:28} M={M:<2} cublas {timed.get('cublas', float('nan')):8.2f} us  "
            f"best {best} {timed.get(best, float('nan')):8.2f} us  op picks {winner}",
            flush=True,
        )
    return rows


def best_of(rows: list[dict]) -> dict | None:
    """The fastest of these result rows that ran, or None."""
    return min((row for row in rows if "us" in row), key=lambda row: row["us"], default=None)


def summarize(rows: list[dict], num_rows: list[int]) -> dict:
    """Prints the summary table; returns the E2B decode-step totals per M (us)."""
    nan = float("nan")
    print(f"\n{'shape':28} {'N':>6} {'K':>6} {'M':>2} {'MB':>6} | {'cuBLAS us':>9} {'TB/s':>5} | ", end="")
    print(f"{'best Triton':>11} {'us':>8} {'TB/s':>5} {'speedup':>7} | {'op pick':>8} {'pick us':>8}")
    measured = [name for name in E2B_SHAPES if any(row["shape"] == name for row in rows)]
    totals = {}
    for M in num_rows:
        step = {"cublas_only_us": 0.0, "best_per_shape_us": 0.0, "op_picks_us": 0.0}
        for name in measured:
            group = [row for row in rows if row["shape"] == name and row["M"] == M]
            cublas = best_of([row for row in group if row["backend"] == "cublas"])
            triton = best_of([row for row in group if row["backend"] != "cublas"])
            pick = best_of([row for row in group if row["backend"] == row["op_pick"]])
            cublas_us, triton_us, pick_us = (row["us"] if row else nan for row in (cublas, triton, pick))
            count = E2B_SHAPES[name][2]
            step["cublas_only_us"] += count * cublas_us
            step["best_per_shape_us"] += count * min(cublas_us, triton_us)
            step["op_picks_us"] += count * pick_us
            print(f"{name:28} {group[0]['N']:>6} {group[0]['K']:>6} {M:>2} {group[0]['weight_MB']:6.2f} | ", end="")
            print(
                f"{cublas_us:9.2f} {cublas['TBps'] if cublas else nan:5.2f} | "
                f"{triton['backend'] if triton else '-':>11} {triton_us:8.2f} ",
                end="",
            )
            print(
                f"{triton['TBps'] if triton else nan:5.2f} {cublas_us / triton_us:6.2f}x | "
                f"{group[0]['op_pick']:>8} {pick_us:8.2f}"
            )
        totals[M] = step
    failures = [row for row in rows if "error" in row]
    if failures:
        print(f"\n{len(failures)} failed (shape, M, backend):")
        for row in failures:
            print(f"  {row['shape']} M={row['M']} {row['backend']}: {row['error']}")
    scope = (
        "the GEMMs listed" if len(measured) == len(E2B_SHAPES) else "only the shapes measured: " + ", ".join(measured)
    )
    print(f"\nE2B decode step, {scope} ({sum(E2B_SHAPES[name][2] for name in measured)} calls):")
    print(f"{'M':>2} {'cuBLAS only us':>15} {'best per shape us':>18} {'op picks us':>12} {'best/cuBLAS':>12}")
    for M, step in totals.items():
        ratio = step["best_per_shape_us"] / step["cublas_only_us"]
        print(
            f"{M:>2} {step['cublas_only_us']:15.1f} {step['best_per_shape_us']:18.1f} "
            f"{step['op_picks_us']:12.1f} {ratio:12.3f}"
        )
    return totals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--num_rows", type=int, nargs="+", default=[1, 2, 8, 16], help="decode rows M to measure (each <= 64)"
    )
    parser.add_argument(
        "--shapes", nargs="+", default=list(E2B_SHAPES), choices=list(E2B_SHAPES), help="which E2B weight shapes"
    )
    parser.add_argument(
        "--rotate_mb",
        type=float,
        default=200.0,
        help="weight copies per shape total at least this many MiB (L2 is 50 MB)",
    )
    parser.add_argument(
        "--min_calls",
        type=int,
        default=20,
        help="calls captured per CUDA graph, at least (more where there are more copies)",
    )
    parser.add_argument(
        "--replays", type=int, default=10, help="timed graph replays per (shape, M, backend); the median counts"
    )
    parser.add_argument("--sweep", action="store_true", help="time SWEEP_CONFIGS instead of SKINNY_CONFIGS")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    args.configs = SWEEP_CONFIGS if args.sweep else engine.SKINNY_CONFIGS
    if not torch.cuda.is_available():
        raise SystemExit("bench_gemv.py needs CUDA: run it on the GPU machine (e.g. scripts/gpu_check.sh gemv).")
    if engine.triton is None:
        raise SystemExit("bench_gemv.py needs triton: use a CUDA build of torch, which brings it.")
    if not all(0 < M <= engine.SKINNY_KERNEL_MAX_ROWS for M in args.num_rows):
        raise SystemExit(f"--num_rows must each be 1..{engine.SKINNY_KERNEL_MAX_ROWS}: got {args.num_rows}")
    torch.manual_seed(0)
    properties = torch.cuda.get_device_properties(0)
    print(
        f"{properties.name}, {properties.multi_processor_count} SMs, L2 {properties.L2_cache_size / 2**20:.0f} MiB",
        end="; ",
    )
    print(f"torch {torch.__version__}, triton {engine.triton.__version__}")
    for idx, config in enumerate(args.configs):
        print(f"triton{idx}: {config}")
    rows = []
    # as in the decode graphs: programmatic dependent launch for the Triton kernels, unless
    # TORCHINDUCTOR_ENABLE_PDL=0
    with engine.programmatic_launch_settings():
        print(f"programmatic dependent launch: {engine.is_programmatic_launch_on(torch.device('cuda'))}")
        for name in args.shapes:
            N, K, _ = E2B_SHAPES[name]
            rows += measure_shape(name, N, K, args.num_rows, args)
            torch.cuda.empty_cache()  # the copies of this shape's weight are gone
    totals = summarize(rows, args.num_rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "device": properties.name, "torch": torch.__version__, "triton": engine.triton.__version__,
                    "configs": [dataclasses.asdict(config) for config in args.configs],
                    "results": rows, "step_totals_us": totals,
                    "op_choices": {",".join(map(str, key)): choice for key, choice in engine.SKINNY_CHOICES.items()},
                },
                f, indent=1,
            )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
