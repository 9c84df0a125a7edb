"""Rollout throughput side by side: this engine and Hugging Face generate, one workload, one GPU.

Systems: `engine_eager`, `engine_graph`, `engine_compiled_graph` and `engine_fused_compiled_graph`
(this engine: eager decode, CUDA-graph decode, a torch.compile'd decode step captured in CUDA
graphs, and that with q/k/v and gate/up fused into one GEMM each; every one with the skinny
GEMMs, `skinny_linear`, and the default decode attention), `engine_fused_compiled_graph_cublas` (the
last with cuBLAS for every GEMM), `engine_fused_compiled_graph_flex` (the fused compiled
step with flex_attention's decode kernel for every decode attention),
`hf_dynamic` (generate, dynamic cache), `hf_static_compile` (generate, static cache,
torch.compile with `--hf_compile_mode`), `hf_cb` (generate_batch continuous batching, where the
installed transformers has it; an error is recorded when it refuses the model). Workload: a
`--load_format dummy` model from a preset, bf16, batch sizes 1/8/64, prompts of `--prompt_len`
random tokens, `--new_tokens` new tokens with end ids ignored so every system does the same work.

Per system and batch: decode tok/s, ms per decode step, fraction of the roofline (bytes one step
must read / copy bandwidth measured in this run), prefill tok/s, time to first token, warm-up
(compile) time, peak memory. Writes JSON (`--out`) and prints a markdown table.

    python -m scripts.benchmarks.bench_rollouts --preset unsloth__gemma-4-E2B-it --batch_sizes 1 8 64 --out bench.json
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
        + shlex.join(["python", "-m", "scripts.benchmarks.bench_rollouts", *sys.argv[1:]])
    )

import torch

import qwen3_flex_inference as engine_module
from qwen3_flex_inference import SKINNY_CHOICES, FlexInference, SamplingParams, Sequence, peak_memory_gb
from scripts.benchmarks.profile_decode import decode_kernel_table

ROOT = Path(__file__).resolve().parents[2]

SYSTEMS = [
    "engine_eager", "engine_graph", "engine_compiled_graph", "engine_fused_compiled_graph",
    "engine_fused_compiled_graph_cublas", "engine_fused_compiled_graph_sample", "engine_fused_compiled_graph_top_p",
    "engine_fused_compiled_graph_flex",
    "hf_dynamic", "hf_static_compile", "hf_cb",
]  # fmt: skip


def copy_bandwidth_gbs(device) -> float:
    """Device-to-device copy: bytes read + bytes written per second (median of 20)."""
    if device.type != "cuda":
        return float("nan")
    src = torch.randn(512 * 2**20, device=device)  # 2 GiB of float32
    dst = torch.empty_like(src)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * 512 * 2**20 * 4 / sorted(times)[len(times) // 2] / 1e9


def build_model(preset: str, device, dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(preset)
    if path.is_dir():
        config = AutoConfig.from_pretrained(path)
        config = getattr(config, "text_config", None) or config
    else:
        config = AutoConfig.for_model(**json.loads((ROOT / "scripts/presets" / f"{preset}.json").read_text()))
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None  # end ids ignored: every system does the same work
    model.generation_config.pad_token_id = 0
    return model


def quantize_and_adapt(model, dtype, load_in_4bit: bool, lora_rank: int):
    """The model in bitsandbytes NF4 (quantised as a checkpoint is while loading), and/or wrapped
    with a random LoRA adapter of `lora_rank` on every projection (the engine takes it unmerged on
    4-bit weights, merged otherwise)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from qwen3_flex_inference import quantized_dummy

    generation_config = model.generation_config
    if load_in_4bit:
        model = quantized_dummy(model, dtype, model.device, AutoModelForCausalLM)
        model.generation_config = generation_config
    if lora_rank:
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules=targets))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=1e-3)
        model.eval()
    return model


