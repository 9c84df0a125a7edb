"""GRPO with TRL's GRPOTrainer, its rollouts on this engine (`make_trl_rollout_func`) or on TRL's
own generation (`--backend hf`): a LoRA adapter, a reward, a few steps, TRL's metrics printed one
line per step, with where the step's time went (`generate_s`, the engine's `rollout_s` inside it,
`train_s`, `optimizer_s`, `step_s`; Python's garbage collection in `gc_s`) and its peak memory.

    python -m scripts.grpo_trl                          # the trained CI-size Qwen3 on the CPU
    python -m scripts.grpo_trl --model_name checkpoints/trained_gpu/gemma4 --device cuda --capture_cudagraph
    python -m scripts.grpo_trl --backend hf ...         # the same run on TRL's default generation
    python -m scripts.grpo_trl --model_name unsloth/gemma-4-E2B-it --load_format dummy \
        --tokenizer checkpoints/trained/gemma4 --device cuda --compare_logprobs --out grpo_trl.json

The task (`--task python`, for the checkpoints trained on the standard library's source,
scripts/train_checkpoints.py): each prompt is the header of a held-out function (its signature and
docstring) as a user turn; a completion earns 1 when it parses as Python (`parses_as_python`: the
model writes the whole function, within `--max_completion_length` tokens), else 0. `--task digits`
keeps the math prompts and the fraction of digits as the reward (any model).

Gemma-4 checkpoints (multimodal or text-only) run on FlexGemma4Inference, as `load_gemma4` loads them.
`--compare_logprobs` reports, at each step, TRL's sampling log-prob difference (the trainer's
log-prob - the sampler's, over the completion tokens) for the engine's completions, for HF
generate(do_sample=True)'s on the same prompts with its own log-probs, as TRL's default generation
samples them, and the trainer's own recompute noise (the engine's completions scored at two batch
sizes). `--sampler_correction` trains with TRL's importance-sampling correction on the engine's
log-probs (`sampler_corrected`).
"""

import argparse
import contextlib
import copy
import faulthandler
import gc
import importlib.util
import json
import re
import shlex
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

if __name__ == "__main__" and importlib.util.find_spec("qwen3_flex_inference") is None:
    # NOTE: run by path, the repository root (the engine modules, scripts.*) is not on sys.path
    sys.exit(
        f"run it from the repository root ({Path(__file__).resolve().parents[1]}) as: "
        + shlex.join(["python", "-m", "scripts.grpo_trl", *sys.argv[1:]])
    )

import torch
from transformers import TrainerCallback

