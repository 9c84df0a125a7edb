"""Where a decode step's time goes: per-kernel GPU time of eager decode steps (torch.profiler),
by kernel class and top kernels, and the replay time of the batch's CUDA graph (CUDA events).

    python -m scripts.benchmarks.profile_decode --preset unsloth__gemma-4-E2B-it --batch_sizes 1 64
"""

import argparse
import importlib.util
import json
import shlex
import sys
import time
from pathlib import Path

if __name__ == "__main__" and importlib.util.find_spec("qwen3_flex_inference") is None:
    # NOTE: run by path, the repository root (the engine modules, scripts.*) is not on sys.path
    sys.exit(
        f"run it from the repository root ({Path(__file__).resolve().parents[2]}) as: "
        + shlex.join(["python", "-m", "scripts.benchmarks.profile_decode", *sys.argv[1:]])
    )

import torch

from qwen3_flex_inference import FlexInference, Sequence, programmatic_launch_settings

ROOT = Path(__file__).resolve().parents[2]


def build(preset: str, max_batch_size: int, **options):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**json.loads((ROOT / "scripts/presets" / f"{preset}.json").read_text()))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    if "gemma" in preset:
        from gemma4_flex_inference import FlexGemma4Inference as engine_class
    else:
        engine_class = FlexInference
    engine = engine_class(
        model,
        None,
        max_batch_size=max_batch_size,
        max_seq_length=1024,
        n_pages=1024,
        page_size=128,
        max_new_tokens=32,
        **options,
    )
    engine.end_ids = set()
    return engine, config


KERNEL_CLASSES = [  # (class, substrings of the kernel name), first match wins
    (
        "GEMM (skinny_linear, Triton)",
        ("_skinny_matmul",),
    ),  # not inductor's kernels fused around the op
    # flex_attention's kernels (and inductor's kernels fused around its mask), or the paged Triton kernel
    ("decode attention", ("flex", "triton_tem", "_paged_decode_attention_kernel", "_paged_decode_combine_kernel")),
    ("GEMM", ("gemm", "gemv", "nvjet", "cutlass", "sm90_", "splitk")),
    ("copy / cast", ("copy", "memcpy", "memset", "cat", "to_copy", "Memcpy", "Memset")),
    ("reduction", ("reduce", "triton_red", "triton_per", "softmax", "argmax")),
    ("elementwise", ("elementwise", "triton_poi", "vectorized", "unrolled")),
]


def kernel_class(name: str) -> str:
    return next((cls for cls, keys in KERNEL_CLASSES if any(k in name for k in keys)), "other")


