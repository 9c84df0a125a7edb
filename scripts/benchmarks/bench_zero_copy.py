"""Where a TRL-shaped rollout's time goes, zero copy against the engine's own copy: waking the KV
pool, the engine call's adapter copy-in, prefill, decode by graph bucket, sleeping; and the GPU time
per kernel class of a compiled decode step (no graph, so each kernel shows), and its GEMMs by shape.

The policy is what `scripts/grpo_trl.py` trains: the model from its preset (random weights) with a
PEFT LoRA on every projection, in training mode. Zero copy builds the engine on it (sleep mode);
the copy builds it on a second model (the adapter merged in). Both take fused projections, the
compiled step and CUDA graphs. A rollout is what TRL asks for a step: `--num_prompts` prompts of
`--prompt_len` random tokens x `--num_generations` completions of `--max_new_tokens` tokens (end ids
ignored), temperature 1 with log-probs.

    python -m scripts.benchmarks.bench_zero_copy --lora_r 16 --out zero_copy.json
    python -m scripts.benchmarks.bench_zero_copy --model checkpoints/tiny/gemma4 --device cpu --max_new_tokens 16
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
        + shlex.join(["python", "-m", "scripts.benchmarks.bench_zero_copy", *sys.argv[1:]])
    )

import torch

from qwen3_flex_inference import SKINNY_CHOICES, FlexInference, SamplingParams, awake_while_generating, load_config
from scripts.benchmarks.profile_decode import decode_gemm_table, decode_kernel_table, print_kernel_table
from scripts.grpo_trl import LORA_TARGETS, engine_page_size, load_model


def timed(device: torch.device, call) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def engine_call(engine) -> None:
    with engine.engine_call():  # its patches in and out; zero copy copies the adapter in
        pass


def build_engine(mode: str, policy, args, device: torch.device, dtype: torch.dtype, is_gemma: bool):
    if is_gemma:
        from gemma4_flex_inference import FlexGemma4Inference as engine_class
    else:
        engine_class = FlexInference
    is_zero_copy = mode == "zero_copy"
    page_size = engine_page_size(device)
    return engine_class(
        policy if is_zero_copy else load_model(args.model, is_gemma, dtype, device, "dummy"),
        None,
        max_batch_size=args.num_prompts * args.num_generations,
        max_seq_length=-(-(args.prompt_len + args.max_new_tokens) // page_size) * page_size,
        page_size=page_size,
        peft_model=policy,
        base_model=policy,
        compile_decode=True,
        fuse_projections=True,
        enable_sleep_mode=is_zero_copy,
    )


def measure(engine, prompts: list, params: SamplingParams, args, device: torch.device) -> dict:
    """Warm-up rollouts (compile, capture), then `--repeats` timed ones, each split into its parts;
    then the compiled step's kernels and GEMMs by shape at the rollout's batch size."""
    use_graph = device.type == "cuda"
    for _ in range(2):
        with awake_while_generating(engine):
            engine.rollouts(prompts, params, capture_cudagraph=use_graph)
    runs = []
    for _ in range(args.repeats):
        run = {}
        if engine.runner.kv_memory.is_sleep_mode:
            run["wake_s"] = timed(device, engine.wake_up)
        run["engine_call_s"] = timed(device, lambda: engine_call(engine))
        run["rollouts_s"] = timed(device, lambda: engine.rollouts(prompts, params, capture_cudagraph=use_graph))
        if engine.runner.kv_memory.is_sleep_mode:
            run["sleep_s"] = timed(device, engine.sleep)
        run.update({key: engine.timings[key] for key in ("prefill_s", "decode_s", "decode_by_bucket")})
        runs.append(run)
        print(json.dumps(run), flush=True)
    rows = [prompt for prompt in prompts for _ in range(params.n)]
    with awake_while_generating(engine):
        gemms = decode_gemm_table(engine, rows, num_steps=16)
        if device.type != "cuda":
            return dict(runs=runs, kernel_classes={}, top_kernels=[], gemms=gemms)
        table, classes = decode_kernel_table(engine, rows, num_steps=16)
    return dict(runs=runs, kernel_classes=classes, top_kernels=table, gemms=gemms)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="unsloth/gemma-4-E2B-it", help="a hub id with a preset, or a checkpoint (random weights)"
    )
    parser.add_argument("--lora_r", type=int, default=16, help="LoRA rank (alpha = 2r), on every projection")
    parser.add_argument("--num_prompts", type=int, default=8)
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--prompt_len", type=int, default=64)
    parser.add_argument("--max_new_tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="timed rollouts per mode")
    parser.add_argument("--modes", nargs="+", default=["zero_copy", "copy"], choices=["zero_copy", "copy"])
    parser.add_argument(
        "--device",
        default="cuda",
        help="cuda (bf16), or cpu (float32: a smoke run, GEMMs in CPU time, no kernel table)",
    )
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    from peft import LoraConfig, get_peft_model

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    is_gemma = load_config(args.model, use_preset=True).model_type.startswith("gemma4")
    model = load_model(args.model, is_gemma, dtype, device, "dummy")
    lora = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    policy = get_peft_model(model, lora)
    policy.train()  # as TRL holds it while it generates
    torch.manual_seed(0)
    vocab_size = model.config.get_text_config().vocab_size
    prompts = [torch.randint(3, vocab_size, (args.prompt_len,)).tolist() for _ in range(args.num_prompts)]
    params = SamplingParams(
        temperature=1.0, n=args.num_generations, max_tokens=args.max_new_tokens, ignore_eos=True, logprobs=True, seed=0
    )
    results = {"args": vars(args), "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    for mode in args.modes:
        print(f"== {mode}", flush=True)
        engine = build_engine(mode, policy, args, device, dtype, is_gemma)
        results[mode] = measure(engine, prompts, params, args, device)
        print_kernel_table(results[mode]["kernel_classes"], results[mode]["top_kernels"], results[mode]["gemms"])
        if engine.runner.kv_memory.is_sleep_mode:
            engine.wake_up()  # its pool mapped again, so the engine can go
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    # every few-row GEMM shape's pick (cuBLAS or a Triton config), its race times and dropped configs
    results["skinny_choices"] = {",".join(map(str, key)): choice for key, choice in SKINNY_CHOICES.items()}
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