from qwen3_flex_inference import (
    SKINNY_CHOICES,
    FlexInference,
    FlexInferenceError,
    HelpFormatter,
    check_kv_cache_budget,
    cli_message,
    demo_prompts,
    load_config,
    load_qwen3_llama,
    load_tokenizer,
    make_trl_rollout_func,
    resolve_device_and_dtype,
)
from scripts.train_checkpoints import SIZES, corpus_files, ensure_trained_checkpoints, function_chats, is_python

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--model_name", default=None, help="hub id or checkpoint folder (default: the trained CI Qwen3)")
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
    p.add_argument(
        "--task",
        choices=["python", "digits"],
        default="python",
        help="python: write the function whose header the prompt gives, 1 if it parses; digits: math prompts,"
        " the fraction of digits",
    )
    p.add_argument("--steps", type=int, default=3, help="GRPO optimizer steps")
    p.add_argument("--num_prompts", type=int, default=2, help="prompts per step")
    p.add_argument(
        "--num_generations", type=int, default=4, help="completions per prompt (GRPO's group size, at least 2)"
    )
    p.add_argument("--max_completion_length", type=int, default=64, help="most new tokens per completion")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (TRL's GRPOConfig), above 0")
    p.add_argument("--learning_rate", type=float, default=1e-4, help="the adapter's learning rate")
    p.add_argument("--lora_r", type=int, default=16, help="LoRA rank (alpha = 2 * rank)")
    p.add_argument(
        "--max_seq_length",
        type=int,
        default=1024,
        help="engine: longest prompt + completion, a multiple of the page size (16 on the CPU, 128 on CUDA)",
    )
    p.add_argument(
        "--kv_cache_gb",
        type=float,
        default=None,
        help="engine: a memory budget for the KV pool in GB (default: none, the pool sized to the device)",
    )
    p.add_argument(
        "--kv_cache_memory_fraction",
        type=float,
        default=None,
        help="engine: a memory budget for the KV pool as a share, in (0, 1], of the device's free memory when the "
        "engine is built (default: none, the pool sized to the device)",
    )
    p.add_argument("--capture_cudagraph", action="store_true", help="engine: CUDA-graph decode (CUDA only)")
    p.add_argument("--compile_decode", action="store_true", help="engine: torch.compile the decode step")
    p.add_argument("--fuse_projections", action="store_true", help="engine: one GEMM for q/k/v and for gate/up")
    p.add_argument(
        "--enable_sleep_mode",
        action="store_true",
        help="engine: hold the KV pool only while generating, given back during the trainer's passes and step",
    )
    p.add_argument(
        "--engine_weights",
        choices=["auto", "shared", "copy"],
        default="auto",
        help="engine: shared runs the trainer's own PEFT model (zero copy: no second copy of the weights, the adapter "
        "read live, or copied into the fused GEMMs at each rollout with --fuse_projections); copy loads an inference "
        "copy with the adapter merged; auto: shared, which every run of this script can take (LoRA on float weights)",
    )
    p.add_argument(
        "--profile_step",
        type=int,
        default=None,
        help="print this optimizer step's top host ops and GPU kernels (torch.profiler): tells a host stall from "
        "slower GPU work in a slow step (default: none)",
    )
    p.add_argument(
        "--trainer_cudnn_attention",
        action="store_true",
        help="let the trainer's SDPA pick cuDNN attention. Off by default: on an H100 it built a plan on the host "
        "for each new padded width, up to 5 s inside one micro batch (benchmark README, round 3's cause 2)",
    )
    p.add_argument(
        "--stall_traceback_s",
        type=float,
        default=None,
        help="print the Python stacks of any micro batch still running after this many seconds (faulthandler): a "
        "host stall shows its frame, slower GPU work the final synchronize; unlike --profile_step it does not slow "
        "the step (default: off)",
    )
    p.add_argument(
        "--micro_batch_size",
        type=int,
        default=None,
        help="completions in each of the trainer's forward and backward passes, a divisor of num_prompts x "
        "num_generations (TRL's per_device_train_batch_size, accumulated over one generation; default: all of them)",
    )
    p.add_argument(
        "--gradient_checkpointing", action="store_true", help="the trainer recomputes activations in its backward"
    )
    p.add_argument(
        "--gpu_memory_gb",
        type=float,
        default=None,
        help="a smaller card, simulated: PyTorch's allocator and a sleepable KV pool together get at most this "
        "many GB (torch.cuda.set_per_process_memory_fraction; default: none, the whole card)",
    )
    p.add_argument("--seed", type=int, default=0, help="TRL's seed (data order, adapter init), in [0, 2**32)")
    p.add_argument(
        "--compare_logprobs",
        action="store_true",
        help="engine: each step, TRL's sampling log-prob difference for the engine and for HF generate",
    )
    p.add_argument(
        "--sampler_correction",
        action="store_true",
        help="engine: TRL's importance-sampling correction on the engine's log-probs (sampler_corrected)",
    )
    p.add_argument("--stdlib", type=Path, default=None, help="python task: the corpus's root (default: this Python's)")
    p.add_argument("--out", default=None, help="a JSON file for the metrics of every step (default: none)")
    return p


# The flags that only the engine's rollouts use; --backend hf refuses them rather than ignore them.
ENGINE_ONLY_FLAGS = (
    "kv_cache_gb",
    "kv_cache_memory_fraction",
    "capture_cudagraph",
    "compile_decode",
    "fuse_projections",
    "enable_sleep_mode",
    "compare_logprobs",
    "sampler_correction",
)


def without_engine_flags(argv: list[str]) -> list[str]:
    """A grpo_trl command line less the flags that only the engine's rollouts use, and their values:
    the same run for `--backend hf`."""
    parser = build_arg_parser()
    engine_only = {"--" + flag for flag in (*ENGINE_ONLY_FLAGS, "engine_weights")}
    kept, i = [], 0
    while i < len(argv):
        flag, has_value_inline = argv[i].split("=", 1)[0], "=" in argv[i]
        if flag not in engine_only:
            kept.append(argv[i])
            i += 1
            continue
        is_switch = isinstance(parser.get_default(flag.removeprefix("--")), bool)  # store_true: no value
        i += 1 if is_switch or has_value_inline else 2
    return kept


def check_args(args) -> None:
    """Flag values and combinations the script refuses, each in one sentence, before anything is loaded."""
    least = dict(steps=1, num_prompts=1, num_generations=2, max_completion_length=1, lora_r=1, max_seq_length=1)
    for flag, value in least.items():
        if getattr(args, flag) < value:
            why = " (GRPO's advantages compare the completions of one prompt)" if flag == "num_generations" else ""
            raise FlexInferenceError(f"--{flag} must be at least {value}{why}, got {getattr(args, flag)}")
    for flag in ("learning_rate", "temperature"):
        if not getattr(args, flag) > 0:  # NaN too
            raise FlexInferenceError(f"--{flag} must be greater than 0, got {getattr(args, flag)}")
    if not 0 <= args.seed < 2**32:  # numpy's seed range (transformers' set_seed)
        raise FlexInferenceError(f"--seed must be in [0, 2**32), got {args.seed}")
    if args.profile_step is not None and not 1 <= args.profile_step <= args.steps:
        raise FlexInferenceError(
            f"--profile_step must be a step in [1, --steps = {args.steps}], got {args.profile_step}"
        )
    if args.stall_traceback_s is not None and not args.stall_traceback_s > 0:
        raise FlexInferenceError(f"--stall_traceback_s must be greater than 0, got {args.stall_traceback_s}")
    if args.load_format == "dummy" and args.tokenizer is None:
        raise FlexInferenceError("--load_format dummy has no tokenizer: name one with --tokenizer")
    if args.stdlib is not None and not args.stdlib.is_dir():
        raise FlexInferenceError(f"--stdlib {args.stdlib} is not a folder: name the standard library's root")
    if args.out is not None and (Path(args.out).is_dir() or not Path(args.out).parent.is_dir()):
        raise FlexInferenceError(f"--out {args.out} is not a file in an existing folder: name one")
    check_kv_cache_budget(None, args.kv_cache_gb, args.kv_cache_memory_fraction)
    device, _ = resolve_device_and_dtype(args.device, args.dtype)
    batch = args.num_prompts * args.num_generations
    if args.micro_batch_size is not None and not (0 < args.micro_batch_size and batch % args.micro_batch_size == 0):
        raise FlexInferenceError(
            f"--micro_batch_size must divide num_prompts x num_generations ({batch}), got {args.micro_batch_size}"
        )
    if args.gpu_memory_gb is not None:
        if device.type != "cuda":
            raise FlexInferenceError("--gpu_memory_gb simulates a smaller CUDA card: it needs a CUDA device")
        total_gb = torch.cuda.get_device_properties(device).total_memory / 1e9
        if not 0 < args.gpu_memory_gb <= total_gb:
            raise FlexInferenceError(
                f"--gpu_memory_gb must be in (0, {total_gb:.4g}] on this card, got {args.gpu_memory_gb}"
            )
    if args.backend == "hf":
        for flag in ENGINE_ONLY_FLAGS:
            if getattr(args, flag):
                raise FlexInferenceError(f"--{flag} acts on the engine's rollouts: use it with --backend engine")
        if args.engine_weights != "auto":
            raise FlexInferenceError("--engine_weights acts on the engine's rollouts: use it with --backend engine")
        return
    if args.capture_cudagraph and device.type != "cuda":
        raise FlexInferenceError("--capture_cudagraph needs a CUDA device")
    if args.max_seq_length % engine_page_size(device):
        raise FlexInferenceError(
            f"--max_seq_length ({args.max_seq_length}) must be a multiple of the engine's page size on "
            f"{device.type} ({engine_page_size(device)})"
        )
    if args.max_completion_length >= args.max_seq_length:
        raise FlexInferenceError(
            f"--max_completion_length ({args.max_completion_length}) leaves no room for a prompt in "
            f"--max_seq_length ({args.max_seq_length}): raise --max_seq_length"
        )


def engine_page_size(device: torch.device) -> int:
    """The engine's KV page size: 16 tokens on the CPU, 128 on CUDA."""
    return 16 if device.type == "cpu" else 128


def task_prompts_and_reward(task: str, stdlib: Path | None) -> tuple[list[list[dict]], Callable]:
    """The task's prompts (chats of one user turn) and its reward function."""
    if task == "python":
        return python_prompts(stdlib), parses_as_python
    return [[{"role": "user", "content": text}] for text in demo_prompts()], digit_reward


def completion_texts(completions) -> list[str]:
    return [c if isinstance(c, str) else c[-1]["content"] for c in completions]


def digit_reward(completions, **kwargs) -> list[float]:
    """A toy reward: the fraction of a completion's characters that are digits (math answers)."""
    return [len(re.findall(r"\d", text)) / max(len(text), 1) for text in completion_texts(completions)]


def parses_as_python(completions, **kwargs) -> list[float]:
    """1 for a completion that parses as Python source, else 0 (one cut by the length limit rarely does)."""
    return [float(is_python(text)) for text in completion_texts(completions)]


def python_prompts(stdlib: Path | None = None, max_header_chars: int = 300) -> list[list[dict]]:
    """The task's prompts: the header of every function of the held-out standard-library files
    (scripts/train_checkpoints.py's split; `stdlib` None: this Python's) as a user turn, in corpus order."""
    split = corpus_files(stdlib)
    chats = [chat for _, text in split["held_out"] for chat in function_chats(text, SIZES["ci"].max_function_chars)]
    return [[chat[0]] for chat in chats if len(chat[0]["content"]) <= max_header_chars]


@contextlib.contextmanager
def sdpa_cudnn(is_enabled: bool):
    """Whether torch's scaled_dot_product_attention (the trainer's, and TRL's own generation's) may
    pick cuDNN attention; the setting before comes back after."""
    was_enabled = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(is_enabled)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was_enabled)


