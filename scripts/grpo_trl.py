"""GRPO with TRL's GRPOTrainer, its rollouts on this engine (`make_trl_rollout_func`) or on TRL's
own generation (`--backend hf`): a LoRA adapter, a toy reward, a few steps, TRL's metrics printed
one line per step.

    python -m scripts.grpo_trl                          # the tiny Qwen3 on the CPU, in seconds
    python -m scripts.grpo_trl --model_name Qwen/Qwen3-0.6B --device cuda --dtype bfloat16 --capture_cudagraph
    python -m scripts.grpo_trl --backend hf ...         # the same run on TRL's default generation
    python -m scripts.grpo_trl --model_name unsloth/gemma-4-E2B-it --load_format dummy \
        --tokenizer checkpoints/tiny/gemma4 --device cuda --compare_logprobs --out grpo_trl.json

Gemma-4 checkpoints (multimodal or text-only) run on FlexGemma4Inference, as `load_gemma4` loads them.
`--compare_logprobs` reports, at each step, TRL's sampling log-prob difference (|the trainer's
log-prob - the sampler's| over the completion tokens) for the engine's completions, and for HF
generate(do_sample=True)'s on the same prompts with its own log-probs, as TRL's default generation
samples them.
"""

import argparse
import copy
import json
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from qwen3_flex_inference import (
    FlexInference,
    FlexInferenceError,
    demo_prompts,
    load_config,
    load_qwen3_llama,
    make_trl_rollout_func,
    resolve_device_and_dtype,
)

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model_name", default=None, help="hub id or checkpoint folder (default: the tiny Qwen3)")
    p.add_argument(
        "--load_format",
        choices=["auto", "dummy"],
        default="auto",
        help="dummy: the architecture from its config with random weights (benchmarks; needs --tokenizer)",
    )
    p.add_argument("--tokenizer", default=None, help="the tokenizer's checkpoint (default: --model_name's)")
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
    p.add_argument(
        "--compare_logprobs",
        action="store_true",
        help="engine: each step, TRL's sampling log-prob difference for the engine and for HF generate",
    )
    p.add_argument("--out", default=None, help="a JSON file for the metrics of every step")
    return p


