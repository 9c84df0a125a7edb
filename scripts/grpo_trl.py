"""GRPO with TRL's GRPOTrainer, its rollouts on this engine (`make_trl_rollout_func`) or on TRL's
own generation (`--backend hf`): a LoRA adapter, a toy reward, a few steps, TRL's metrics printed
one line per step.

    python -m scripts.grpo_trl                          # the tiny Qwen3 on the CPU, in seconds
    python -m scripts.grpo_trl --model_name Qwen/Qwen3-0.6B --device cuda --dtype bfloat16 --capture_cudagraph
    python -m scripts.grpo_trl --backend hf ...         # the same run on TRL's default generation

Gemma-4 checkpoints (multimodal or text-only) run on FlexGemma4Inference, as `load_gemma4` loads them.
"""

import argparse
import re
import sys
import tempfile
import time
import warnings

import torch

from qwen3_flex_inference import (
    FlexInference,
    FlexInferenceError,
    demo_prompts,
    load_causal_lm,
    load_config,
    make_trl_rollout_func,
    resolve_device_and_dtype,
)

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model_name", default=None, help="hub id or checkpoint folder (default: the tiny Qwen3)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto: CUDA if available")
    p.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float32"],
        default="auto",
        help="auto: bfloat16 on CUDA, float32 on CPU",
    )
    p.add_argument("--backend", choices=["engine", "hf"], default="engine", help="who generates the rollouts")
    p.add_argument("--steps", type=int, default=3, help="GRPO optimizer steps")
    p.add_argument("--num_prompts", type=int, default=2, help="prompts per step")
    p.add_argument("--num_generations", type=int, default=4, help="completions per prompt (GRPO's group size)")
    p.add_argument("--max_completion_length", type=int, default=32, help="most new tokens per completion")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (TRL's GRPOConfig)")
    p.add_argument("--learning_rate", type=float, default=1e-4, help="the adapter's learning rate")
    p.add_argument("--lora_r", type=int, default=16, help="LoRA rank (alpha = 2 * rank)")
    p.add_argument("--max_seq_length", type=int, default=1024, help="engine: longest prompt + completion")
    p.add_argument("--capture_cudagraph", action="store_true", help="engine: CUDA-graph decode (CUDA only)")
    p.add_argument("--compile_decode", action="store_true", help="engine: torch.compile the decode step")
    p.add_argument("--fuse_projections", action="store_true", help="engine: one GEMM for q/k/v and for gate/up")
    p.add_argument("--seed", type=int, default=0, help="TRL's seed (data order, adapter init)")
    return p


def digit_reward(completions, **kwargs) -> list[float]:
    """A toy reward: the fraction of a completion's characters that are digits (math answers)."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [len(re.findall(r"\d", text)) / max(len(text), 1) for text in texts]


def load_model(model_name: str, is_gemma: bool, dtype: torch.dtype, device: torch.device):
    if is_gemma:
        from gemma4_flex_inference import load_gemma4

        return load_gemma4(model_name, dtype, device)
    return load_causal_lm(model_name, dtype, device)


def run(args) -> None:
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from scripts.make_tiny_checkpoints import ensure_tiny_checkpoints

    model_name = args.model_name or str(ensure_tiny_checkpoints() / "qwen3")
    device, dtype = resolve_device_and_dtype(args.device, args.dtype)
    is_gemma = load_config(model_name).model_type.startswith("gemma4")
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_name)
    model = load_model(model_name, is_gemma, dtype, device)
    model.set_attn_implementation("sdpa")  # the trainer's forward passes (and TRL's generate) on SDPA
    lora = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    policy = get_peft_model(model, lora)  # on its device before the engine takes views of its base
    rollout_func = None
    if args.backend == "engine":
        if is_gemma:
            from gemma4_flex_inference import FlexGemma4Inference as engine_class
        else:
            engine_class = FlexInference
        engine = engine_class(
            load_model(model_name, is_gemma, dtype, device),  # the inference copy
            tokenizer,
            max_batch_size=args.num_prompts * args.num_generations,
            max_seq_length=args.max_seq_length,
            n_pages=None,
            page_size=16 if device.type == "cpu" else 128,
            peft_model=policy,
            base_model=policy,  # the trainer's frozen base is the pristine copy: nothing is copied
            compile_decode=args.compile_decode,
            fuse_projections=args.fuse_projections,
        )
        rollout_func = make_trl_rollout_func(engine, capture_cudagraph=args.capture_cudagraph)
    print(f"loaded {model_name} ({args.backend} rollouts, {dtype}, {device}) in {time.perf_counter() - start:.1f} s")

    prompts = [[{"role": "user", "content": text}] for text in demo_prompts()]
    output_dir = tempfile.TemporaryDirectory(prefix="grpo_trl_")  # TRL's; it saves nothing here (save_strategy "no")
    config = GRPOConfig(
        output_dir=output_dir.name,
        max_steps=args.steps,
        per_device_train_batch_size=args.num_prompts * args.num_generations,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        learning_rate=args.learning_rate,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=device.type == "cpu",
        bf16=dtype == torch.bfloat16,
        gradient_checkpointing=False,
        disable_tqdm=True,
        seed=args.seed,
    )

    class PrintMetrics(TrainerCallback):
        def on_log(self, _args, state, control, logs=None, **kwargs):
            logs = logs or {}
            label = "total" if "train_runtime" in logs else f"step {state.global_step}"
            metrics = " ".join(f"{key}={value:.4g}" for key, value in logs.items() if isinstance(value, float))
            print(f"{label}: {metrics}", flush=True)

    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=digit_reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        rollout_func=rollout_func,
    )
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(PrintMetrics())
    trainer.train()
    output_dir.cleanup()


def main(argv=None) -> None:
    args = build_arg_parser().parse_args(argv)
    warnings.filterwarnings("ignore", message=".*rollout_func.*experimental")  # TRL's note on rollout_func
    try:
        run(args)
    except FlexInferenceError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
