"""A GRPO-shaped rollout workload: this engine against Hugging Face `generate(do_sample=True)`.

Workload (defaults): 32 prompts of 256 random tokens, n = 8 completions each at temperature 1 with
log-probs, each completion's length drawn from 64..1024 (fixed seed) and end ids ignored, so both
systems do the same work. The engine runs its fastest mode (compiled step, fused projections, CUDA
graphs) through `rollouts`, once with the n completions sharing their prompt's pages and once as
256 separate sequences; it reports wall time, tok/s and the most KV pages held at once. HF runs
all 256 completions as one `generate(num_return_sequences=8)` to the longest length, as TRL's own
generation does (it cannot stop rows at different lengths), and its tok/s counts the same useful
tokens.

    python -m scripts.benchmarks.bench_grpo --out grpo.json
"""

import argparse
import importlib.util
import json
import random
import shlex
import sys
import time
from pathlib import Path

if __name__ == "__main__" and importlib.util.find_spec("qwen3_flex_inference") is None:
    # NOTE: run by path, the repository root (the engine modules, scripts.*) is not on sys.path
    sys.exit(
        f"run it from the repository root ({Path(__file__).resolve().parents[2]}) as: "
        + shlex.join(["python", "-m", "scripts.benchmarks.bench_grpo", *sys.argv[1:]])
    )

import torch

from qwen3_flex_inference import SamplingParams, Sequence, completion_groups
from scripts.benchmarks.bench_rollouts import build_model, make_engine, sync


def workload(args, vocab_size: int):
    """The prompts and each completion's length [prompt][completion], from a fixed seed."""
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, vocab_size) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
    lengths = [[rng.randint(args.min_new_tokens, args.max_new_tokens) for _ in range(args.n)] for _ in prompts]
    return prompts, lengths


def engine_sequences(prompts, lengths, params: SamplingParams, is_shared: bool) -> list[Sequence]:
    groups = completion_groups([Sequence(input_ids=p) for p in prompts], params, params.seed)
    for group, group_lengths in zip(groups, lengths):
        for seq, num_tokens in zip(group, group_lengths):
            seq.max_new_tokens = num_tokens
            if not is_shared:
                seq.shares_prompt_with = None
    return [seq for group in groups for seq in group]


def run_engine(model, prompts, lengths, args) -> dict:
    params = SamplingParams(temperature=1.0, n=args.n, seed=args.seed, logprobs=True)
    engine = make_engine(
        model, args.max_batch_size, args.prompt_len, args.max_new_tokens, compile_decode=True, fuse_projections=True
    )
    use_graph = model.device.type == "cuda"
    # Warm-up: each timed run once untimed first, so that every prefill length and decode bucket it
    # meets is compiled (and every graph captured) before the clock starts.
    for is_shared in (True, False):
        engine.generate(engine_sequences(prompts, lengths, params, is_shared), capture_cudagraph=use_graph)
    results = {}
    for is_shared in (True, False):
        most_used_pages = 0
        launch_decode = engine.runner.launch_decode

        def counted_launch_decode(rows, use_graph, previous=None):
            nonlocal most_used_pages
            used = sum(table.num_used_pages for table in engine.scheduler.page_tables.values())
            most_used_pages = max(most_used_pages, used)
            return launch_decode(rows, use_graph, previous)

        engine.runner.launch_decode = counted_launch_decode
        sequences = engine_sequences(prompts, lengths, params, is_shared)
        sync(model.device)
        start = time.perf_counter()
        engine.generate(sequences, capture_cudagraph=use_graph)
        sync(model.device)
        wall_s = time.perf_counter() - start
        engine.runner.launch_decode = launch_decode
        tokens = sum(len(seq.output_ids) for seq in sequences)
        results["shared" if is_shared else "separate"] = {
            "wall_s": wall_s,
            "tokens": tokens,
            "tok_s": tokens / wall_s,
            "most_kv_pages": most_used_pages,
            "page_size": engine.runner.page_size,
            "timings": {k: v for k, v in engine.timings.items() if isinstance(v, (int, float))},
            # where decode time goes as completions finish: steps, seconds and real rows by batch bucket
            "decode_by_bucket": engine.timings["decode_by_bucket"],
        }
        print(json.dumps({"engine": results["shared" if is_shared else "separate"]}), flush=True)
    return results


def run_hf(model, prompts, lengths, args) -> dict:
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    input_ids = torch.tensor(prompts, device=model.device)  # prompts of one length: no padding
    num_tokens = max(map(max, lengths))
    sync(model.device)
    start = time.perf_counter()
    model.generate(
        input_ids,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        num_return_sequences=args.n,
        max_new_tokens=num_tokens,
        min_new_tokens=num_tokens,
    )
    sync(model.device)
    wall_s = time.perf_counter() - start
    useful = sum(map(sum, lengths))
    return {"wall_s": wall_s, "useful_tokens": useful, "tok_s": useful / wall_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="unsloth__gemma-4-E2B-it", help="preset under scripts/presets, or a folder")
    parser.add_argument("--num_prompts", type=int, default=32, help="prompts")
    parser.add_argument("--n", type=int, default=8, help="completions per prompt")
    parser.add_argument("--prompt_len", type=int, default=256, help="prompt tokens")
    parser.add_argument("--min_new_tokens", type=int, default=64, help="shortest completion")
    parser.add_argument("--max_new_tokens", type=int, default=1024, help="longest completion")
    parser.add_argument("--max_batch_size", type=int, default=256, help="the engine's batch slots")
    parser.add_argument("--seed", type=int, default=0, help="workload and sampling seed")
    parser.add_argument("--skip_hf", action="store_true", help="run the engine only")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    parser.add_argument("--dtype", default="bfloat16", help="model dtype")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    model = build_model(args.preset, torch.device(args.device), getattr(torch, args.dtype))
    prompts, lengths = workload(args, model.config.vocab_size)
    results = {"setup": vars(args), "engine": run_engine(model, prompts, lengths, args)}
    if not args.skip_hf:
        results["hf"] = run_hf(model, prompts, lengths, args)
        print(json.dumps({"hf": results["hf"]}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    shared, separate = results["engine"]["shared"], results["engine"]["separate"]
    print(
        f"engine, shared prompt pages: {shared['wall_s']:.1f} s, {shared['tok_s']:,.0f} tok/s, "
        f"at most {shared['most_kv_pages']} KV pages; separate prompts: {separate['wall_s']:.1f} s, "
        f"{separate['tok_s']:,.0f} tok/s, at most {separate['most_kv_pages']} pages"
    )
    if "hf" in results:
        print(f"HF generate(do_sample=True, num_return_sequences={args.n}): {results['hf']['wall_s']:.1f} s, "
              f"{results['hf']['tok_s']:,.0f} useful tok/s")  # fmt: skip


if __name__ == "__main__":
    main()