def kernel_times(engine, prompts, new_tokens: int) -> dict[str, list[float]]:
    """GPU time (us) and calls per kernel name over one generate call."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        engine.generate([Sequence(input_ids=p, max_new_tokens=new_tokens) for p in prompts])
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", 0) or getattr(event, "self_cuda_time_total", 0)
        if device_us > 0 and event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.key] = [device_us, event.count]
    return times


# the GEMM ops a decode step dispatches (a compiled step's extern GEMMs and its skinny_linear calls)
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "flex_inference::skinny_linear")


def gemm_times(engine, prompts, new_tokens: int) -> dict[str, list[float]]:
    """Time (us: the GPU's on CUDA, else the CPU's) and calls of each GEMM op by its input shapes
    over one generate call. An op's GPU time is its kernels', so a skinny_linear row counts the
    Triton kernel or the cuBLAS mm it called, and that mm shows again in its own row."""
    is_cuda = engine.runner.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if is_cuda else [])
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        engine.generate([Sequence(input_ids=p, max_new_tokens=new_tokens) for p in prompts])
        if is_cuda:
            torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages(group_by_input_shape=True):
        if event.key in GEMM_OPS:
            us = event.device_time_total if is_cuda else event.cpu_time_total
            times[f"{event.key} {event.input_shapes}"] = [us, event.count]
    return times


def per_decode_step(engine, prompts, num_steps: int, times) -> list[dict]:
    """`times(engine, prompts, new_tokens)` of a generate of num_steps + 1 tokens minus one of 1
    token (the prefill), per decode step and largest first: rows of name, calls_per_step, us_per_step.
    Every prompt is prefilled at once, so that each of the num_steps decode steps runs the whole
    batch (with the engine's prefill budget, a large batch would start decoding while later prompts
    still prefill)."""
    scheduler = engine.scheduler
    prefill_budget = scheduler.max_prefill_tokens
    scheduler.max_prefill_tokens = max(prefill_budget, sum(len(p) for p in prompts))
    try:
        with programmatic_launch_settings():
            prefill = times(engine, prompts, 1)
            decode = times(engine, prompts, num_steps + 1)
    finally:
        scheduler.max_prefill_tokens = prefill_budget
    rows = []
    for name, (us, count) in decode.items():
        prefill_us, prefill_count = prefill.get(name, (0.0, 0))
        if count > prefill_count:
            rows.append(
                {
                    "name": name,
                    "calls_per_step": (count - prefill_count) / num_steps,
                    "us_per_step": (us - prefill_us) / num_steps,
                }
            )
    return sorted(rows, key=lambda r: -r["us_per_step"])


def decode_gemm_table(engine, prompts, num_steps: int, top: int = 40) -> list[dict]:
    """The GEMMs of a decode step by op and input shapes, in us and calls per step (`gemm_times`):
    which shape a slow kernel of `decode_kernel_table` runs. Launched as the decode graphs launch them."""
    return [
        {"gemm": row["name"], "calls_per_step": row["calls_per_step"], "us_per_step": row["us_per_step"]}
        for row in per_decode_step(engine, prompts, num_steps, gemm_times)[:top]
    ]


def decode_kernel_table(engine, prompts, num_steps: int, top: int = 25) -> tuple[list[dict], dict]:
    """The top kernels of a decode step and its GPU time per kernel class, in us per step: a
    generate of num_steps + 1 tokens minus one of 1 token (the prefill). Every prompt is prefilled
    at once, so that each of the num_steps decode steps runs the whole batch (with the engine's
    prefill budget, a large batch would start decoding while later prompts still prefill).
    Launched as the decode graphs launch them (programmatic_launch_settings): a kernel launched
    early then counts its wait for the previous one, so the classes' sum covers most of the gaps."""
    rows = [
        {"kernel": row["name"][:110], "calls_per_step": row["calls_per_step"], "us_per_step": row["us_per_step"]}
        for row in per_decode_step(engine, prompts, num_steps, kernel_times)
    ]
    classes = {}
    for row in rows:
        cls = classes.setdefault(kernel_class(row["kernel"]), {"us_per_step": 0.0, "calls_per_step": 0.0})
        cls["us_per_step"] += row["us_per_step"]
        cls["calls_per_step"] += row["calls_per_step"]
    return rows[:top], classes


def print_kernel_table(classes: dict, table: list[dict], gemms: list[dict] = ()) -> None:
    """`decode_kernel_table`'s classes (largest first), then its top kernels, then `decode_gemm_table`'s
    GEMMs by shape, in us and calls a step."""
    for cls, row in sorted(classes.items(), key=lambda item: -item[1]["us_per_step"]):
        print(f"{row['us_per_step']:9.1f} us  {row['calls_per_step']:6.1f}x  class: {cls}")
    for row in [*table, *gemms]:
        print(f"{row['us_per_step']:9.1f} us  {row['calls_per_step']:6.1f}x  {row.get('kernel') or row['gemm']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="unsloth__gemma-4-E2B-it", help="model preset under scripts/presets")
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 64], help="decode batch sizes to profile")
    parser.add_argument("--compile_decode", action="store_true", help="profile the torch.compile'd decode step")
    parser.add_argument("--fuse_projections", action="store_true", help="fuse q/k/v and gate/up into one GEMM each")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    results = {}
    for batch_size in args.batch_sizes:
        engine, config = build(
            args.preset, batch_size, compile_decode=args.compile_decode, fuse_projections=args.fuse_projections
        )
        prompts = [torch.randint(3, config.vocab_size, (128,)).tolist() for _ in range(batch_size)]
        start = time.perf_counter()
        engine.generate([Sequence(input_ids=p, max_new_tokens=4) for p in prompts])  # compile
        first_generate_s = time.perf_counter() - start
        table, classes = decode_kernel_table(engine, prompts, num_steps=16)
        start = time.perf_counter()
        bucket = next(b for b in engine.runner.buckets if b >= batch_size)
        engine.capture_cuda_graphs([bucket])
        capture_s = time.perf_counter() - start
        graph = engine.runner.cuda_graphs[bucket, "greedy"][0]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        torch.cuda.synchronize()
        start.record()
        for _ in range(50):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        replay_ms = start.elapsed_time(end) / 50
        results[batch_size] = {
            "graph_replay_ms": replay_ms,
            "first_generate_s": first_generate_s,
            "capture_s": capture_s,
            "classes": classes,
            "kernels": table,
        }
        print(
            f"== batch {batch_size}: CUDA graph replay {replay_ms:.3f} ms/step; "
            f"first generate (compiles) {first_generate_s:.1f} s, "
            f"capture {capture_s:.1f} s; top kernels (eager steps, us/step):"
        )
        print_kernel_table(classes, table)
        del engine
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
