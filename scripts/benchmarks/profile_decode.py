"""Where a decode step's time goes: per-kernel GPU time of eager decode steps (torch.profiler),
and the replay time of each captured CUDA graph bucket (CUDA events).

    python scripts/benchmarks/profile_decode.py --preset unsloth__gemma-4-E2B-it --batch_sizes 1 64
"""

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from qwen3_flex_inference import FlexInference, Sequence  # noqa: E402


def build(preset: str, max_batch_size: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**json.loads((ROOT / "scripts/presets" / f"{preset}.json").read_text()))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    if "gemma" in preset:
        from gemma4_flex_inference import FlexGemma4Inference as engine_class
    else:
        engine_class = FlexInference
    engine = engine_class(model, None, max_batch_size=max_batch_size, max_seq_length=1024, n_pages=1024, page_size=128, max_new_tokens=32)
    engine.end_ids = set()
    return engine, config


def kernel_table(prof, num_steps: int, top: int = 25) -> list[dict]:
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", 0) or getattr(event, "self_cuda_time_total", 0)
        if device_us > 0 and event.device_type == torch.autograd.DeviceType.CUDA:
            rows.append({"kernel": event.key[:110], "calls_per_step": event.count / num_steps, "us_per_step": device_us / num_steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows[:top]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="unsloth__gemma-4-E2B-it", help="model preset under scripts/presets")
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 64], help="decode batch sizes to profile")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    results = {}
    for batch_size in args.batch_sizes:
        engine, config = build(args.preset, batch_size)
        prompts = [torch.randint(3, config.vocab_size, (128,)).tolist() for _ in range(batch_size)]
        engine.generate([Sequence(input_ids=p, max_new_tokens=4) for p in prompts])  # compile
        num_steps = 16
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            engine.generate([Sequence(input_ids=p, max_new_tokens=num_steps + 1) for p in prompts])
            torch.cuda.synchronize()
        table = kernel_table(prof, num_steps + 1)  # prefill is one extra "step" in the totals
        engine.capture_cuda_graphs()
        graph, _, _ = engine.cuda_graphs[batch_size]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        torch.cuda.synchronize()
        start.record()
        for _ in range(50):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        replay_ms = start.elapsed_time(end) / 50
        results[batch_size] = {"graph_replay_ms": replay_ms, "kernels": table}
        print(f"== batch {batch_size}: CUDA graph replay {replay_ms:.3f} ms/step; top kernels (eager steps, us/step):")
        for row in table:
            print(f"{row['us_per_step']:9.1f} us  {row['calls_per_step']:6.1f}x  {row['kernel']}")
        del engine
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