def weight_bytes_per_step(model) -> int:
    """Bytes of weights one decode step reads: every parameter once (a tied lm_head counts once),
    and 4-bit weights' scales, except lookup tables that are only gathered (Gemma-4's per-layer-input
    table)."""
    total = 0
    for name, param in model.named_parameters():  # named_parameters yields a tied weight once
        if "embed_tokens_per_layer" in name:
            continue
        total += param.numel() * param.element_size()
        quant_state = getattr(param, "quant_state", None)
        if quant_state is not None:
            total += quant_state.absmax.numel() * quant_state.absmax.element_size()
    return total


def kv_bytes_per_step(engine, batch_size: int, prompt_len: int, new_tokens: int) -> float:
    """Average KV bytes one decode step reads: each row's context (window-capped on sliding layers)."""
    mean_context = prompt_len + new_tokens / 2
    total = 0.0
    for layer_idx, attn in enumerate(engine.runner.attention_layers()):
        cache = engine.runner.kv_caches[getattr(attn, "kv_cache_layer_idx", layer_idx)]
        window = engine.runner.sliding_windows.get(getattr(attn, "layer_type", "full_attention"))
        context = min(mean_context, window) if window else mean_context
        total += cache.bytes_per_token * context
    return total * batch_size


def make_engine(model, batch_size, prompt_len, new_tokens, **options):
    max_seq_length = -(-(prompt_len + new_tokens + 1) // 128) * 128
    if "gemma4" in model.config.model_type:
        from gemma4_flex_inference import FlexGemma4Inference as engine_class
    else:
        engine_class = FlexInference
    page_size = 128 if model.device.type == "cuda" else 16
    max_seq_length = -(-max_seq_length // page_size) * page_size
    # A pool of at least 1024 pages, as the CLI runs use: each row's pages lie scattered in it.
    n_pages = max(batch_size * (max_seq_length // page_size) + 1, 1024 if model.device.type == "cuda" else 0)
    is_peft = callable(getattr(model, "get_base_model", None))
    engine = engine_class(
        model,
        None,
        peft_model=model if is_peft else None,
        max_batch_size=batch_size,
        max_seq_length=max_seq_length,
        n_pages=n_pages,
        page_size=page_size,
        max_new_tokens=new_tokens,
        **options,
    )
    engine.end_ids = set()
    return engine


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


# The sampling systems: temperature 1 with log-probs; and with top-k and top-p on top.
SAMPLING = {
    "sample": SamplingParams(temperature=1.0, seed=0, logprobs=True),
    "top_p": SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=0, logprobs=True),
}


def run_engine(model, prompts, new_tokens, use_graph, sampling=None, **options):
    """Warm-up round (compile, capture), then a timed round. Decode/prefill split from the engine."""
    device = model.device
    engine = make_engine(model, len(prompts), len(prompts[0]), new_tokens, **options)

    def sequences():
        return [Sequence(input_ids=p, max_new_tokens=new_tokens, sampling=sampling) for p in prompts]

    raced_before = {key for key, choice in SKINNY_CHOICES.items() if "race_s" in choice and not choice.get("saved")}
    compile_s_before = torch._dynamo.utils.calculate_time_spent()
    start = time.perf_counter()
    engine.generate(sequences(), capture_cudagraph=use_graph)
    sync(device)
    warmup_s = time.perf_counter() - start
    races_s = [c["race_s"] for k, c in SKINNY_CHOICES.items() if k not in raced_before and not c.get("saved")]
    compile_s = {  # torch.compile's phases in the warm-up (dynamo's cumulative timers)
        phase: s - compile_s_before.get(phase, 0.0) for phase, s in torch._dynamo.utils.calculate_time_spent().items()
    }
    sync(device)
    start = time.perf_counter()
    generated = engine.generate(sequences(), capture_cudagraph=use_graph)
    sync(device)
    wall_s = time.perf_counter() - start
    timings = dict(engine.timings)
    num_steps = new_tokens - 1  # the first token comes from prefill
    prefill_tps_no_shortcut = float("nan")
    if getattr(
        engine.runner, "use_prefill_shortcut", False
    ):  # Gemma-4: the same prefill with every row through every layer
        engine.runner.use_prefill_shortcut = False
        engine.generate([Sequence(input_ids=p, max_new_tokens=1) for p in prompts])  # compile the longer path
        engine.generate([Sequence(input_ids=p, max_new_tokens=1) for p in prompts])
        prefill_tps_no_shortcut = engine.timings["num_prefill_tokens"] / engine.timings["prefill_s"]
        engine.runner.use_prefill_shortcut = True
    result = {
        "decode_tps": timings["num_decode_tokens"] / timings["decode_s"],
        "ms_per_step": 1e3 * timings["decode_s"] / num_steps,
        "prefill_tps": timings["num_prefill_tokens"] / timings["prefill_s"],
        "prefill_tps_no_shortcut": prefill_tps_no_shortcut,
        "ttft_s": timings["prefill_s"],
        "warmup_s": warmup_s - wall_s,
        "wall_s": wall_s,
        "tokens": sum(len(s.output_ids) for s in generated),
        "capture_s": timings.get("capture_s", float("nan")),
        "capture_s_per_graph": timings.get("capture_s_per_graph", {}),
        "skinny_races": len(races_s),  # GEMM shapes raced in the warm-up (none saved by an earlier process)
        "skinny_race_s": sum(races_s),
        "compile_s": compile_s,
    }
    return result, engine


def command_line(module: str) -> str:
    """The command that ran this benchmark, as a results file records it: the module (not the script's
    path, which names the machine's folders) and the arguments as given."""
    return shlex.join(["python", "-m", f"scripts.benchmarks.{module}", *sys.argv[1:]])


def run_hf(model, prompts, new_tokens, mode, compile_mode="reduce-overhead"):
    """HF generate: time to first token from a max_new_tokens=1 run, decode = the rest."""
    device = model.device
    input_ids = torch.tensor(prompts, device=device)
    kwargs = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(input_ids))
    if mode == "hf_static_compile":
        kwargs["cache_implementation"] = "static"
        kwargs["compile_config"] = None
        model.forward = torch.compile(
            model.forward, mode=None if compile_mode == "default" else compile_mode, fullgraph=True
        )
    try:
        start = time.perf_counter()
        model.generate(input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        sync(device)
        warmup_s = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(input_ids, max_new_tokens=1, **kwargs)
        sync(device)
        ttft_s = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        sync(device)
        wall_s = time.perf_counter() - start
    finally:
        if mode == "hf_static_compile":
            del model.forward  # back to the class method
    decode_s = wall_s - ttft_s
    num_steps = new_tokens - 1
    return {
        "decode_tps": len(prompts) * num_steps / decode_s,
        "ms_per_step": 1e3 * decode_s / num_steps,
        "prefill_tps": input_ids.numel() / ttft_s,
        "ttft_s": ttft_s,
        "warmup_s": warmup_s - wall_s,
        "wall_s": wall_s,
        "tokens": (out.shape[1] - input_ids.shape[1]) * len(prompts),
    }


def run_hf_cb(model, prompts, new_tokens):
    from transformers import GenerationConfig

    if not hasattr(model, "generate_batch"):
        return {"error": "this transformers has no generate_batch"}
    config = GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0, use_cuda_graph=False
    )
    attn_implementation = model.config._attn_implementation
    try:
        start = time.perf_counter()
        model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
        sync(model.device)
        warmup_s = time.perf_counter() - start
        start = time.perf_counter()
        outputs = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
        sync(model.device)
        wall_s = time.perf_counter() - start
    except Exception as error:  # e.g. Gemma-4: AmbiguousGlobalPerLayerAttributeError
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"}
    finally:  # generate_batch switches to "paged|..." attention and leaves it so when it fails
        if model.config._attn_implementation != attn_implementation:
            model.set_attn_implementation(attn_implementation)
    tokens = sum(len(o.generated_tokens) for o in outputs.values())
    return {
        "decode_tps": tokens / wall_s,
        "ms_per_step": float("nan"),
        "prefill_tps": float("nan"),
        "ttft_s": float("nan"),
        "warmup_s": warmup_s - wall_s,
        "wall_s": wall_s,
        "tokens": tokens,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--preset",
        default="unsloth__gemma-4-E2B-it",
        help="preset name under scripts/presets, or a local checkpoint folder",
    )
    parser.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS, help="systems to run")
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 8, 64], help="decode batch sizes")
    parser.add_argument("--prompt_len", type=int, default=128, help="prompt tokens per sequence")
    parser.add_argument("--new_tokens", type=int, default=512, help="new tokens per sequence (end ids ignored)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    parser.add_argument("--dtype", default="bfloat16", help="model dtype")
    parser.add_argument(
        "--hf_compile_mode",
        default="reduce-overhead",
        help="torch.compile mode of hf_static_compile (reduce-overhead: with CUDA graphs; default: without)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="add each engine system's GPU time per kernel class (torch.profiler)"
    )
    parser.add_argument(
        "--load_in_4bit", action="store_true", help="bitsandbytes NF4 weights, --dtype the compute dtype"
    )
    parser.add_argument("--lora_rank", type=int, default=0, help="a random LoRA adapter of this rank (0: none)")
    parser.add_argument(
        "--skinny_max_rows",
        type=int,
        default=engine_module.SKINNY_MAX_ROWS,
        help="skinny_linear races the Triton kernel up to this many rows only (0: cuBLAS; measures the row limit)",
    )
    parser.add_argument(
        "--load_compile_artifacts",
        default=None,
        help="torch.compiler.load_cache_artifacts from this file first (torch's mega-cache: compiled graphs, "
        "inductor's kernels), as a fresh machine would with what another machine saved",
    )
    parser.add_argument(
        "--save_compile_artifacts",
        default=None,
        help="torch.compiler.save_cache_artifacts to this file at the end: what this process compiled",
    )
    parser.add_argument("--out", default=None, help="write all results as JSON here")
    args = parser.parse_args()
    if not 0 <= args.skinny_max_rows <= engine_module.SKINNY_KERNEL_MAX_ROWS:
        raise SystemExit(
            f"--skinny_max_rows must be 0..{engine_module.SKINNY_KERNEL_MAX_ROWS}: got {args.skinny_max_rows}"
        )
    engine_module.SKINNY_MAX_ROWS = args.skinny_max_rows
    artifacts_loaded = None
    if args.load_compile_artifacts:
        start = time.perf_counter()
        info = torch.compiler.load_cache_artifacts(Path(args.load_compile_artifacts).read_bytes())
        artifacts_loaded = {
            "s": time.perf_counter() - start,
            "artifacts": {kind: len(keys) for kind, keys in (info.artifacts if info else {}).items()},
        }
        print(f"compile artifacts loaded: {artifacts_loaded}", flush=True)
    device = torch.device(args.device)
    bandwidth = copy_bandwidth_gbs(device)
    dtype = getattr(torch, args.dtype)
    model = quantize_and_adapt(build_model(args.preset, device, dtype), dtype, args.load_in_4bit, args.lora_rank)
    weight_bytes = weight_bytes_per_step(model)
    rows = []
    for batch_size in args.batch_sizes:
        generator = torch.Generator().manual_seed(batch_size)
        prompts = torch.randint(3, model.config.vocab_size, (batch_size, args.prompt_len), generator=generator).tolist()
        kv_bytes = None
        for system in args.systems:
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            if system.startswith("engine"):
                use_graph = system != "engine_eager"
                if use_graph and device.type != "cuda":
                    continue
                options = dict(
                    compile_decode="compiled" in system,
                    fuse_projections="fused" in system,
                    skinny_gemms="cublas" not in system,
                    decode_attention="flex" if system.endswith("_flex") else None,
                )
                sampling = next((params for name, params in SAMPLING.items() if system.endswith("_" + name)), None)
                result, engine = run_engine(model, prompts, args.new_tokens, use_graph, sampling, **options)
                # before the profile, whose one prefill of every prompt at once would set the peak
                result["peak_memory_gb"] = peak_memory_gb(device)
                if args.profile and device.type == "cuda":  # the same kernels as the graph replays
                    result["top_kernels"], result["kernel_classes"] = decode_kernel_table(
                        engine, prompts, num_steps=8, top=40
                    )
                if options["skinny_gemms"]:  # which backend each (N, K, dtype, row block) raced to
                    result["skinny_choices"] = {
                        " ".join(map(str, key)): choice["winner"] for key, choice in SKINNY_CHOICES.items()
                    }
                kv_bytes = kv_bytes_per_step(engine, batch_size, args.prompt_len, args.new_tokens)
                del engine
            elif system == "hf_cb":
                result = run_hf_cb(model, prompts, args.new_tokens)
            else:
                result = run_hf(model, prompts, args.new_tokens, system, args.hf_compile_mode)
            if kv_bytes is not None and "error" not in result:
                step_bytes = weight_bytes + kv_bytes
                result["roofline_ms"] = 1e3 * step_bytes / (bandwidth * 1e9)
                result["roofline_fraction"] = result["roofline_ms"] / result["ms_per_step"]
            result.update(system=system, batch_size=batch_size)
            result.setdefault("peak_memory_gb", peak_memory_gb(device))
            rows.append(result)
            print(json.dumps(result), flush=True)
    setup = {
        "preset": args.preset,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "dtype": args.dtype,
        "load_in_4bit": args.load_in_4bit,
        "lora_rank": args.lora_rank,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "skinny_max_rows": args.skinny_max_rows,
        "copy_bandwidth_gbs": bandwidth,
        "weight_bytes_per_step": weight_bytes,
        "command": command_line("bench_rollouts"),
        "compile_artifacts_loaded": artifacts_loaded,
    }
    if args.save_compile_artifacts:
        saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            Path(args.save_compile_artifacts).write_bytes(saved[0])
        setup["compile_artifacts_saved"] = {
            "bytes": len(saved[0]) if saved else 0,
            "artifacts": {kind: len(keys) for kind, keys in (saved[1].artifacts if saved else {}).items()},
        }
        print(f"compile artifacts saved: {setup['compile_artifacts_saved']}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"setup": setup, "rows": rows}, indent=1))
    print(f"\ncopy bandwidth {bandwidth:.0f} GB/s; weights read per step {weight_bytes / 1e9:.2f} GB\n")
    print(
        "| system | batch | decode tok/s | ms/step | roofline | prefill tok/s (no shortcut) | TTFT s | warm-up s "
        "| peak GB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['system']} | {r['batch_size']} | {r['error']} | | | | | | |")
            continue
        print(
            f"| {r['system']} | {r['batch_size']} | {r['decode_tps']:,.0f} | {r['ms_per_step']:.2f} "
            f"| {r.get('roofline_fraction', float('nan')):.0%} "
            f"| {r['prefill_tps']:,.0f} ({r.get('prefill_tps_no_shortcut', float('nan')):,.0f}) | {r['ttft_s']:.3f} "
            f"| {r['warmup_s']:.1f} | {r['peak_memory_gb']:.2f} |"
        )
    for r in rows:
        if "kernel_classes" in r:
            classes = ", ".join(
                f"{cls} {v['us_per_step'] / 1e3:.2f} ms ({v['calls_per_step']:.0f})"
                for cls, v in sorted(r["kernel_classes"].items(), key=lambda kv: -kv[1]["us_per_step"])
            )
            print(f"{r['system']} b{r['batch_size']}: GPU time per step by kernel class (kernels): {classes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