def limit_gpu_memory(device: torch.device, num_bytes: float) -> None:
    """Caps PyTorch's allocator on `device` at `num_bytes` (a smaller card, simulated)."""
    total = torch.cuda.get_device_properties(device).total_memory
    if num_bytes <= 0:
        raise FlexInferenceError("--gpu_memory_gb leaves no memory beside the sleepable KV pool: raise it")
    # NOTE: set_per_process_memory_fraction wants an ordinal; "cuda" alone has none.
    ordinal = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(min(1.0, num_bytes / total), ordinal)


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
    return signed_logp_difference(trainer, prompt_ids, completion_ids, sampler_logps).abs()


def signed_logp_difference(
    trainer, prompt_ids: list, completion_ids: list, sampler_logps: list | None, batch_size: int | None = None
) -> torch.Tensor:
    """The trainer's log-prob - the sampler's of every completion token (flat), scored by the trainer in
    chunks of `batch_size` rows (default: its training batch); `sampler_logps` None: the trainer's own
    at its training batch, so the difference is the trainer's recompute noise between the two sizes."""
    if sampler_logps is None:
        reference = trainer_logps(trainer, prompt_ids, completion_ids, trainer.args.per_device_train_batch_size)
        return trainer_logps(trainer, prompt_ids, completion_ids, batch_size) - reference
    trainer_side = trainer_logps(trainer, prompt_ids, completion_ids, batch_size)
    return trainer_side - torch.cat([torch.tensor(row, dtype=torch.float32) for row in sampler_logps]).to(trainer_side)