def digit_reward(completions, **kwargs) -> list[float]:
    """A toy reward: the fraction of a completion's characters that are digits (math answers)."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [len(re.findall(r"\d", text)) / max(len(text), 1) for text in texts]


def load_model(model_name: str, is_gemma: bool, dtype: torch.dtype, device: torch.device, load_format: str):
    if is_gemma:
        from gemma4_flex_inference import load_gemma4

        return load_gemma4(model_name, dtype, device, load_format=load_format)
    return load_qwen3_llama(model_name, dtype, device, load_format=load_format)


def padded(rows: list, value, side: str) -> torch.Tensor:
    from trl.trainer.utils import pad

    return pad([torch.tensor(row) for row in rows], padding_value=value, padding_side=side)


def sampling_logp_difference(trainer, prompt_ids: list, completion_ids: list, sampler_logps: list) -> torch.Tensor:
    """TRL's sampling log-prob difference: |the trainer's log-prob - the sampler's| of every completion
    token, the prompts and completions padded and scored as GRPOTrainer pads and scores them."""
    pad_id = trainer.processing_class.pad_token_id
    device = trainer.accelerator.device
    prompt_mask = padded([[1] * len(ids) for ids in prompt_ids], 0, "left")
    completion_mask = padded([[1] * len(ids) for ids in completion_ids], 0, "right").bool()
    input_ids = torch.cat([padded(prompt_ids, pad_id, "left"), padded(completion_ids, pad_id, "right")], 1)
    attention_mask = torch.cat([prompt_mask, completion_mask.long()], 1)
    with torch.no_grad():
        trainer_logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            input_ids.to(device),
            attention_mask.to(device),
            completion_mask.size(1),
            batch_size=trainer.args.per_device_train_batch_size,
        )
    sampler = padded(sampler_logps, 0.0, "right").to(device)
    return (trainer_logps.float() - sampler).abs()[completion_mask.to(device)]


def hf_generate_with_logprobs(trainer, prompt_ids: list) -> tuple[list, list]:
    """HF generate(do_sample=True) with the trainer's generation config (what TRL's default
    generation runs), and its own log-probs: log_softmax(logits / T) of each sampled token, in
    float32 from the model's logits; each completion ends at its first end id."""
    device = trainer.accelerator.device
    pad_id = trainer.processing_class.pad_token_id
    input_ids = padded(prompt_ids, pad_id, "left").to(device)
    attention_mask = padded([[1] * len(ids) for ids in prompt_ids], 0, "left").to(device)
    generation_config = copy.deepcopy(trainer.generation_config)
    generation_config.update(output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        out = trainer.model.generate(
            input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config
        )
    tokens = out.sequences[:, input_ids.size(1) :]  # (rows, steps)
    temperature = trainer.generation_config.temperature
    logps = torch.stack(
        [
            (step_logits.float() / temperature).log_softmax(-1).gather(-1, tokens[:, t : t + 1]).squeeze(-1)
            for t, step_logits in enumerate(out.logits)
        ],
        1,
    )
    end_ids = set(trainer.eos_token_ids if isinstance(trainer.eos_token_ids, list) else [trainer.eos_token_ids])
    completion_ids, completion_logps = [], []
    for row_tokens, row_logps in zip(tokens.tolist(), logps.tolist()):
        length = next((i + 1 for i, token in enumerate(row_tokens) if token in end_ids), len(row_tokens))
        completion_ids.append(row_tokens[:length])
        completion_logps.append(row_logps[:length])
    return completion_ids, completion_logps


class LogprobComparison:
    """The engine's rollout_func, recording at each call TRL's sampling log-prob difference for the
    engine's completions and for HF generate's (with its own log-probs) on the same prompts."""

    def __init__(self, rollout_func):
        self.rollout_func = rollout_func
        self.records = []

    def __call__(self, prompts: list, trainer) -> dict:
        output = self.rollout_func(prompts, trainer)
        engine = sampling_logp_difference(trainer, output["prompt_ids"], output["completion_ids"], output["logprobs"])
        hf_ids, hf_logps = hf_generate_with_logprobs(trainer, output["prompt_ids"])
        hf = sampling_logp_difference(trainer, output["prompt_ids"], hf_ids, hf_logps)
        record = {"step": trainer.state.global_step}
        for name, difference in (("engine", engine), ("hf_generate", hf)):
            record[name] = dict(mean=difference.mean().item(), max=difference.max().item(), tokens=difference.numel())
        print(
            f"sampling_logp_difference at step {record['step']}: "
            + ", ".join(
                f"{name} mean {record[name]['mean']:.3g} max {record[name]['max']:.3g}"
                for name in ("engine", "hf_generate")
            ),
            flush=True,
        )
        self.records.append(record)
        return output


def run(args) -> None:
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from scripts.make_tiny_checkpoints import ensure_tiny_checkpoints

    model_name = args.model_name or str(ensure_tiny_checkpoints() / "qwen3")
    if args.load_format == "dummy" and args.tokenizer is None:
        raise FlexInferenceError("--load_format dummy has no tokenizer: name one with --tokenizer", "tokenizer")
    if args.compare_logprobs and args.backend != "engine":
        raise FlexInferenceError("--compare_logprobs compares the engine's log-probs: use it with --backend engine")
    device, dtype = resolve_device_and_dtype(args.device, args.dtype)
    is_gemma = load_config(model_name, use_preset=args.load_format == "dummy").model_type.startswith("gemma4")
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or model_name)
    model = load_model(model_name, is_gemma, dtype, device, args.load_format)
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
            load_model(model_name, is_gemma, dtype, device, args.load_format),  # the inference copy (same seed)
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
        if args.compare_logprobs:
            rollout_func = LogprobComparison(rollout_func)
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

    logged = []

    class PrintMetrics(TrainerCallback):
        def on_log(self, _args, state, control, logs=None, **kwargs):
            logs = logs or {}
            label = "total" if "train_runtime" in logs else f"step {state.global_step}"
            metrics = " ".join(f"{key}={value:.4g}" for key, value in logs.items() if isinstance(value, float))
            print(f"{label}: {metrics}", flush=True)
            logged.append({"label": label, **logs})

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
    if args.out:
        report = dict(args=vars(args), dtype=str(dtype), device=str(device), logs=logged)
        if isinstance(rollout_func, LogprobComparison):
            report["sampling_logp_difference"] = rollout_func.records
        Path(args.out).write_text(json.dumps(report, indent=1))


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