def trainer_logps(trainer, prompt_ids: list, completion_ids: list, batch_size: int | None) -> torch.Tensor:
    """The trainer's float32 log-probs of every completion token (flat), as GRPOTrainer pads and scores them."""
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
            batch_size=batch_size or trainer.args.per_device_train_batch_size,
        )
    return trainer_logps.float()[completion_mask.to(device)]


def difference_stats(difference: torch.Tensor) -> dict:
    """TRL's metric (mean and max |difference|) and the share of tokens whose importance ratio
    exp(difference) falls outside [0.9, 1.1]."""
    ratio = difference.exp()
    outside = ((ratio < 0.9) | (ratio > 1.1)).float().mean().item()
    magnitude = difference.abs()
    return dict(mean=magnitude.mean().item(), max=magnitude.max().item(), outside=outside, tokens=difference.numel())


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
    engine's completions and for HF generate's (with its own log-probs) on the same prompts, and the
    trainer's own recompute noise: the engine's completions scored at its training batch size and at
    an eighth of it."""

    def __init__(self, rollout_func):
        self.rollout_func = rollout_func
        self.records = []

    def __call__(self, prompts: list, trainer) -> dict:
        output = self.rollout_func(prompts, trainer)
        prompt_ids, completion_ids = output["prompt_ids"], output["completion_ids"]
        hf_ids, hf_logps = hf_generate_with_logprobs(trainer, prompt_ids)
        small_batch = max(1, trainer.args.per_device_train_batch_size // 8)
        differences = {
            "engine": signed_logp_difference(trainer, prompt_ids, completion_ids, output["logprobs"]),
            "hf_generate": signed_logp_difference(trainer, prompt_ids, hf_ids, hf_logps),
            "trainer_recompute": signed_logp_difference(trainer, prompt_ids, completion_ids, None, small_batch),
        }
        record = {"step": trainer.state.global_step}
        record.update({name: difference_stats(difference) for name, difference in differences.items()})
        print(
            f"sampling_logp_difference at step {record['step']}: "
            + ", ".join(
                f"{name} mean {record[name]['mean']:.3g} max {record[name]['max']:.3g} "
                f"outside [0.9, 1.1] {100 * record[name]['outside']:.2f}%"
                for name in differences
            ),
            flush=True,
        )
        self.records.append(record)
        return output


class TimedRollouts:
    """The engine's rollout_func, timed: what a step spent in it, and what the engine did for the first
    time in it (each a running count, so a slow step shows its cause): Triton-vs-cuBLAS races of a new
    GEMM shape (not saved by an earlier process), frames torch.compile compiled, CUDA graphs captured."""

    def __init__(self, rollout_func, engine):
        self.rollout_func = rollout_func
        self.engine = engine
        self.seconds = 0.0

    def __call__(self, prompts: list, trainer) -> dict:
        start = time.perf_counter()
        output = self.rollout_func(prompts, trainer)
        self.seconds += time.perf_counter() - start
        return output

    def counts(self) -> dict:
        """This step's rollout seconds (reset here) and the running counts."""
        counts = dict(
            rollout_s=self.seconds,
            skinny_races=float(sum(not choice.get("saved") for choice in SKINNY_CHOICES.values())),
            compiled_frames=float(torch._dynamo.utils.counters["stats"]["unique_graphs"]),
            cuda_graphs=float(len(self.engine.runner.cuda_graphs)),
        )
        self.seconds = 0.0
        return counts


class GarbageCollectionTimer:
    """Python's garbage collector, timed through gc.callbacks: running counts of its seconds and of its
    full (generation 2) collections, so a slow step shows whether collection caused it."""

    def __init__(self):
        self.seconds = 0.0
        self.full_collections = 0
        self._start = None
        gc.callbacks.append(self._on_collection)

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self.full_collections += info["generation"] == 2
            self._start = None

    def close(self) -> None:
        gc.callbacks.remove(self._on_collection)


class StepPhases(TrainerCallback):
    """Where each optimizer step's seconds go, from the trainer's side: `generate_s` is TRL's
    `_generate_and_score_completions` (the rollout, the rewards and any log-prob pass before training;
    the step's `rollout_s` is inside it), `optimizer_s` the optimizer step, and `train_s` the rest of
    the step (the micro batches' forward and backward); `micro_batch_min_s` and `micro_batch_max_s` are
    its fastest and slowest micro batch (generation taken out of the first, gradient clipping in the
    last), so a slow step shows whether one micro batch or all of them slowed. For the slowest,
    `micro_batch_max_index` (from 0 in the step), `micro_batch_max_width` (its padded prompt +
    completion tokens) and `micro_batch_max_new_width` (1 if no earlier micro batch of the run was that
    wide: a first shape for the trainer's kernels). Each boundary synchronizes the device, so GPU work
    is charged to the phase that queued it. With `stall_s`, a micro batch still running after that many
    seconds (generation not counted) prints every thread's Python stack to stderr (faulthandler's
    watchdog thread: nothing is sampled while the step runs well). Add it to the trainer's callbacks."""

    def __init__(self, trainer, device: torch.device, stall_s: float | None = None):
        self.device, self.stall_s = device, stall_s
        self.seconds = dict.fromkeys(("generate_s", "optimizer_s", "step_s"), 0.0)
        self._starts = {}
        # this step's micro batches: (seconds, padded tokens a row (0: no compute_loss call), width new to the run)
        self.micro_batches: list[tuple[float, int, bool]] = []
        self._seen_widths: set[int] = set()
        self._width = 0  # the running micro batch's, from its compute_loss call
        self._micro_batch_start = self._micro_batch_generate_s = 0.0  # when it began, generate_s then
        generate = trainer._generate_and_score_completions  # NOTE: TRL's private method, wrapped per instance
        compute_loss = trainer.compute_loss

        def timed_generate(*args, **kwargs):
            self.disarm_stall_watch()
            self.begin("generate_s")
            output = generate(*args, **kwargs)
            self.end("generate_s")
            self.arm_stall_watch()  # the rest of the micro batch it came in
            return output

        def measured_compute_loss(model, inputs, *args, **kwargs):
            self._width = inputs["prompt_ids"].shape[1] + inputs["completion_ids"].shape[1]
            return compute_loss(model, inputs, *args, **kwargs)

        trainer._generate_and_score_completions = timed_generate
        trainer.compute_loss = measured_compute_loss

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def begin(self, phase: str) -> None:
        self.synchronize()
        self._starts[phase] = time.perf_counter()

    def end(self, phase: str) -> None:
        self.synchronize()
        self.seconds[phase] += time.perf_counter() - self._starts.pop(phase)

    def arm_stall_watch(self) -> None:
        if self.stall_s is not None:
            faulthandler.dump_traceback_later(self.stall_s)  # replaces the timer armed before

    def disarm_stall_watch(self) -> None:
        if self.stall_s is not None:
            faulthandler.cancel_dump_traceback_later()

    def micro_batch_begins(self) -> None:
        self._micro_batch_start, self._micro_batch_generate_s = time.perf_counter(), self.seconds["generate_s"]
        self.arm_stall_watch()

    def micro_batch_ends(self) -> None:
        self.synchronize()
        self.disarm_stall_watch()
        generated_s = self.seconds["generate_s"] - self._micro_batch_generate_s
        seconds = time.perf_counter() - self._micro_batch_start - generated_s
        self.micro_batches.append((seconds, self._width, self._width not in self._seen_widths))
        self._seen_widths.add(self._width)
        self._width = 0

    def counts(self) -> dict:
        """This step's phases in seconds (reset here)."""
        phases = dict(self.seconds)
        phases["train_s"] = phases["step_s"] - phases["generate_s"] - phases["optimizer_s"]
        if self.micro_batches:
            slowest = max(range(len(self.micro_batches)), key=lambda i: self.micro_batches[i][0])
            max_s, width, is_new_width = self.micro_batches[slowest]
            phases.update(
                micro_batch_min_s=min(seconds for seconds, _, _ in self.micro_batches),
                micro_batch_max_s=max_s,
                micro_batch_max_index=float(slowest),
                micro_batch_max_width=float(width),
                micro_batch_max_new_width=float(is_new_width),
            )
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        self.micro_batches = []
        return phases

    def on_step_begin(self, _args, state, control, **kwargs):
        self.begin("step_s")
        self.micro_batch_begins()

    def on_substep_end(self, _args, state, control, **kwargs):
        self.micro_batch_ends()
        self.micro_batch_begins()

    def on_pre_optimizer_step(self, _args, state, control, **kwargs):
        self.micro_batch_ends()
        self.begin("optimizer_s")

    def on_optimizer_step(self, _args, state, control, **kwargs):
        self.end("optimizer_s")

    def on_step_end(self, _args, state, control, **kwargs):
        self.end("step_s")


class StepProfiler(TrainerCallback):
    """Profiles one optimizer step (`step`, from 1) with torch.profiler, host and GPU, and prints its
    top host ops by their own time, then (CUDA) its top GPU kernels: a slow step's extra seconds
    show as a host op (an allocation, a sync, a stall) or as kernels that ran longer."""

    def __init__(self, step: int, device: torch.device, row_limit: int = 15):
        self.step, self.device, self.row_limit = step, device, row_limit
        self.profiler = None

    def on_step_begin(self, _args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.start()

    def on_step_end(self, _args, state, control, **kwargs):
        if self.profiler is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.profiler.stop()
        events = self.profiler.key_averages()
        print(f"profile of step {self.step}: host ops by their own time")
        print(events.table(sort_by="self_cpu_time_total", row_limit=self.row_limit))
        if self.device.type == "cuda":
            print(f"profile of step {self.step}: GPU kernels by their own time")
            print(events.table(sort_by="self_device_time_total", row_limit=self.row_limit))
        self.profiler = None


def run(args) -> None:
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    start = time.perf_counter()  # the steps' wall_s counts from here: loading and the engine's start-up included
    prompts, reward = task_prompts_and_reward(args.task, args.stdlib)
    if len(prompts) < args.num_prompts:  # NOTE: TRL drops a short batch: 0 steps, exit 0, one logged warning
        raise FlexInferenceError(
            f"--num_prompts {args.num_prompts} is more than the {args.task} task's {len(prompts)} prompts: lower it"
        )
    model_name = args.model_name or str(ensure_trained_checkpoints() / "qwen3")
    device, dtype = resolve_device_and_dtype(args.device, args.dtype)
    if args.gpu_memory_gb is not None:
        limit_gpu_memory(device, args.gpu_memory_gb * 1e9)
    is_gemma = load_config(model_name, use_preset=args.load_format == "dummy").model_type.startswith("gemma4")
    tokenizer = load_tokenizer(args.tokenizer or model_name)
    model = load_model(model_name, is_gemma, dtype, device, args.load_format)
    model.set_attn_implementation("sdpa")  # the trainer's forward passes (and TRL's generate) on SDPA
    lora = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    policy = get_peft_model(model, lora)  # on its device before the engine takes views of its base
    rollout_func = comparison = None
    kv_pool_outside_allocator_gb = 0.0  # counted in no allocator statistic: the report adds it
    if args.backend == "engine":
        if is_gemma:
            from gemma4_flex_inference import FlexGemma4Inference as engine_class
        else:
            engine_class = FlexInference
        is_shared = args.engine_weights != "copy"
        engine = engine_class(
            # zero copy: the trainer's own model; else an inference copy (same seed, same weights)
            policy if is_shared else load_model(model_name, is_gemma, dtype, device, args.load_format),
            tokenizer,
            max_batch_size=args.num_prompts * args.num_generations,
            max_seq_length=args.max_seq_length,
            kv_cache_gb=args.kv_cache_gb,
            kv_cache_memory_fraction=args.kv_cache_memory_fraction,
            page_size=engine_page_size(device),
            peft_model=policy,
            base_model=policy,  # a copy's pristine weights: the trainer's frozen base
            compile_decode=args.compile_decode,
            fuse_projections=args.fuse_projections,
            enable_sleep_mode=args.enable_sleep_mode,
        )
        rollout_func = make_trl_rollout_func(engine, capture_cudagraph=args.capture_cudagraph)
        if engine.runner.kv_memory.cuda_memories:  # a sleepable pool is mapped outside PyTorch's allocator
            kv_pool_outside_allocator_gb = engine.runner.kv_pool_bytes / 1e9
            if args.gpu_memory_gb is not None:
                limit_gpu_memory(device, (args.gpu_memory_gb - kv_pool_outside_allocator_gb) * 1e9)
        if args.compare_logprobs:
            rollout_func = comparison = LogprobComparison(rollout_func)
        rollout_func = TimedRollouts(rollout_func, engine)
    print(f"loaded {model_name} ({args.backend} rollouts, {dtype}, {device}) in {time.perf_counter() - start:.1f} s")
    loaded_gb = torch.cuda.memory_allocated(device) / 1e9 if device.type == "cuda" else None  # weights, KV pool

    output_dir = tempfile.TemporaryDirectory(prefix="grpo_trl_")  # TRL's; it saves nothing here (save_strategy "no")
    config = GRPOConfig(
        output_dir=output_dir.name,
        max_steps=args.steps,
        per_device_train_batch_size=args.micro_batch_size or args.num_prompts * args.num_generations,
        gradient_accumulation_steps=args.num_prompts * args.num_generations // (args.micro_batch_size or 1)
        if args.micro_batch_size
        else 1,  # one generation of num_prompts x num_generations completions per optimizer step
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",  # TRL's default decays to 0 over the run: a short run would barely move
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=device.type == "cpu",
        bf16=dtype == torch.bfloat16,
        gradient_checkpointing=args.gradient_checkpointing,
        disable_tqdm=True,
        seed=args.seed,
    )

    logged = []

    class PrintMetrics(TrainerCallback):
        def on_log(self, _args, state, control, logs=None, **kwargs):
            logs = logs or {}
            if device.type == "cuda":  # each step's own peak: reset after each log
                logs["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
                logs["peak_reserved_gb"] = torch.cuda.max_memory_reserved(device) / 1e9
                # a running count: the allocator found no free block, emptied its cache and synchronized
                stats = torch.cuda.memory_stats(device)
                logs["alloc_retries"] = float(stats.get("num_alloc_retries", 0))
                for key in ("num_device_alloc", "num_device_free"):  # running counts of cudaMalloc and cudaFree
                    if key in stats:
                        logs[key] = float(stats[key])
                torch.cuda.reset_peak_memory_stats(device)
            if isinstance(rollout_func, TimedRollouts):
                logs.update(rollout_func.counts())
            if "train_runtime" not in logs:
                logs.update(phases.counts())
            logs.update(gc_s=gc_timer.seconds, gc_full_collections=float(gc_timer.full_collections))
            label = "total" if "train_runtime" in logs else f"step {state.global_step}"
            metrics = " ".join(f"{key}={value:.4g}" for key, value in logs.items() if isinstance(value, float))
            print(f"{label}: {metrics}", flush=True)
            logged.append({"label": label, "wall_s": time.perf_counter() - start, **logs})

    class SkipNonFiniteGradients(TrainerCallback):
        """Zeroes a step's gradients when any is not finite, so that one bf16 overflow does not turn
        the adapter into NaN for the rest of the run (seen once in 50 steps of bf16 training on the
        GPU-size checkpoint, with TRL's own generation); the skipped steps are counted in the report."""

        def __init__(self):
            self.skipped_steps = []

        def on_pre_optimizer_step(self, _args, state, control, model=None, **kwargs):
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            if grads and not torch.stack([g.isfinite().all() for g in grads]).all():  # one sync a step
                torch._foreach_zero_(grads)
                self.skipped_steps.append(state.global_step + 1)
                print(f"step {state.global_step + 1}: non-finite gradients, zeroed", flush=True)

    gradient_guard = SkipNonFiniteGradients()
    trainer_class = GRPOTrainer
    if args.sampler_correction:
        from qwen3_flex_inference import sampler_corrected

        trainer_class = sampler_corrected(GRPOTrainer)
    trainer = trainer_class(
        model=policy,
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        rollout_func=rollout_func,
    )
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(PrintMetrics())
    trainer.add_callback(gradient_guard)
    phases = StepPhases(trainer, device, args.stall_traceback_s)
    trainer.add_callback(phases)
    if args.profile_step is not None:
        trainer.add_callback(StepProfiler(args.profile_step, device))
    gc_timer = GarbageCollectionTimer()
    try:
        with sdpa_cudnn(args.trainer_cudnn_attention):
            trainer.train()
    finally:
        phases.disarm_stall_watch()  # training raised inside a micro batch: no dump after it
        gc_timer.close()
    output_dir.cleanup()
    if args.out:
        report = dict(
            args=vars(args),
            dtype=str(dtype),
            device=str(device),
            logs=logged,
            loaded_memory_gb=loaded_gb,
            kv_pool_gb=engine.runner.kv_pool_bytes / 1e9 if args.backend == "engine" else None,
            kv_pool_outside_allocator_gb=kv_pool_outside_allocator_gb,
            # held through sleep: the CUDA graphs' memory pool (inside the allocator's statistics)
            cuda_graph_pool_gb=engine.runner.graph_pool_bytes() / 1e9 if args.backend == "engine" else None,
            skipped_steps=gradient_guard.skipped_steps,
        )
        if comparison is not None:
            report["sampling_logp_difference"] = comparison.records
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))  # --stdlib is a Path


def main(argv=None) -> None:
    args = build_arg_parser().parse_args(argv)
    warnings.filterwarnings("ignore", message=".*rollout_func.*experimental")  # TRL's note on rollout_func
    try:
        check_args(args)
        run(args)
    except FlexInferenceError as error:
        print(f"error: {cli_message(error, vars(args))}", file=sys.stderr)
        raise SystemExit(1)
    except torch.OutOfMemoryError as error:
        limit = f" (--gpu_memory_gb {args.gpu_memory_gb:g})" if args.gpu_memory_gb else ""
        print(f"error: out of GPU memory{limit}: {str(error).splitlines()[0]}", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
