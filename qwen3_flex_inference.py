"""Fast, exact rollouts for Qwen3 and Llama-3.2 on flex_attention with a paged KV cache.

The file reads in the order a request travels:
1. `Sequence` and `FlexInference.generate`: the engine composes a scheduler and a model runner.
2. `Scheduler`: admission into a batch slot (`BatchSlots`) and KV pages (one `PageTable` per
   attention regime), page growth, preemption, retirement, and whether the next decode step can be
   queued before the last one's tokens are read.
3. `ModelRunner`: packed prefill, then the decode step (eager, compiled by regions, or a CUDA
   graph per batch bucket), queued as `DecodeLaunch`es whose tokens the engine reads back.
4. Attention over the paged cache: each step's view for one layer (`PrefillStep`, `DecodeStep`),
   the paged KV cache, the block masks and the decode attention op.
5. Tokens out: greedy tokens, and sampling (temperature, top-k, top-p, min-p) with log-probs.
6. Kernels: compiled flex_attention and its options, the compile-shape policy, rotary, skinny
   decode GEMMs, the Triton paged decode attention.
7. The model patches (Qwen3/Llama attention, fused projections), the LoRA double-copy, unmerged
   LoRA (4-bit weights) and the drift check, data parallel (one engine per torchrun rank), TRL's
   GRPOTrainer rollout function and its importance-sampling correction, loaders (bf16 or
   bitsandbytes 4-bit), and last the CLI.

Ideas taken from: PagedAttention (vLLM) for the paged KV cache; nano-vllm and flex-nano-vllm for
the scheduler / model-runner split, the page table and turning a logical block mask into a
physical one; attention-gym's paged-attention example; FlashDecoding (Dao et al., 2023) for the
paged decode attention kernel's split-KV over each row's pages; gpt-fast for CUDA-graph decode; for the
few-row GEMMs, split-K work decomposition (Hoque et al., "Accelerating a Triton Fused Kernel for
W4A16 Quantized Inference with SplitK", 2024; here without atomics) and putting the weight on the
MMA's wide side ("swap AB", as vLLM's small-batch CUTLASS GEMMs do); for sampling, the Gumbel-max
trick with counter-based noise (as in Philox-style RNGs: the noise is a function of its
coordinates) and threshold selection without a vocabulary sort, as FlashInfer's sampling kernels
avoid one (here a radix select). The reference for every
number this engine produces is Hugging Face transformers on the same weights.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import ctypes
import dataclasses
import functools
import gc
import hashlib
import importlib.util
import inspect
import itertools
import json
import logging
import math
import os
import random
import re
import socket
import statistics
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch._dynamo
import torch._inductor.config as inductor_config
import torch.distributed as dist
import torch.fx.experimental._config as fx_config
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton: skinny_linear is then plain F.linear
    triton = None

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

# NOTE: bitsandbytes (which PEFT imports) logs on import that an optional package of CPU kernels is
# missing; its 4-bit CPU path runs without it, so that one notice is dropped wherever the engine runs.
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(lambda record: "kernels" not in record.getMessage())


class FlexInferenceError(ValueError):
    """Bad input, or a setup this engine cannot run, said in one sentence.

    `params` names the arguments the sentence mentions that a caller can change; the CLI writes
    them as its flags (`n_pages` -> `--n_pages`).
    """

    def __init__(self, message: str, *params: str):
        super().__init__(message)
        self.params = params


# ---------------------------------------------------------------------------------------------
# Requests in: Sequence and the engine
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingParams:
    """How a sequence picks its tokens, with vLLM's names and meanings.

    temperature 0 is greedy (HF's argmax tokens); top_k 0, top_p 1.0 and min_p 0.0 are off; the
    filters apply as HF's do: logits / temperature, then top-k, top-p, min-p. `seed` fixes the
    draws (None: the engine's seed and its index in the run); `n` completions per prompt
    (`FlexInference.rollouts`); `max_tokens` (HF's `max_new_tokens` is the same, either spelling)
    None takes the engine's; `stop_token_ids` add to the model's end ids, which `ignore_eos`
    ignores. `logprobs` as vLLM's: None (or False) records none; 0 (or True) records the sampled
    token's log-prob, log_softmax(logits / temperature) at each chosen token over the whole
    vocabulary before any filtering (at temperature 0, log_softmax(logits)): the log-probs a GRPO
    trainer computes for the importance ratio and the KL. vLLM's k >= 1 (the k most likely tokens'
    log-probs beside the sampled one's) is refused: only the sampled token's is recorded.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    max_tokens: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | bool | None = None
    max_new_tokens: dataclasses.InitVar[int | None] = None  # HF's name for max_tokens, taken on construction

    def __post_init__(self, max_new_tokens: int | None):
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if max_new_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != max_new_tokens:
                raise FlexInferenceError(
                    f"max_tokens ({self.max_tokens}) and max_new_tokens ({max_new_tokens}) are one setting: give one",
                    "max_tokens",
                )
            object.__setattr__(self, "max_tokens", max_new_tokens)
        max_tokens = self.max_tokens
        checks = [
            (
                0 <= self.temperature < math.inf,
                f"temperature must be a finite number of at least 0, got {self.temperature}",
            ),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be at least 0 (0: off), got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.seed is None or 0 <= self.seed < 2**62, f"seed must be in [0, 2**62), got {self.seed}"),
            (self.n >= 1, f"n must be at least 1, got {self.n}"),
            (max_tokens is None or max_tokens >= 1, f"max_tokens must be at least 1, got {max_tokens}"),
            (
                self.logprobs is None or isinstance(self.logprobs, bool) or self.logprobs == 0,
                f"logprobs must be None or 0 (the sampled token's log-prob), got {self.logprobs!r}: "
                "the engine records only the sampled token's log-prob, not the top-k alternatives",
            ),
        ]
        for is_valid, message in checks:
            if not is_valid:
                raise FlexInferenceError(message, message.split()[0])

    @property
    def is_logprobs(self) -> bool:
        """Whether the sampled tokens' log-probs are recorded (vLLM's logprobs=0, or True)."""
        return self.logprobs is not None and self.logprobs is not False

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def is_filtered(self) -> bool:
        """Whether top-k, top-p or min-p is on (they cost extra passes over the vocabulary)."""
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0


GREEDY = SamplingParams(temperature=0.0)
# NOTE: a merged adapter is rebuilt as pristine + delta into the engine's model, and fused projections
# replace its weights by new frozen parameters (views of one fused tensor): neither may happen to the
# weights a trainer trains. A LoRA trainer's frozen base may be fused (zero copy).
TRAINERS_OWN_MODEL = (
    "the engine would rewrite the trainer's own model (a merged adapter, fused projections of the weights it "
    "trains, or base_model= the engine's model): for zero copy give the trainer's model as model= (and its PEFT "
    "model as peft_model=) without merge_lora, and for full fine-tuning without fuse_projections; else give the "
    "engine a copy of its own as model= and the trainer's model as peft_model= and base_model="
)
# How a decode step picks its rows' tokens (sampling_mode): each mode is its own graph per bucket.
GREEDY_MODE, SAMPLE_MODE, FILTERED_MODE = "greedy", "sample", "filtered"


@dataclass
class Sequence:
    """One prompt and its completion. `input_ids`, when given, is used as is (no tokenizer needed);
    `sampling` None is greedy."""

    text: str | None = None
    input_ids: list[int] | None = None
    max_new_tokens: int | None = None
    sampling: SamplingParams | None = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)  # with sampling.logprobs
    finished: bool = False
    finish_reason: str | None = None  # "stop" (an end id) or "length"
    record_logits: bool = False  # keep each generated token's logits (tests, analysis)
    output_logits: list = field(default_factory=list)
    batch_idx: int = -1  # batch slot while it holds pages, -1 otherwise
    num_preemptions: int = 0
    seed: int = 0  # the seed of this run's draws (sampling.seed, or the run's base seed + its index)
    shares_prompt_with: Sequence | None = None  # rollouts: the group's first completion, prefilled for all
    end_ids: frozenset = frozenset()  # the token ids that finish it in this run

    @property
    def token_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)


class FlexInference:
    """Continuous-batching generation (greedy or sampled) with a paged KV cache and flex attention.

    `model` is a Hugging Face Qwen3/Llama causal LM (optionally inside a PEFT wrapper) on CUDA or
    CPU, its linears in `model`'s dtype or in bitsandbytes 4-bit. The engine composes a `Scheduler`
    (who runs, on which pages; CPU bookkeeping) and a `ModelRunner` (the forward passes). With
    `peft_model`, the adapter's LoRA deltas are merged into `model`'s target weights from a pristine
    copy (`refresh_lora()` after every optimizer step); `base_model`, if given, holds those pristine
    weights already (e.g. a trainer's frozen base) so nothing is copied. 4-bit targets (or
    `merge_lora=False`) take the adapter unmerged instead: beside each target, from the engine's own
    copy of A and B, refreshed in place (with `fuse_projections`, inside the fused GEMMs); the base
    weights keep their values.

    Zero copy: `model` is the trainer's own PEFT model (its adapter trains) and `peft_model` that
    model. The engine then shares every weight with the trainer and applies the adapter unmerged
    from the trainer's live A and B, which the optimizer updates in place: no second copy, no
    refresh, no recapture. Its patches are in place only inside its own calls, so the trainer's
    forward and backward are HF's own. With `fuse_projections`, the trainer's frozen base weights
    become views of the fused tensors (same values, same memory), and the engine keeps a copy of A
    and B in the weights' dtype inside them, which each engine call refreshes. A merged adapter
    rewrites weights and needs a copy of its own. For full fine-tuning, the trainer's model as
    `model` (no peft_model) shares its weights the same way, unfused.

    The KV pool holds `n_pages` pages of `page_size` tokens (page 0 reserved), or is sized from a
    memory budget: `kv_cache_gb` (GB of 1e9 bytes) or `kv_cache_memory_fraction` (a share of the
    device's free memory when the engine is built), at most one of the three. Given none, it is
    sized to the device (`kv_pool_pages`). A pool larger than the device's free memory, or a
    budget that cannot hold one sequence of `max_seq_length`, is refused before anything is
    allocated. `enable_sleep_mode` lets `sleep()` give the pool's memory back while a trainer
    trains, and `wake_up()` take it again, CUDA graphs intact.
    """

    runner_class: type | None = None  # None: ModelRunner (Qwen3, Llama); FlexGemma4Inference sets its own
    max_prefill_tokens = 8192  # tokens packed into one prefill row (at least max_seq_length)

    def __init__(
        self,
        model: nn.Module,
        tokenizer=None,
        max_batch_size: int = 32,
        max_seq_length: int = 2048,
        n_pages: int | None = None,
        kv_cache_gb: float | None = None,
        kv_cache_memory_fraction: float | None = None,
        page_size: int = 128,
        max_new_tokens: int = 512,
        decode_kernel_options: dict | None = None,
        prefill_kernel_options: dict | None = None,
        fa4_prefill: bool | None = None,
        base_model: nn.Module | None = None,
        peft_model: nn.Module | None = None,
        compile_decode: bool = False,
        fuse_projections: bool = False,
        skinny_gemms: bool = True,
        seed: int = 0,
        merge_lora: bool | None = None,
        decode_attention: str | None = None,
        enable_sleep_mode: bool = False,
    ):
        check_engine_limits(
            max_batch_size, max_seq_length, n_pages, page_size, max_new_tokens, kv_cache_gb, kv_cache_memory_fraction
        )
        self.model = model
        self.causal_lm = unwrap_causal_lm(model)
        # zero copy: the model is a trainer's (its adapter trains), so the engine shares it and never writes it
        self.is_zero_copy = (
            peft_model is not None
            and unwrap_causal_lm(peft_model) is self.causal_lm
            and is_adapter_training(peft_model)
        )
        self.fuse_projections = fuse_projections
        if base_model is not None and unwrap_causal_lm(base_model) is self.causal_lm and not self.is_zero_copy:
            raise FlexInferenceError(TRAINERS_OWN_MODEL)
        if self.is_zero_copy and merge_lora:
            raise FlexInferenceError(
                "the engine runs the trainer's own model (zero copy), whose weights it never writes: "
                "merge_lora needs a copy of the model of its own "
                "(load the checkpoint again as model=, with the trainer's model as peft_model= and base_model=)",
                "merge_lora",
            )
        self.config = self.causal_lm.config
        self.tokenizer = tokenizer
        self.max_seq_length = max_seq_length
        self.max_new_tokens = max_new_tokens
        self.end_ids = end_token_ids(self.causal_lm, tokenizer)
        self.vocab_size = self.causal_lm.get_input_embeddings().num_embeddings
        device = next(self.causal_lm.parameters()).device
        self.merge_lora = (
            peft_model is not None
            and not self.is_zero_copy
            and resolve_merge_lora(merge_lora, self.causal_lm, peft_model)
        )
        # zero copy reads the trainer's A and B where they are; fused projections take copies of them
        self.is_live_adapter = self.is_zero_copy and not fuse_projections
        sliding_windows = attention_regimes(self.config)
        runner_class = self.runner_class or ModelRunner
        pool_sizes = kv_pool_pages(
            runner_class.kv_cache_heads(self.causal_lm),
            sliding_windows,
            n_pages,
            max_batch_size,
            max_seq_length,
            page_size,
            self.causal_lm.model.embed_tokens.weight.dtype,  # the runner's dtype, its caches' too
            device,
            kv_cache_gb,
            kv_cache_memory_fraction,
        )
        page_tables = {
            regime: PageTable(page_size, pool_sizes[regime], max_batch_size + 1, max_seq_length, device)
            for regime in sliding_windows
        }
        max_prefill_tokens = max(self.max_prefill_tokens, max_seq_length)
        self.scheduler = Scheduler(page_tables, sliding_windows, max_batch_size, max_seq_length, max_prefill_tokens)
        self.runner = runner_class(
            self.causal_lm,
            page_tables,
            sliding_windows,
            max_batch_size,
            max_prefill_tokens,
            decode_kernel_options=decode_kernel_options,
            prefill_kernel_options=prefill_kernel_options,
            fa4_prefill=fa4_prefill,
            compile_decode=compile_decode,
            fuse_projections=fuse_projections,
            skinny_gemms=skinny_gemms,
            is_lora_merged=self.merge_lora,
            unmerged_lora_layers=lora_layers(peft_model) if peft_model is not None and not self.merge_lora else None,
            decode_attention=decode_attention,
            is_sleep_mode=enable_sleep_mode,
        )
        self.timings: dict[str, float | dict] = {}
        self.seeds = random.Random(seed)  # the seeds of sequences that bring none
        self.peft_model = peft_model
        self.lora_targets: dict[str, torch.Tensor] = {}  # merged: the inference weights the adapter is merged into
        self.pristine_lora_weights: dict[str, torch.Tensor] = {}  # merged: their pristine copies
        self.unmerged_lora: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # unmerged: (A, B) per target
        if peft_model is not None:
            if self.merge_lora:
                self.lora_targets = lora_target_weights(self.causal_lm, peft_model)
                self.pristine_lora_weights = snapshot_pristine_lora_weights(self.lora_targets, base_model)
            else:
                self.unmerged_lora = {
                    **self.runner.fused_lora_weights,
                    **attach_unmerged_lora(
                        self.causal_lm,
                        peft_model,
                        self.runner.patches,
                        self.is_live_adapter,
                        self.runner.fused_lora_weights,
                    ),
                }
            self.refresh_lora()

    def prepare(self, sequences: list[Sequence]) -> None:
        """Tokenizes and checks every sequence, clears its output and sets its seed: bad input fails
        here, before any work.

        Each call takes one base seed s from the engine's seeds; sequences[i] without a seed of its
        own draws with s + i. Seeds follow the index in the whole run, so a run split across ranks
        (`generate(..., shard=)`) draws what one process would, and no two ranks draw alike.
        """
        base_seed = self.seeds.getrandbits(61)  # + an index stays below SamplingParams' 2**62
        for i, seq in enumerate(sequences):
            if seq.input_ids is None:
                if seq.text is None:
                    raise FlexInferenceError("a Sequence needs text or input_ids")
                if self.tokenizer is None:
                    raise FlexInferenceError("a Sequence without input_ids needs a tokenizer")
                seq.input_ids = tokenize_prompt(self.tokenizer, seq.text)
            seq.input_ids = list(seq.input_ids)
            if not seq.input_ids:
                raise FlexInferenceError("a prompt has no tokens")
            if not 0 <= min(seq.input_ids) <= max(seq.input_ids) < self.vocab_size:
                raise FlexInferenceError(
                    f"a prompt holds token ids from {min(seq.input_ids)} to {max(seq.input_ids)}, "
                    f"outside the vocabulary's 0..{self.vocab_size - 1}"
                )
            if len(seq.input_ids) >= self.max_seq_length:
                raise FlexInferenceError(
                    f"a prompt has {len(seq.input_ids)} tokens, max_seq_length is {self.max_seq_length}: "
                    "shorten it or raise max_seq_length",
                    "max_seq_length",
                )
            params = seq.sampling or GREEDY
            if params.n != 1:
                raise FlexInferenceError(
                    f"a Sequence is one completion, but its SamplingParams ask for n={params.n}: use rollouts"
                )
            if seq.max_new_tokens is None:
                seq.max_new_tokens = params.max_tokens or self.max_new_tokens
            if seq.max_new_tokens < 1:
                raise FlexInferenceError(
                    f"max_new_tokens must be at least 1, got {seq.max_new_tokens}", "max_new_tokens"
                )
            seq.seed = params.seed if params.seed is not None else base_seed + i
            seq.end_ids = frozenset(params.stop_token_ids) | (
                frozenset() if params.ignore_eos else frozenset(self.end_ids)
            )
            seq.output_ids, seq.output_logprobs, seq.output_logits = [], [], []
            seq.finished, seq.finish_reason = False, None

    @torch.inference_mode()
    def generate(
        self,
        prompts: list,
        sampling_params: SamplingParams | None = None,
        capture_cudagraph: bool = False,
        progress: bool = False,
        shard: slice | None = None,
    ) -> list[Sequence]:
        """Decodes every prompt to an end id or its max_new_tokens; returns their Sequences in input
        order, filled in.

        A prompt is a `Sequence` (the same object comes back; its own `sampling`, None: greedy), or
        a string (raw text, as vLLM's `LLM.generate` takes it), a chat (a list of {"role", "content"}
        dicts, in the tokenizer's chat template with the generation prompt, as vLLM's `LLM.chat`) or
        token ids, each drawn as `sampling_params` says (None: greedy).

        `shard` (data parallel, `generate_shard`): every sequence is prepared (checked, seeded by its
        index in `prompts`), only sequences[shard] are generated, and that block is returned.
        """
        self.check_awake()
        sequences = [self.as_sequence(prompt, i, sampling_params) for i, prompt in enumerate(prompts)]
        self.prepare(sequences)
        if shard is not None:
            sequences = sequences[shard]
        with self.engine_call():
            if capture_cudagraph:
                # every mode a step can take: a step's mode is the most demanding of its rows'
                self.capture_cuda_graphs(modes=sorted({sampling_mode([seq]) for seq in sequences}))
            try:
                return self._generate(sequences, capture_cudagraph, progress)
            finally:  # an error (or an interrupt) mid-way leaves no slot or page held
                self.scheduler.abort()

    @torch.inference_mode()
    def rollouts(
        self, prompts: list, params: SamplingParams, capture_cudagraph: bool = False, progress: bool = False
    ) -> list[list[Sequence]]:
        """`params.n` completions of every prompt (a string, a chat or token ids, as `generate` takes
        them), drawn as `params` says; groups[i] holds prompts[i]'s completions.

        Completion j of prompt i draws with seed s + i * n + j (s: params.seed, or one from the
        engine's seed): prompt 0's completions use s, ..., s + n - 1, and no two completions share
        their noise.
        """
        prompt_sequences = []
        for i, prompt in enumerate(prompts):
            seq = self.as_sequence(prompt, i, params)
            if seq.input_ids is None:  # tokenized once for the whole group
                seq.input_ids = tokenize_prompt(self.tokenizer, seq.text)
            prompt_sequences.append(seq)
        base_seed = params.seed if params.seed is not None else self.seeds.getrandbits(61)
        groups = completion_groups(prompt_sequences, params, base_seed)
        self.generate(
            [seq for group in groups for seq in group], capture_cudagraph=capture_cudagraph, progress=progress
        )
        return groups

    def as_sequence(self, prompt, index: int, sampling: SamplingParams | None) -> Sequence:
        """Prompts in: a Sequence as it is; a string, a chat or token ids as a new Sequence drawn as
        `sampling` says (a chat in the tokenizer's chat template, with the generation prompt)."""
        if isinstance(prompt, Sequence):
            return prompt
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise FlexInferenceError(f"prompt {index} is text, but the engine has no tokenizer: give token ids")
            return Sequence(text=prompt, sampling=sampling)
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            return Sequence(text=self.chat_text(prompt, index), sampling=sampling)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return Sequence(input_ids=list(prompt), sampling=sampling)
        raise FlexInferenceError(
            f"prompt {index} is {type(prompt).__name__} {str(prompt)[:40]!r}: give a string, a chat "
            "(a list of {'role': ..., 'content': ...} dicts), token ids or a Sequence"
        )

    def chat_text(self, messages: list[dict], index: int) -> str:
        """A chat's text in the tokenizer's chat template, ending in the assistant turn's opening."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise FlexInferenceError(f"prompt {index} is a chat, but the tokenizer has no chat template: give text")
        for message in messages:
            if not (isinstance(message.get("role"), str) and isinstance(message.get("content"), str)):
                raise FlexInferenceError(
                    f"prompt {index} holds the message {str(message)[:60]}: each needs a string role and content"
                )
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def _generate(self, sequences: list[Sequence], use_graph: bool, progress: bool) -> list[Sequence]:
        """The loop, nano-vllm's step in two kinds: a prefill step admits what fits and samples each
        new sequence's first token; a decode step samples one token for every running sequence.

        While the rows stay the same, each decode step is queued before the previous one's tokens
        are read, so the host's bookkeeping overlaps the GPU's work. A chain ends (the GPU waits for
        the host once) when a sequence could start, when the live rows fit a smaller bucket, or when
        a row needs a page it could not take ahead.
        """
        self.scheduler.add(sequences)
        meter = StepMeter(sum(seq.max_new_tokens for seq in sequences), progress)
        launch: DecodeLaunch | None = None  # a decode step queued but not read yet
        while not self.scheduler.is_done:
            if launch is None:
                self._prefill_step(meter)
                launch = self._launch_decode(use_graph, meter)
            else:
                launch = self._decode_step(launch, use_graph, meter)
        meter.close()
        self.timings.update(meter.timings())
        return sequences

    def _prefill_step(self, meter: StepMeter) -> None:
        """Admits the waiting sequences that fit, prefills them (forks share their source's prompt)
        and takes each one's first token; then frees the finished and makes room for the next token."""
        scheduler = self.scheduler
        admitted, forks = scheduler.admit(scheduler.max_prefill_tokens)
        if admitted:
            start = time.perf_counter()
            rows = admitted + [fork for fork, _ in forks]
            logits_NV = self.runner.prefill_with_forks(admitted, forks)
            next_ids, logprobs = self.runner.sample(logits_NV, rows)  # the one device->host sync of a prefill
            scheduler.postprocess(rows, next_ids, logprobs, logits_NV)
            scheduler.run(rows)
            meter.prefilled(sum(seq.seq_len for seq in admitted), len(rows), time.perf_counter() - start)
        scheduler.retire()
        scheduler.reserve_or_preempt()

    def _launch_decode(self, use_graph: bool, meter: StepMeter) -> DecodeLaunch | None:
        """Queues a decode step for the running sequences (None when none runs: all finished, or
        the only one gave its pages back)."""
        if not self.scheduler.running:
            return None
        start = time.perf_counter()
        launch = self.runner.launch_decode(self.scheduler.running, use_graph)
        meter.decoded(0, time.perf_counter() - start)
        return launch

    def _decode_step(self, launch: DecodeLaunch, use_graph: bool, meter: StepMeter) -> DecodeLaunch | None:
        """Reads `launch`'s tokens into its sequences, having queued the next step first when the
        same rows go on (`Scheduler.can_chain`: the finished ride along as padding rows while the
        live ones still need this bucket); returns that step, or None after retiring."""
        scheduler = self.scheduler
        start = time.perf_counter()
        bucket = launch.next_ids.shape[0]
        smaller_bucket = max((b for b in self.runner.buckets if b < bucket), default=0)
        # the chain goes on while its rows need this bucket; then the finished leave and it shrinks
        can_chain = scheduler.can_chain(min_live=smaller_bucket + 1)
        next_launch = self.runner.launch_decode(scheduler.running, use_graph, launch) if can_chain else None
        next_ids, logprobs = launch.read()
        num_taken = scheduler.postprocess(launch.rows, next_ids, logprobs, launch.logits_BV)
        meter.decoded(num_taken, time.perf_counter() - start, num_taken, bucket)
        if next_launch is None:
            scheduler.retire()
        return next_launch

    @torch.inference_mode()
    def score(self, token_ids: list[list[int]]) -> list[torch.Tensor]:
        """Teacher-forced logits [len, V] (float32, CPU) for each token list, through packed
        prefills of as many lists as the free slots and pages hold."""
        self.check_awake()
        waiting = [Sequence(input_ids=list(ids)) for ids in token_ids]
        self.scheduler.add(waiting)
        logits = []
        try:
            with self.engine_call():
                while self.scheduler.waiting:
                    batch, _ = self.scheduler.admit()
                    if not batch:
                        raise FlexInferenceError(
                            f"a sequence of {self.scheduler.waiting[0].seq_len} tokens does not fit the page pool"
                        )
                    logits_TV = self.runner.score(batch).cpu()
                    for seq in batch:
                        self.scheduler.release(seq)
                    starts = [0] + [p + 1 for p in sequences_last_positions(batch)]
                    logits += [logits_TV[start : start + seq.seq_len] for start, seq in zip(starts, batch)]
        finally:
            self.scheduler.abort()
        return logits

    @torch.inference_mode()
    def capture_cuda_graphs(self, buckets: list[int] | None = None, modes=(GREEDY_MODE,)) -> None:
        """One CUDA graph per decode batch bucket (default: all) and sampling mode (default:
        greedy), largest first, in one memory pool."""
        self.check_awake()
        start = time.perf_counter()
        with self.engine_call():
            graph_s = self.runner.capture_cuda_graphs(buckets, modes)
        if graph_s:
            self.timings["capture_s"] = time.perf_counter() - start
            self.timings["capture_s_per_graph"] = {f"{bucket} {mode}": s for (bucket, mode), s in graph_s.items()}

    @contextlib.contextmanager
    def engine_call(self):
        """Inside each of the engine's calls: its compile settings and model patches; zero copy with
        fused projections first copies the trainer's current A and B in (the optimizer stepped them
        since), so no refresh call is needed."""
        with compile_settings(), self.runner.patches.installed():
            if self.is_zero_copy and not self.is_live_adapter:
                refresh_unmerged_lora(self.unmerged_lora, self.peft_model)
            yield

    def sleep(self) -> None:
        """Gives the KV pool's memory back to the device (a trainer's step can use it) until
        `wake_up`; the weights, compiled kernels and CUDA graphs (and their memory pool) stay."""
        if not self.runner.kv_memory.is_sleep_mode:
            raise FlexInferenceError("sleep needs an engine built with enable_sleep_mode=True", "enable_sleep_mode")
        self.runner.kv_memory.sleep()

    def wake_up(self) -> None:
        """Takes the KV pool's memory again (at the same device addresses: the CUDA graphs stay valid)."""
        self.runner.kv_memory.wake_up()

    def check_awake(self) -> None:
        if self.runner.kv_memory.is_asleep:
            raise FlexInferenceError("the engine is asleep (its KV pool given back): call wake_up() first")

    def refresh_lora(self) -> None:
        """Brings the PEFT model's current adapter into the engine, in place: re-merged from the
        pristine weights, or copied beside them when unmerged. Zero copy reads the adapter itself:
        nothing to bring, unless the trainer replaced its tensors (then the engine reads the new
        ones, and its CUDA graphs are captured again); with fused projections it keeps copies,
        which every engine call refreshes (`engine_call`)."""
        if self.peft_model is None:
            raise FlexInferenceError(
                "this engine has no LoRA adapter to refresh: build it with peft_model= (or, for full "
                "weights, call load_weights)"
            )
        if self.merge_lora:
            refresh_lora_merge_from_pristine(self.lora_targets, self.pristine_lora_weights, self.peft_model)
        elif not self.is_live_adapter:
            refresh_unmerged_lora(self.unmerged_lora, self.peft_model)
        elif not reads_live_adapter(self.unmerged_lora, self.peft_model):  # the trainer replaced A or B: read the new
            self.unmerged_lora = attach_unmerged_lora(self.causal_lm, self.peft_model, self.runner.patches, True)
            self.runner.drop_cuda_graphs()  # they read the old ones: captured again at the next generate

    def verify_no_drift(self, iterations: int = 5, seed: int = 0) -> dict:
        """Perturbs the adapter `iterations` times with a refresh after each, restores it and
        refreshes again: passes when the base weights never changed, every perturbation changed what
        the engine applies, and the restored adapter applies bit-equal to the first. `covers` says
        which path that was: the merged double-copy, or the unmerged adapter beside 4-bit weights."""
        if self.peft_model is None:
            raise FlexInferenceError("drift verification checks a LoRA refresh: build the engine with a peft_model")
        if self.merge_lora:
            applied, base = self.lora_targets, self.pristine_lora_weights
            covers = "the merged double-copy: each target rebuilt as pristine + delta"
        else:
            applied = {f"{name}.{part}": w for name, pair in self.unmerged_lora.items() for part, w in zip("AB", pair)}
            modules = dict(self.causal_lm.named_modules())
            base = {name: getattr(modules[name], "base_layer", modules[name]).weight for name in self.unmerged_lora}
            whose = "the trainer's own A and B, zero copy" if self.is_live_adapter else "the engine's copy of A and B"
            covers = (
                f"the unmerged adapter: A and B beside base weights that are never written ({whose}; "
                "the merged double-copy is not in use)"
            )
        result = run_drift_verification(applied, base, self.peft_model, self.refresh_lora, iterations, seed)
        return {"covers": covers, **result}

    @torch.no_grad()
    def load_weights(self, named_tensors) -> None:
        """Weight sync for full fine-tuning: copies new values (name -> tensor pairs, or a dict)
        into the inference weights in place, so captured CUDA graphs stay valid.

        Names as the HF model's state dict has them; a PEFT wrapper's (`base_model.model.`,
        `.base_layer`) and a multimodal Gemma-4's (`model.language_model.`) are understood. Fused
        projections take the new rows (each projection's weight is a view of them), and tied
        embeddings are one tensor. A LoRA target's pristine copy takes the new value and the adapter
        is merged on top again.
        """
        weights = dict(self.causal_lm.named_parameters(remove_duplicate=False))
        is_lora_changed = False
        for name, tensor in named_tensors.items() if isinstance(named_tensors, dict) else named_tensors:
            key = text_model_name(name)
            key = key if key in weights else key.replace(".weight", ".base_layer.weight")
            if key not in weights:
                raise FlexInferenceError(f"the model has no weight named {name}")
            target = self.pristine_lora_weights.get(key.removesuffix(".base_layer.weight").removesuffix(".weight"))
            if target is None:
                target = weights[key]
            else:
                is_lora_changed = True
            if not target.is_floating_point():
                raise FlexInferenceError(
                    f"{name} is a 4-bit weight, packed: it takes no new values in place "
                    "(full fine-tuning syncs float weights; train a LoRA adapter on 4-bit ones)"
                )
            if tuple(tensor.shape) != tuple(target.shape):
                raise FlexInferenceError(
                    f"{name} cannot take a {tuple(tensor.shape)} {tensor.dtype} tensor: "
                    f"it is {tuple(target.shape)} {target.dtype}"
                )
            target.copy_(tensor)
        if is_lora_changed:
            self.refresh_lora()


class StepMeter:
    """A run's token counts and times by step kind, and its progress bar (tqdm, off without a
    terminal or unless asked for)."""

    def __init__(self, total_tokens: int, progress: bool):
        from tqdm.auto import tqdm

        self.bar = tqdm(
            total=total_tokens, disable=None if progress else True, unit="tok", dynamic_ncols=True, leave=False
        )
        self.num_prefill_tokens = self.num_decode_tokens = 0
        self.prefill_s = self.decode_s = 0.0
        self.decode_by_bucket: dict[int, dict] = {}  # bucket -> steps, seconds, rows (real, not padding)

    def prefilled(self, num_prompt_tokens: int, num_new_tokens: int, seconds: float) -> None:
        self.num_prefill_tokens += num_prompt_tokens
        self.prefill_s += seconds
        self.bar.update(num_new_tokens)

    def decoded(self, num_new_tokens: int, seconds: float, num_rows: int = 0, bucket: int = 0) -> None:
        """A decode step read (`num_rows` sequences padded to `bucket`), or a first step queued (0, 0)."""
        self.num_decode_tokens += num_new_tokens
        self.decode_s += seconds
        if bucket:
            band = self.decode_by_bucket.setdefault(bucket, dict(steps=0, seconds=0.0, rows=0))
            band["steps"], band["seconds"], band["rows"] = (
                band["steps"] + 1,
                band["seconds"] + seconds,
                band["rows"] + num_rows,
            )
        self.bar.update(num_new_tokens)
        self.bar.set_postfix_str(
            f"prefill {self.num_prefill_tokens / max(self.prefill_s, 1e-9):.0f} tok/s, "
            f"decode {self.num_decode_tokens / max(self.decode_s, 1e-9):.0f} tok/s"
        )

    def close(self) -> None:
        self.bar.close()

    def timings(self) -> dict:
        return dict(
            prefill_s=self.prefill_s,
            decode_s=self.decode_s,
            num_prefill_tokens=self.num_prefill_tokens,
            num_decode_tokens=self.num_decode_tokens,
            decode_by_bucket={bucket: self.decode_by_bucket[bucket] for bucket in sorted(self.decode_by_bucket)},
        )


def completion_groups(prompts: list[Sequence], params: SamplingParams, base_seed: int) -> list[list[Sequence]]:
    """`params.n` completions of each prompt sequence, drawn as `params` says; completion j of prompt
    i with seed base_seed + i * n + j. The first of each group is prefilled for all (the others
    share its prompt's pages)."""
    groups = []
    for i, prompt in enumerate(prompts):
        seeds = [base_seed + i * params.n + j for j in range(params.n)]
        group = [
            Sequence(text=prompt.text, input_ids=prompt.input_ids, sampling=dataclasses.replace(params, n=1, seed=seed))
            for seed in seeds
        ]
        for seq in group[1:]:
            seq.shares_prompt_with = group[0]
        groups.append(group)
    return groups


def tokenize_prompt(tokenizer, text: str) -> list[int]:
    """The prompt's token ids as the model's tokenizer makes them for that kind of text: text from
    apply_chat_template(..., tokenize=False) already starts with the BOS token (Gemma, Llama) and
    gets no second one; raw text gets the tokenizer's special tokens (BOS where it adds one). The
    length is the engine's to judge (max_seq_length), not the tokenizer's model_max_length: no warning."""
    bos = getattr(tokenizer, "bos_token", None)
    has_bos = bos is not None and text.startswith(bos)
    return tokenizer(text, add_special_tokens=not has_bos, verbose=False)["input_ids"]


def end_token_ids(causal_lm: nn.Module, tokenizer) -> set[int]:
    """Every end id the model uses: generation config, model config and tokenizer."""
    end_ids = eos_token_ids(getattr(causal_lm, "generation_config", None), causal_lm.config)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        end_ids.add(tokenizer.eos_token_id)
    return end_ids


def eos_token_ids(*configs) -> set[int]:
    """The union of the `eos_token_id`s (an id or a list of them) of these configs; None ones are skipped."""
    end_ids: set[int] = set()
    for config in configs:
        value = getattr(config, "eos_token_id", None) if config is not None else None
        if value is not None:
            end_ids |= set(value) if isinstance(value, (list, tuple)) else {value}
    return end_ids


def check_engine_limits(
    max_batch_size,
    max_seq_length,
    n_pages,
    page_size,
    max_new_tokens,
    kv_cache_gb: float | None = None,
    kv_cache_memory_fraction: float | None = None,
) -> None:
    """Bad sizes fail here with one sentence, before anything is allocated (n_pages None: from a
    memory budget or auto, sized later by `kv_pool_pages`)."""
    check_kv_cache_budget(n_pages, kv_cache_gb, kv_cache_memory_fraction)
    if max_batch_size < 1:
        raise FlexInferenceError(f"max_batch_size must be at least 1, got {max_batch_size}", "max_batch_size")
    if page_size < 16 or page_size & (page_size - 1):
        raise FlexInferenceError(f"page_size must be a power of two of at least 16, got {page_size}", "page_size")
    if max_seq_length % page_size:
        raise FlexInferenceError(
            f"max_seq_length ({max_seq_length}) must be a multiple of page_size ({page_size})", "max_seq_length"
        )
    if max_new_tokens < 1:
        raise FlexInferenceError(f"max_new_tokens must be at least 1, got {max_new_tokens}", "max_new_tokens")
    if n_pages is not None and (n_pages - 1) * page_size < max_seq_length:
        raise FlexInferenceError(
            f"the page pool ({n_pages} pages of {page_size}, one reserved) cannot hold even one sequence of "
            f"max_seq_length {max_seq_length}: raise n_pages to at least {max_seq_length // page_size + 1}",
            "n_pages",
        )


def check_kv_cache_budget(n_pages, kv_cache_gb, kv_cache_memory_fraction) -> None:
    """At most one of n_pages and the two memory budgets sizes the KV pool; a budget in GB is
    positive and finite, a share of the free memory in (0, 1]."""
    sizes = {"n_pages": n_pages, "kv_cache_gb": kv_cache_gb, "kv_cache_memory_fraction": kv_cache_memory_fraction}
    given = [name for name, value in sizes.items() if value is not None]
    if len(given) > 1:
        raise FlexInferenceError(f"{given[0]} and {given[1]} both size the KV pool: pass one of them", *given[:2])
    if kv_cache_gb is not None and not (math.isfinite(kv_cache_gb) and kv_cache_gb > 0):
        raise FlexInferenceError(f"kv_cache_gb must be a positive number of GB, got {kv_cache_gb}", "kv_cache_gb")
    if kv_cache_memory_fraction is not None and not 0 < kv_cache_memory_fraction <= 1:  # NaN too
        raise FlexInferenceError(
            f"kv_cache_memory_fraction is a share of the free memory, in (0, 1], got {kv_cache_memory_fraction}",
            "kv_cache_memory_fraction",
        )


def attention_regimes(config) -> dict[str, int | None]:
    """Attention regime -> its sliding window (None: full causal), in the order the layers first use them."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or [FULL_ATTENTION]
    return {regime: (window if regime == SLIDING_ATTENTION else None) for regime in dict.fromkeys(layer_types)}


# ---------------------------------------------------------------------------------------------
# Scheduler: batch slots, pages, admission, preemption, retirement
# ---------------------------------------------------------------------------------------------


class Scheduler:
    """Who runs next, and on which pages. CPU bookkeeping only, so scheduling never waits on the GPU.

    Sequences wait in `waiting` (first come, first served; a preempted one goes back to the front)
    and decode in `running` (in admission order: the newest is preempted first). A running sequence
    holds a batch slot (`slots`) and, in every attention regime's pool (`page_tables`), pages for
    its tokens; a sliding-window pool recycles the pages that fall out of the window.
    """

    def __init__(
        self,
        page_tables: dict[str, PageTable],
        sliding_windows: dict[str, int | None],
        max_batch_size: int,
        max_seq_length: int,
        max_prefill_tokens: int,
    ):
        self.page_tables = page_tables  # attention regime -> its pool's page table
        self.sliding_windows = sliding_windows  # attention regime -> window (None: full causal)
        self.page_size = next(iter(page_tables.values())).page_size
        self.max_seq_length = max_seq_length
        self.max_prefill_tokens = max_prefill_tokens
        self.slots = BatchSlots(max_batch_size + 1)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.holders: dict[int, Sequence] = {}  # batch slot -> the sequence holding it (and its pages)
        # holds_until[batch_idx]: the first query position at which that slot's pages no longer
        # fit (a new page is needed; a windowed pool recycles what the window left behind then)
        self.holds_until = [0] * (max_batch_size + 1)

    @property
    def is_done(self) -> bool:
        return not self.waiting and not self.running

    def add(self, sequences: list[Sequence]) -> None:
        self.waiting.extend(sequences)

    def can_admit(self, seq: Sequence) -> bool:
        """Whether `seq` could start now: a free batch slot, and room for its tokens in every pool."""
        return self.slots.can_allocate() and self.can_hold(seq)

    def admit(self, max_tokens: int | None = None) -> tuple[list[Sequence], list[tuple[Sequence, Sequence]]]:
        """Takes waiting sequences in order while they can start (and the tokens to prefill, all
        together, stay within `max_tokens`); each gets a batch slot and pages for its tokens.

        Returns the sequences to prefill, and the forks: (sequence, its prompt's source), where a
        fresh sequence whose `shares_prompt_with` was admitted fresh just before it shares that
        one's full prompt pages instead of being prefilled (its partial last page is the runner's
        to copy).
        """
        admitted, forks, num_tokens = [], [], 0
        while self.waiting:
            seq = self.waiting[0]
            source = seq.shares_prompt_with
            is_fork = any(source is other for other in admitted) and not source.output_ids and not seq.output_ids
            if is_fork and self.can_fork(seq):
                self._take_slot(self.waiting.popleft())
                for table in self.page_tables.values():
                    table.share(source.batch_idx, seq.batch_idx, seq.seq_len // self.page_size)
                self.hold(seq, seq.seq_len)
                forks.append((seq, source))
                continue
            if not self.can_admit(seq) or (max_tokens is not None and num_tokens + seq.seq_len > max_tokens):
                break
            self._take_slot(self.waiting.popleft())
            self.hold(seq, seq.seq_len)
            admitted.append(seq)
            num_tokens += seq.seq_len
        return admitted, forks

    def can_fork(self, seq: Sequence) -> bool:
        """Whether `seq` could start sharing its prompt's full pages: a free batch slot, and in every
        pool a page for its partial last block."""
        has_partial_block = seq.seq_len % self.page_size != 0
        return self.slots.can_allocate() and all(
            table.num_free_pages >= has_partial_block for table in self.page_tables.values()
        )

    def _take_slot(self, seq: Sequence) -> None:
        seq.batch_idx = self.slots.allocate()
        self.holders[seq.batch_idx] = seq

    def run(self, sequences: list[Sequence]) -> None:
        """Admitted sequences join the decode batch once their prompt is prefilled."""
        self.running += sequences

    def first_needed_pos(self, regime: str, query_pos: int) -> int:
        """The first position a query at `query_pos` sees in `regime` (HF: kv > q - window)."""
        window = self.sliding_windows[regime]
        return 0 if window is None else max(0, query_pos - window + 1)

    def can_hold(self, seq: Sequence, query_pos: int | None = None, ahead_pos: int = 0) -> bool:
        """Whether every pool has room for `seq`'s tokens (and positions up to `ahead_pos`), given
        the next query position (default: the one after its last token, as after a prefill)."""
        query_pos = seq.seq_len if query_pos is None else query_pos
        batch_idx = seq.batch_idx if seq.batch_idx >= 0 else None
        return all(
            table.can_reserve(max(seq.seq_len, ahead_pos + 1), batch_idx, self.first_needed_pos(regime, query_pos))
            for regime, table in self.page_tables.items()
        )

    def hold(self, seq: Sequence, query_pos: int, ahead_pos: int = 0) -> None:
        """Pages for `seq`'s tokens, and for positions up to `ahead_pos` (room for decode steps to go
        on chained), in every pool; windowed pools first recycle what the query at `query_pos` no
        longer sees. Until a new page is needed a windowed pool keeps the pages the window leaves:
        never read (a query's visible blocks start at its window), they go back at the next hold."""
        holds_until = self.max_seq_length
        for regime, table in self.page_tables.items():
            first_needed_pos = self.first_needed_pos(regime, query_pos)
            table.trim(seq.batch_idx, first_needed_pos)
            table.reserve(seq.batch_idx, max(seq.seq_len, ahead_pos + 1), first_needed_pos)
            holds_until = min(holds_until, len(table.pages_of[seq.batch_idx]) * self.page_size)
        self.holds_until[seq.batch_idx] = holds_until

    def pages_fit(self, seq: Sequence, query_pos: int) -> bool:
        """Whether the pages `seq` holds already serve a query at `query_pos` (no page to add or recycle)."""
        return query_pos < self.holds_until[seq.batch_idx]

    def release(self, seq: Sequence) -> None:
        """Gives back `seq`'s pages in every pool and its batch slot."""
        for table in self.page_tables.values():
            table.erase(seq.batch_idx)
        self.slots.free(seq.batch_idx)
        del self.holders[seq.batch_idx]
        seq.batch_idx = -1

    def retire(self) -> None:
        """Finished sequences leave the decode batch and give back their pages."""
        still_running = []
        for seq in self.running:
            if seq.finished:
                self.release(seq)
            else:
                still_running.append(seq)
        self.running = still_running

    def reserve_or_preempt(self) -> None:
        """Gives every running sequence room for its next token; when the pool runs dry, the newest
        sequence is preempted (its pages freed) and recomputed from its tokens later. With nobody
        waiting, a sequence near the end of its pages gets the next one ahead where it is free
        (`reserve_ahead`)."""
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            # The next step writes the K/V of the last token, at position seq_len - 1; most steps
            # cross no page boundary, so the pages held already fit.
            if self.pages_fit(seq, seq.seq_len - 1):
                i += 1
                continue
            if self.can_hold(seq, seq.seq_len - 1):
                self.hold(seq, seq.seq_len - 1)
                i += 1
                continue
            victim = self.running.pop()
            self.release(victim)
            victim.num_preemptions += 1
            self.waiting.appendleft(victim)
        if not self.waiting:
            self.reserve_ahead()

    def reserve_ahead(self) -> None:
        """Pages a page_size of positions ahead for every running sequence whose pages end sooner,
        where the pools have them free (never by preempting): decode steps then go on chained
        (`can_chain`) across page boundaries, instead of waiting at each for the host. At most one
        page more a sequence; not while anyone waits (the pages could start a sequence instead)."""
        for seq in self.running:
            ahead_pos = min(seq.seq_len - 1 + self.page_size, self.max_seq_length - 1)
            if not self.pages_fit(seq, ahead_pos) and self.can_hold(seq, seq.seq_len - 1, ahead_pos):
                self.hold(seq, seq.seq_len - 1, ahead_pos)

    def postprocess(self, sequences: list[Sequence], token_ids: list[int], logprobs, logits_NV=None) -> int:
        """Tokens out: each unfinished sequence takes its row's token (and its log-prob when it asks
        for them, its logits when it records them) and finishes at one of its end ids or its length
        limit. A row that finished a step earlier, riding along in a chained step, takes nothing.
        Returns the number of tokens taken."""
        num_taken = 0
        for i, seq in enumerate(sequences):
            if seq.finished:
                continue
            seq.output_ids.append(token_ids[i])
            if seq.sampling is not None and seq.sampling.is_logprobs:
                seq.output_logprobs.append(logprobs[i])
            if seq.record_logits:
                seq.output_logits.append(logits_NV[i].detach().float().cpu())
            if token_ids[i] in seq.end_ids:
                seq.finished, seq.finish_reason = True, "stop"
            elif self.is_at_length_limit(seq):
                seq.finished, seq.finish_reason = True, "length"
            num_taken += 1
        return num_taken

    def is_at_length_limit(self, seq: Sequence, num_more_tokens: int = 0) -> bool:
        """The length rule: whether `seq`, after `num_more_tokens` more, holds its max_new_tokens
        new tokens or max_seq_length tokens in all."""
        return (
            len(seq.output_ids) + num_more_tokens >= seq.max_new_tokens
            or seq.seq_len + num_more_tokens >= self.max_seq_length
        )

    def can_chain(self, min_live: int = 1) -> bool:
        """Whether the next decode step can be queued before the current one's tokens are read, for
        the same rows: at least `min_live` of them unfinished (a finished one rides along as a
        padding row until the chain ends; the caller says how many are worth the batch), every
        unfinished one's next position fits its pages, and no waiting sequence could start
        instead (on a free slot and pages, or on those the finished would give back)."""
        num_live = 0
        for seq in self.running:
            if seq.finished:
                continue
            # the chained step writes the K/V of the token the current step samples, at position seq_len
            if not self.pages_fit(seq, seq.seq_len):
                return False
            num_live += 1
        if num_live < min_live:
            return False
        return not (self.waiting and (num_live < len(self.running) or self.can_admit(self.waiting[0])))

    def abort(self) -> None:
        """Forgets every sequence, giving back all slots and pages (after an error or an interrupt, too)."""
        for seq in list(self.holders.values()):
            self.release(seq)
        self.running, self.waiting = [], deque()


class BatchSlots:
    """Hands out batch slots: the rows of every page table a sequence owns while it holds pages.
    Slot 0 is reserved for the padding rows of a decode batch."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots  # including the reserved slot 0
        self.free_slots = deque(range(1, num_slots))

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def can_allocate(self) -> bool:
        return len(self.free_slots) > 0

    def allocate(self) -> int:
        """Takes a free batch slot (never slot 0)."""
        return self.free_slots.popleft()

    def free(self, batch_idx: int) -> None:
        self.free_slots.append(batch_idx)


class PageTable:
    """Maps each batch slot's logical KV blocks to physical pages of one shared KV pool.

    Physical page 0 is reserved: every logical block of the padding slot 0 maps to it, so padding
    rows of a decode batch write their K/V somewhere harmless. Blocks a sliding window has left
    behind are trimmed: their pages go back to the pool and the block maps to page 0, which the
    slot does not own (so its mask_mod rejects it). The bookkeeping (free pages, each slot's pages)
    lives on the CPU; `flush()` mirrors the changes to the device tables in one copy each.
    """

    def __init__(self, page_size: int, n_pages: int, num_slots: int, max_seq_length: int, device):
        self.page_size = page_size
        self.n_pages = n_pages
        self.max_logical_blocks = max_seq_length // page_size
        self.device = torch.device(device)
        # logical_to_physical[batch_idx, logical_block_idx] -> physical_page_idx
        self.logical_to_physical_cpu = torch.zeros(num_slots, self.max_logical_blocks, dtype=torch.int32)
        # physical_to_logical[batch_idx, physical_page_idx] -> logical_block_idx, or -1 if not owned
        self.physical_to_logical_cpu = torch.full((num_slots, n_pages), -1, dtype=torch.int32)
        self.physical_to_logical_cpu[0, 0] = 0
        self.logical_to_physical = self.logical_to_physical_cpu.to(self.device)
        self.physical_to_logical = self.physical_to_logical_cpu.to(self.device)
        mark_compile_shapes("static", self.logical_to_physical, self.physical_to_logical)
        self.free_pages = deque(range(1, n_pages))
        # num_holders[physical_page_idx]: how many slots hold the page (n completions share their
        # prompt's pages); it returns to the pool when the last one lets go
        self.num_holders = [0] * n_pages
        # physical page of each logical block of each slot, in logical order; None once trimmed
        self.pages_of: list[list[int | None]] = [[] for _ in range(num_slots)]
        self.is_dirty = False

    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages)

    @property
    def num_used_pages(self) -> int:
        return self.n_pages - 1 - len(self.free_pages)

    @property
    def capacity(self) -> list[int]:
        """Tokens each slot's logical blocks cover (trimmed blocks included)."""
        return [len(pages) * self.page_size for pages in self.pages_of]

    def num_pages_of(self, batch_idx: int) -> int:
        return sum(page is not None for page in self.pages_of[batch_idx])

    def pages_needed(self, batch_idx: int | None, seq_len: int, first_needed_pos: int = 0) -> int:
        """New pages for slot `batch_idx` to cover `seq_len` tokens, skipping blocks wholly
        before `first_needed_pos` (a sliding window's left edge)."""
        num_blocks = 0 if batch_idx is None else len(self.pages_of[batch_idx])
        last_block = -(-seq_len // self.page_size)
        return max(0, last_block - max(num_blocks, first_needed_pos // self.page_size))

    def can_reserve(self, seq_len: int, batch_idx: int | None = None, first_needed_pos: int = 0) -> bool:
        """Whether slot `batch_idx` (None: a slot not yet allocated) could grow to `seq_len` tokens,
        recycling its blocks before `first_needed_pos` first."""
        recyclable = 0
        if batch_idx is not None:
            recyclable = sum(
                page is not None and self.num_holders[page] == 1
                for page in self.pages_of[batch_idx][: first_needed_pos // self.page_size]
            )
        return self.pages_needed(batch_idx, seq_len, first_needed_pos) <= len(self.free_pages) + recyclable

    def reserve(self, batch_idx: int, seq_len: int, first_needed_pos: int = 0) -> None:
        """Gives slot `batch_idx` pages for `seq_len` tokens (none for blocks before `first_needed_pos`)."""
        num_pages = self.pages_needed(batch_idx, seq_len, first_needed_pos)
        if num_pages > len(self.free_pages):
            raise RuntimeError(f"cannot reserve {num_pages} pages, only {len(self.free_pages)} are free")
        pages = self.pages_of[batch_idx]
        while len(pages) * self.page_size < seq_len:
            logical_block_idx = len(pages)
            if (logical_block_idx + 1) * self.page_size <= first_needed_pos:
                pages.append(None)  # already out of the window: never stored
                continue
            self._hold_page(batch_idx, logical_block_idx, self.free_pages.popleft())

    def share(self, src_batch_idx: int, dst_batch_idx: int, num_blocks: int) -> None:
        """Slot `dst_batch_idx` (holding nothing yet) takes slot `src_batch_idx`'s first `num_blocks`
        logical blocks, on the same physical pages."""
        for physical_page_idx in self.pages_of[src_batch_idx][:num_blocks]:
            if physical_page_idx is None:
                self.pages_of[dst_batch_idx].append(None)
            else:
                self._hold_page(dst_batch_idx, len(self.pages_of[dst_batch_idx]), physical_page_idx)

    def _hold_page(self, batch_idx: int, logical_block_idx: int, physical_page_idx: int) -> None:
        """Slot `batch_idx`'s next logical block `logical_block_idx` is held on `physical_page_idx`."""
        self.logical_to_physical_cpu[batch_idx, logical_block_idx] = physical_page_idx
        self.physical_to_logical_cpu[batch_idx, physical_page_idx] = logical_block_idx
        self.pages_of[batch_idx].append(physical_page_idx)
        self.num_holders[physical_page_idx] += 1
        self.is_dirty = True

    def trim(self, batch_idx: int, first_needed_pos: int) -> None:
        """Lets go of slot `batch_idx`'s blocks that end before `first_needed_pos`; a page goes
        back to the pool when its last holder lets go."""
        pages = self.pages_of[batch_idx]
        for logical_block_idx in range(min(first_needed_pos // self.page_size, len(pages))):
            physical_page_idx = pages[logical_block_idx]
            if physical_page_idx is not None:
                self.physical_to_logical_cpu[batch_idx, physical_page_idx] = -1
                self.logical_to_physical_cpu[batch_idx, logical_block_idx] = 0
                self.num_holders[physical_page_idx] -= 1
                if self.num_holders[physical_page_idx] == 0:
                    self.free_pages.append(physical_page_idx)
                pages[logical_block_idx] = None
                self.is_dirty = True

    def erase(self, batch_idx: int) -> None:
        """Lets go of all of slot `batch_idx`'s pages."""
        self.trim(batch_idx, len(self.pages_of[batch_idx]) * self.page_size)
        self.pages_of[batch_idx] = []

    def flush(self) -> None:
        """Copies the CPU bookkeeping to the device tables (in place: captured graphs read them)."""
        if self.is_dirty:
            self.logical_to_physical.copy_(self.logical_to_physical_cpu, non_blocking=True)
            self.physical_to_logical.copy_(self.physical_to_logical_cpu, non_blocking=True)
            self.is_dirty = False

    def physical_slots(self, batch_idx: int, start: int, end: int) -> list[int]:
        """Physical cache rows of logical positions [start, end) of slot `batch_idx` (row 0 of the
        reserved page for positions whose block is not stored)."""
        pages = self.pages_of[batch_idx]
        slots = []
        for pos in range(start, end):
            page = pages[pos // self.page_size]
            slots.append(0 if page is None else page * self.page_size + pos % self.page_size)
        return slots

    def decode_blocks(self, input_pos_B: torch.Tensor, batch_idx_B: torch.Tensor, sliding_window: int | None) -> tuple:
        """Each decode row's visible logical blocks (`visible_logical_blocks`) mapped to physical
        pages: (kv_num_blocks [B, 1, 1], kv_indices [B, 1, 1, n_pages]; only the first
        kv_num_blocks of each row are read), the block tensors of a PagedDecodeMask."""
        kv_num_blocks, logical_indices = visible_logical_blocks(
            input_pos_B, self.page_size, sliding_window, self.max_logical_blocks
        )
        B = input_pos_B.shape[0]
        logical_to_physical_BL = self.logical_to_physical[batch_idx_B]
        physical_BL = torch.gather(logical_to_physical_BL, 1, logical_indices.view(B, -1).long())
        # NOTE: the kernel checks kv_indices covers the whole KV length (n_pages blocks).
        physical_BP = nn.functional.pad(physical_BL, (0, self.n_pages - physical_BL.shape[1]))
        return kv_num_blocks, physical_BP.view(B, 1, 1, self.n_pages)


def pool_pages(n_pages: int, sliding_window: int | None, max_batch_size: int, page_size: int) -> int:
    """Pages of one attention regime's pool: `n_pages`, or for a sliding window only what
    `max_batch_size` sequences can hold at once (the window, the page being written, slack)."""
    if sliding_window is None:
        return n_pages
    pages_per_sequence = -(-sliding_window // page_size) + 2
    return min(n_pages, max_batch_size * pages_per_sequence + 1)


# n_pages None without a memory budget (auto): the full-attention pool on CUDA (sized for an H200),
# and on the CPU the share of the free RAM the pools may take at most (the rest is for activations
# and everything else).
CUDA_AUTO_N_PAGES = 2048
CPU_AUTO_MEMORY_FRACTION = 0.5


def kv_pool_pages(
    kv_heads: list[tuple[str, int, int] | None],
    sliding_windows: dict[str, int | None],
    n_pages: int | None,
    max_batch_size: int,
    max_seq_length: int,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_cache_gb: float | None = None,
    kv_cache_memory_fraction: float | None = None,
) -> dict[str, int]:
    """Pages of each attention regime's pool, checked against the device's free memory before any is allocated.

    `kv_heads` is the runner's `kv_cache_heads`: per layer, (regime, KV heads, head_dim) of the cache
    it owns, or None. n_pages is the full-attention pool's size; the sliding-window pools follow it
    (`pool_pages`). A memory budget, `kv_cache_gb` (GB of 1e9 bytes) or `kv_cache_memory_fraction`
    (a share of the device's free memory now), sets n_pages to the most pages whose pools together
    fit in it, up to what `max_batch_size` sequences of `max_seq_length` can hold (pages past that
    are never used); a budget that cannot hold one such sequence is refused. n_pages None without
    a budget is auto: CUDA_AUTO_N_PAGES on CUDA; elsewhere a budget of CPU_AUTO_MEMORY_FRACTION of
    the free memory, but one sequence at least.
    """
    # K and V bytes per token of each regime's pool, summed over the layers that own a cache
    bytes_per_token = dict.fromkeys(sliding_windows, 0)
    for heads in kv_heads:
        if heads is not None:
            regime, num_kv_heads, head_dim = heads
            bytes_per_token[regime] += 2 * num_kv_heads * kernel_head_dim(head_dim, device) * dtype.itemsize

    def pool_bytes(n: int) -> int:
        return sum(
            pool_pages(n, window, max_batch_size, page_size) * page_size * bytes_per_token[regime]
            for regime, window in sliding_windows.items()
        )

    one_sequence_pages = max_seq_length // page_size + 1  # page 0 is reserved
    all_sequences_pages = max_batch_size * (max_seq_length // page_size) + 1

    def pages_within(budget_bytes: float) -> int:
        """The most pages, up to all_sequences_pages, whose pools take at most budget_bytes
        (binary search: pool_bytes grows with n, and pool_bytes(0) is 0)."""
        low, high = 0, all_sequences_pages
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if pool_bytes(middle) <= budget_bytes else (low, middle - 1)
        return low

    free_bytes = free_memory_bytes(device)
    budget = kv_cache_budget(kv_cache_gb, kv_cache_memory_fraction, free_bytes, device)
    if budget is not None:
        budget_bytes, budget_text, budget_param = budget
        n_pages = pages_within(budget_bytes)
        if n_pages < one_sequence_pages:
            raise FlexInferenceError(
                f"a KV budget of {budget_bytes / 1e9:.3g} GB ({budget_text}) cannot hold one sequence of "
                f"max_seq_length {max_seq_length}, which needs {pool_bytes(one_sequence_pages) / 1e9:.3g} GB "
                f"({one_sequence_pages} pages of {page_size} tokens, page 0 reserved): raise {budget_param}, "
                "or lower max_seq_length",
                budget_param,
                "max_seq_length",
            )
    elif n_pages is None and device.type == "cuda":
        n_pages = CUDA_AUTO_N_PAGES
    elif n_pages is None:
        n_pages = all_sequences_pages
        if free_bytes is not None:
            n_pages = max(one_sequence_pages, pages_within(CPU_AUTO_MEMORY_FRACTION * free_bytes))
    needed_bytes = pool_bytes(n_pages)
    if free_bytes is not None and needed_bytes > free_bytes:
        raise FlexInferenceError(
            f"the KV pool (n_pages {n_pages} x page_size {page_size} tokens in every layer) needs "
            f"{needed_bytes / 1e9:.3g} GB but {device} has {free_bytes / 1e9:.3g} GB free: lower n_pages, "
            "or max_seq_length",
            "n_pages",
            "page_size",
            "max_seq_length",
        )
    return {regime: pool_pages(n_pages, w, max_batch_size, page_size) for regime, w in sliding_windows.items()}


def kv_cache_budget(
    kv_cache_gb: float | None, kv_cache_memory_fraction: float | None, free_bytes: int | None, device: torch.device
) -> tuple[float, str, str] | None:
    """The KV pool's memory budget: (bytes, how it was given, its parameter), or None when none is
    given. A budget in GB beyond the free memory is refused, as is a share of a device whose free
    memory is unknown."""
    if kv_cache_gb is not None:
        if free_bytes is not None and kv_cache_gb * 1e9 > free_bytes:
            raise FlexInferenceError(
                f"kv_cache_gb asks for {kv_cache_gb:g} GB of KV pool but {device} has {free_bytes / 1e9:.3g} GB "
                "free: lower kv_cache_gb",
                "kv_cache_gb",
            )
        return round(kv_cache_gb * 1e9), f"kv_cache_gb {kv_cache_gb:g}", "kv_cache_gb"
    if kv_cache_memory_fraction is not None:
        if free_bytes is None:
            raise FlexInferenceError(
                f"{device} does not report its free memory, so kv_cache_memory_fraction cannot size the KV "
                "pool: pass kv_cache_gb instead",
                "kv_cache_memory_fraction",
                "kv_cache_gb",
            )
        budget_text = f"kv_cache_memory_fraction {kv_cache_memory_fraction:g} of the {free_bytes / 1e9:.3g} GB free"
        return kv_cache_memory_fraction * free_bytes, budget_text, "kv_cache_memory_fraction"
    return None


def free_memory_bytes(device: torch.device) -> int | None:
    """Bytes `device` can still allocate, None where unknown: on CUDA the driver's free memory plus
    what PyTorch's caching allocator holds unused; on the CPU the kernel's MemAvailable (or the
    container's cgroup room, when smaller)."""
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        return free_bytes + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    try:
        match = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
        free_bytes = int(match.group(1)) * 1024
    except (OSError, AttributeError):
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            return None
    with contextlib.suppress(OSError, ValueError):
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            free_bytes = min(free_bytes, int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    return free_bytes


# ---------------------------------------------------------------------------------------------
# Model runner: packed prefill, the decode step, CUDA graphs
# ---------------------------------------------------------------------------------------------


class ModelPatches:
    """The engine's replacements of module forwards (paged attention, skinny GEMMs, fused
    projections, an unmerged adapter), in place only inside the engine's calls (`installed`).

    Outside them every module runs its own forward: HF generate works on the same model, and a
    trainer's forward and backward on the modules the engine shares (zero copy) are HF's own.
    """

    def __init__(self):
        self.forwards: dict[nn.Module, Callable] = {}  # module -> its forward inside the engine's calls
        self.attributes: dict[nn.Module, dict] = {}  # module -> what its forward reads from it, set with it
        self.depth = 0  # nested installs: only the outermost installs and removes
        self.own_forwards: dict[nn.Module, Callable | None] = {}  # what an install replaced (None: the class's)

    def replace_forward(self, module: nn.Module, forward: Callable, **attributes) -> None:
        """`forward` is a function bound to `module` (`fn.__get__(module)`) that reads what differs
        between modules (`attributes`) from the module: torch.compile then traces one graph for
        all layers of a kind, where a closure or a functools.partial would be guarded by identity
        and compiled once per module."""
        self.forwards[module] = forward
        self.attributes[module] = {**self.attributes.get(module, {}), **attributes}  # a later patch may wrap this one

    def forward_of(self, module: nn.Module) -> Callable:
        """The forward `module` runs inside the engine's calls: its replacement, or its own."""
        return self.forwards.get(module) or module.forward

    @contextlib.contextmanager
    def installed(self):
        if self.depth == 0:
            self.own_forwards = {module: module.__dict__.get("forward") for module in self.forwards}
            for module, forward in self.forwards.items():
                module.__dict__["forward"] = forward
                module.__dict__.update(self.attributes[module])
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0:
                for module, forward in self.own_forwards.items():
                    for name in self.attributes[module]:
                        del module.__dict__[name]
                    if forward is None:
                        del module.__dict__["forward"]
                    else:
                        module.__dict__["forward"] = forward


class ModelRunner:
    """Runs the model over the paged KV cache: packed prefill, and the decode step (eager,
    compiled by regions, or replayed from a CUDA graph per batch bucket).

    It patches the HF model's attention to attend over the paged cache and otherwise runs HF's own
    decoder layers; its patches (`ModelPatches`) are in place only inside the engine's calls. The
    model-specific hooks (`attention_layers`, `kv_cache_heads`, `patch_attention`, `embed`,
    `layer_kwargs`, `prefill_hidden`, `logits`) serve Qwen3 and Llama; `Gemma4ModelRunner` overrides
    them.
    """

    # every packed prefill row is at least 2 of the masks' 128-token blocks: torch.compile specializes
    # a size of 1, so a 1-block row would compile prefill attention apart
    min_packed_tokens = 256

    def __init__(
        self,
        causal_lm: nn.Module,
        page_tables: dict[str, PageTable],
        sliding_windows: dict[str, int | None],
        max_batch_size: int,
        max_prefill_tokens: int,
        decode_kernel_options: dict | None = None,
        prefill_kernel_options: dict | None = None,
        fa4_prefill: bool | None = None,
        compile_decode: bool = False,
        fuse_projections: bool = False,
        skinny_gemms: bool = True,
        is_lora_merged: bool = False,
        unmerged_lora_layers: dict[str, nn.Module] | None = None,
        decode_attention: str | None = None,
        is_sleep_mode: bool = False,
    ):
        self.causal_lm = causal_lm
        self.decoder = causal_lm.model
        self.config = causal_lm.config
        self.page_tables = page_tables  # attention regime -> page table (the scheduler's; flushed here)
        self.sliding_windows = sliding_windows  # attention regime -> window (None: full causal)
        self.page_size = next(iter(page_tables.values())).page_size
        self.max_batch_size = max_batch_size  # the most sequences in one step, prefill or decode
        self.max_packed_tokens = max(
            self.min_packed_tokens, -(-max_prefill_tokens // 128) * 128
        )  # the longest packed row
        self.device = next(causal_lm.parameters()).device
        self.dtype = self.decoder.embed_tokens.weight.dtype
        self.kv_memory = KVMemory(self.device, is_sleep_mode)
        self.kv_caches = self.build_kv_caches()
        # each layer's attention regime: the pool its cache's pages come from
        self.cache_regimes = [getattr(attn, "layer_type", FULL_ATTENTION) for attn in self.attention_layers()]
        head_dims = sorted({attn.head_dim for attn in self.attention_layers()})
        cache_head_dims = {cache.k_cache.shape[-1] for cache in self.kv_caches if cache is not None}
        self.fa4_prefill = resolve_fa4_prefill(fa4_prefill, cache_head_dims, self.device)
        self.kernel_options = {
            head_dim: KernelOptions.pick(
                head_dim,
                self.device,
                self.dtype,
                self.page_size,
                self.fa4_prefill,
                prefill_kernel_options,
                decode_kernel_options,
            )
            for head_dim in head_dims
        }
        self.decode_attention = resolve_decode_attention(decode_attention, self.device)
        if self.device.type == "cuda" and triton is not None:
            use_inductors_ptxas()
        self.patches = ModelPatches()
        self.patch_attention()
        # fused projections with an unmerged adapter: the engine's copies of its A and B, by target name
        self.fused_lora_weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if fuse_projections:
            self.fused_lora_weights = fuse_decoder_projections(
                causal_lm, is_lora_merged, unmerged_lora_layers or {}, self.patches
            )
        if skinny_gemms:
            route_linears_through_skinny([*self.decoder.modules(), causal_lm.lm_head], self.patches)

        # compile_decode: the decode step is compiled by regions, each with a symbolic batch size so
        # one compile serves every bucket: the prologue (masks, cache slots, embeddings), one
        # decoder layer, the epilogue (final norm, logits, greedy tokens). Norms, RoPE, residuals
        # and PLE fuse inside a layer, and layers of one kind share a compiled graph; a whole-step
        # graph took far longer to compile (scripts/benchmarks/README.md). CUDA graphs then capture
        # the step per bucket.
        # NOTE: torch.compile specializes a size of 1, so the compiled step's buckets start at 2 (a
        # single sequence decodes beside one padding row): one compile instead of two.
        self.compile_decode = compile_decode
        compile_region = (
            (lambda fn: torch.compile(fn, fullgraph=True, dynamic=False)) if compile_decode else (lambda fn: fn)
        )
        self.decode_prologue = compile_region(self._decode_prologue)
        self.decode_layer = compile_region(call_layer)
        self.decode_epilogue = compile_region(self._decode_epilogue)
        self.decode_sampling_epilogue = compile_region(self._decode_sampling_epilogue)
        # NOTE: a region of its own: Triton 3.6 (torch 2.11) fails to build the sampling reduction
        # when that kernel also writes its tokens as float64 (TritonGPURemoveLayoutConversions:
        # "operand does not dominate this use"; Triton 3.9 builds it).
        self.pack_samples = compile_region(pack_samples)
        self.buckets = batch_buckets(max_batch_size, smallest=2 if compile_decode else 1)
        # Static decode inputs, read in place by the CUDA graphs: token ids, positions, batch slots
        # (rows 0..B-1 of each).
        self.static_step_inputs = torch.zeros(3, max_batch_size, dtype=torch.long, device=self.device)
        # Static sampling inputs per row: temperature, top_p, min_p; top_k, seed.
        self.static_sampling_float = torch.zeros(max_batch_size, 3, device=self.device)
        self.static_sampling_int = torch.zeros(max_batch_size, 2, dtype=torch.long, device=self.device)
        # Two host buffers for sampled tokens: one being read while the next step fills the other.
        is_pinned = self.device.type == "cuda"
        self.host_next_ids = torch.zeros(2, max_batch_size, dtype=torch.long, pin_memory=is_pinned)
        # The same for sampling steps: tokens and their log-probs, as float64 (exact for both).
        self.host_samples = torch.zeros(2, 2, max_batch_size, dtype=torch.float64, pin_memory=is_pinned)
        self.num_decode_launches = 0
        # (bucket, sampling mode) -> (graph, next_ids [bucket], host copy source, logits [bucket, V])
        self.cuda_graphs: dict[tuple[int, str], tuple] = {}
        self.graph_pool = None

    # --- model-specific hooks (Gemma4ModelRunner overrides these) --------------------------

    def attention_layers(self) -> list[nn.Module]:
        return [layer.self_attn for layer in self.decoder.layers]

    @staticmethod
    def kv_cache_heads(causal_lm: nn.Module) -> list[tuple[str, int, int] | None]:
        """Per layer, the cache it owns: (the attention regime whose pool its pages come from, KV
        heads, head_dim), or None for a layer that reads another layer's cache. Static: the engine
        sizes the pools from it before the runner exists."""
        num_kv_heads = causal_lm.config.num_key_value_heads
        return [(FULL_ATTENTION, num_kv_heads, layer.self_attn.head_dim) for layer in causal_lm.model.layers]

    def build_kv_caches(self) -> list[PagedKVCache | None]:
        """One paged cache per layer that owns one (`kv_cache_heads`), over its regime's pool."""
        return [
            None
            if heads is None
            else PagedKVCache(
                self.page_tables[heads[0]].n_pages, self.page_size, *heads[1:], self.dtype, self.device, self.kv_memory
            )
            for heads in self.kv_cache_heads(self.causal_lm)
        ]

    def patch_attention(self) -> None:
        if any(window is not None for window in self.sliding_windows.values()):
            raise FlexInferenceError(
                "this checkpoint has sliding-window layers, which the Qwen3/Llama walker does not run"
            )
        for attn in self.attention_layers():
            self.patches.replace_forward(attn, qwen3_llama_attention_forward.__get__(attn))

    def embed(self, input_ids_BS: torch.Tensor, position_ids_BS: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The token embeddings [B, S, hidden] and what the layers read besides (RoPE cos/sin)."""
        hidden_BSE = self.decoder.embed_tokens.forward(
            input_ids_BS
        )  # not __call__: no trainer hook (enable_input_require_grads)
        return hidden_BSE, {"position_embeddings": self.decoder.rotary_emb(hidden_BSE, position_ids_BS)}

    def layer_kwargs(self, layer_idx: int, layer_inputs: dict, step: PrefillStep | DecodeStep) -> dict:
        """Decoder layer `layer_idx`'s keyword arguments besides its hidden states."""
        return dict(
            position_embeddings=layer_inputs["position_embeddings"],
            attention_mask=None,
            layer_step=step.for_layer(layer_idx),
        )

    def prefill_hidden(self, input_ids_1T, position_ids_1T, step: PrefillStep, last_positions_N) -> torch.Tensor:
        """Hidden states [1, N, hidden] at each packed sequence's last position."""
        return self.forward_hidden(input_ids_1T, position_ids_1T, step)[:, last_positions_N]

    def logits(self, hidden_NE: torch.Tensor) -> torch.Tensor:
        return self.final_logits(self.causal_lm.lm_head(hidden_NE))

    def final_logits(self, head_out_NV: torch.Tensor) -> torch.Tensor:
        """float32 logits from the lm_head's output (in the model's dtype)."""
        return head_out_NV.float()

    # --- the layer walk ----------------------------------------------------------------------

    def run_layers(self, hidden_BSE, layer_inputs: dict, step, layer_indices: range, run_layer=None) -> torch.Tensor:
        """Runs decoder layers `layer_indices` in order through `run_layer` (default: HF's own
        forward); returns their output."""
        run_layer = run_layer or call_layer
        for layer_idx in layer_indices:
            hidden_BSE = run_layer(
                self.decoder.layers[layer_idx], hidden_BSE, **self.layer_kwargs(layer_idx, layer_inputs, step)
            )
        return hidden_BSE

    def forward_hidden(self, input_ids_BS: torch.Tensor, position_ids_BS: torch.Tensor, step) -> torch.Tensor:
        """Walks every decoder layer. Returns the final-normed hidden states [B, S, hidden]."""
        hidden_BSE, layer_inputs = self.embed(input_ids_BS, position_ids_BS)
        hidden_BSE = self.run_layers(hidden_BSE, layer_inputs, step, range(len(self.decoder.layers)))
        return self.decoder.norm(hidden_BSE)

    @property
    def kv_bytes_per_token(self) -> int:
        return sum(cache.bytes_per_token for cache in self.kv_caches if cache is not None)

    @property
    def kv_pool_bytes(self) -> int:
        """Bytes of every layer's K and V pool together."""
        return sum(cache.k_cache.nbytes + cache.v_cache.nbytes for cache in self.kv_caches if cache is not None)

    def flush_page_tables(self) -> None:
        for table in self.page_tables.values():
            table.flush()

    # --- packed prefill ------------------------------------------------------------------------

    def pack(self, sequences: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, PrefillStep]:
        """Packs all `sequences` (already holding pages) into one prefill row.

        Returns input_ids [1, T], position_ids [1, T] and the PrefillStep; T is padded to a multiple
        of 128, and to at least `min_packed_tokens`, so that one compiled attention kernel serves
        every length. Padding is a document of its own and writes into the reserved page 0.
        """
        regimes = list(self.page_tables)
        token_ids, position_ids, document_ids = [], [], []
        physical_slots = {regime: [] for regime in regimes}
        for doc_idx, seq in enumerate(sequences):
            ids = seq.token_ids
            token_ids += ids
            position_ids += range(len(ids))
            document_ids += [doc_idx] * len(ids)
            for regime, table in self.page_tables.items():
                physical_slots[regime] += table.physical_slots(seq.batch_idx, 0, len(ids))
        num_tokens = max(self.min_packed_tokens, len(token_ids) + -len(token_ids) % 128)
        num_padding = num_tokens - len(token_ids)
        token_ids += [0] * num_padding
        position_ids += [0] * num_padding
        # One host->device copy for the step inputs, [2 + regimes, T], one for the document ids.
        rows = [token_ids, position_ids] + [physical_slots[r] + [0] * num_padding for r in regimes]
        inputs_RT = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
        document_ids += [len(sequences)] * (self.max_packed_tokens - len(document_ids))
        document_id_C = torch.tensor(document_ids, dtype=torch.long).to(self.device, non_blocking=True)
        self.flush_page_tables()
        step = PrefillStep(
            block_masks=packed_block_masks(document_id_C, num_tokens, self.sliding_windows, self.device),
            physical_slots={regime: inputs_RT[2 + i] for i, regime in enumerate(regimes)},
            kv_caches=self.kv_caches,
            packed_kv=[None if cache is None else PackedKV() for cache in self.kv_caches],
            kernel_options=self.kernel_options,
            document_id_C=document_id_C,
            num_tokens=num_tokens,
        )
        return inputs_RT[0:1], inputs_RT[1:2], step

    def prefill(self, sequences: list[Sequence]) -> torch.Tensor:
        """Runs the admitted `sequences` in one packed row, writing their K/V; returns the logits
        at each one's last position [N, V]."""
        input_ids_1T, position_ids_1T, step = self.pack(sequences)
        last_positions_N = torch.tensor(sequences_last_positions(sequences), device=self.device)
        return self.logits(self.prefill_hidden(input_ids_1T, position_ids_1T, step, last_positions_N)[0])

    def prefill_with_forks(self, admitted: list[Sequence], forks: list[tuple[Sequence, Sequence]]) -> torch.Tensor:
        """Prefills the `admitted` sequences; each fork (sequence, its prompt's source) gets its
        source's partial last page and last logits. Returns the logits of admitted + forks [N, V]."""
        logits_NV = self.prefill(admitted)
        if not forks:
            return logits_NV
        self.copy_partial_pages(forks)
        source_rows = [next(i for i, seq in enumerate(admitted) if seq is source) for _, source in forks]
        return torch.cat([logits_NV, logits_NV[source_rows]])

    def sample(self, logits_NV: torch.Tensor, sequences: list[Sequence]) -> tuple[list[int], list[float] | None]:
        """Each sequence's next token from its logits row, and its log-prob (None when no row
        samples or records them), copied to the host in one go."""
        mode = sampling_mode(sequences)
        if mode == GREEDY_MODE:
            return logits_NV.argmax(-1).tolist(), None
        float_params_N3, int_params_N2 = sampling_inputs(sequences, len(sequences))
        position_N = torch.tensor([seq.seq_len for seq in sequences])
        tokens_N, logprobs_N = sample_tokens(
            logits_NV, *(t.to(self.device) for t in (float_params_N3, int_params_N2, position_N)), mode == FILTERED_MODE
        )
        samples_2N = torch.stack([tokens_N.double(), logprobs_N.double()]).cpu()
        return samples_2N[0].long().tolist(), samples_2N[1].tolist()

    def copy_partial_pages(self, forks: list[tuple[Sequence, Sequence]]) -> None:
        """Each fork's partial last prompt page gets the K/V its source's holds, in every cache
        (the full pages are shared; the partial one is the fork's own, as it writes there next)."""
        for regime, table in self.page_tables.items():
            src_rows, dst_rows = [], []
            for seq, source in forks:
                last_block = seq.seq_len // self.page_size
                if seq.seq_len % self.page_size:
                    src_page, dst_page = (
                        table.pages_of[source.batch_idx][last_block],
                        table.pages_of[seq.batch_idx][last_block],
                    )
                    src_rows += range(src_page * self.page_size, (src_page + 1) * self.page_size)
                    dst_rows += range(dst_page * self.page_size, (dst_page + 1) * self.page_size)
            if not src_rows:
                continue
            src_rows, dst_rows = torch.tensor(src_rows, device=self.device), torch.tensor(dst_rows, device=self.device)
            for cache, cache_regime in zip(self.kv_caches, self.cache_regimes):
                if cache is not None and cache_regime == regime:
                    cache.k_cache[:, :, dst_rows] = cache.k_cache[:, :, src_rows]
                    cache.v_cache[:, :, dst_rows] = cache.v_cache[:, :, src_rows]

    def score(self, sequences: list[Sequence]) -> torch.Tensor:
        """Teacher-forced logits [T, V] of the packed row of `sequences` (padding included)."""
        return self.logits(self.forward_hidden(*self.pack(sequences))[0])

    # --- the decode step -----------------------------------------------------------------------

    def _decode_prologue(self, input_ids_B, input_pos_B, batch_idx_B) -> tuple[dict, torch.Tensor, dict]:
        """The decode step before the layers. Returns, per regime, the rows' visible pages
        (kv_num_blocks, kv_indices) and cache slots; the embeddings [B, 1, hidden]; the layer inputs."""
        regime_tensors = {}
        for regime, table in self.page_tables.items():
            kv_num_blocks, kv_indices = table.decode_blocks(input_pos_B, batch_idx_B, self.sliding_windows[regime])
            # logical_to_physical[batch_idx, logical_block] -> physical_page; cache row = page * page_size + offset
            physical_page_B = table.logical_to_physical[batch_idx_B, input_pos_B // self.page_size].long()
            regime_tensors[regime] = (
                kv_num_blocks,
                kv_indices,
                physical_page_B * self.page_size + input_pos_B % self.page_size,
            )
        hidden_B1E, layer_inputs = self.embed(input_ids_B[:, None], input_pos_B[:, None])
        return regime_tensors, hidden_B1E, layer_inputs

    # NOTE: the decode epilogues return the lm_head's output, not the float32 logits: the token
    # choice reads those logits inside its fused reductions, and a step's float32 logits (268 MB at
    # 256 rows of Gemma's 262,144 entries) would otherwise be written for record_logits alone,
    # which applies final_logits to the rows it keeps (scripts/benchmarks/README.md, round 2).
    def _decode_epilogue(self, hidden_B1E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Final norm, greedy tokens [B] and the lm_head's output [B, V]."""
        head_out_BV = self.causal_lm.lm_head(self.decoder.norm(hidden_B1E)[:, -1])
        return first_argmax(self.final_logits(head_out_BV)), head_out_BV

    def _decode_sampling_epilogue(
        self, hidden_B1E, float_params_B3, int_params_B2, input_pos_B, is_filtered: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Final norm, sampled tokens [B] with their log-probs [B], and the lm_head's output [B, V]."""
        head_out_BV = self.causal_lm.lm_head(self.decoder.norm(hidden_B1E)[:, -1])
        logits_BV = self.final_logits(head_out_BV)
        tokens_B, logprobs_B = sample_tokens(logits_BV, float_params_B3, int_params_B2, input_pos_B + 1, is_filtered)
        return tokens_B, logprobs_B, head_out_BV

    def _run_decode_layer(self, layer: nn.Module, hidden_B1E: torch.Tensor, **layer_kwargs) -> torch.Tensor:
        """One decoder layer of the decode step (compiled: its batch-sized inputs marked symbolic)."""
        layer_tensors = [t for t in torch.utils._pytree.tree_leaves(layer_kwargs) if isinstance(t, torch.Tensor)]
        mark_compile_shapes("batch", hidden_B1E, *layer_tensors, is_batch_symbolic=self.compile_decode)
        return self.decode_layer(layer, hidden_B1E, **layer_kwargs)

    def _decode_step(self, input_ids_B, input_pos_B, batch_idx_B, mode: str = GREEDY_MODE) -> tuple:
        """One token for every row: tensor ops only (no host sync), so it can be graph-captured.
        `mode` (sampling_mode): greedy, or sampling with the static sampling inputs.

        Returns (next_ids [B], what the host copies: next_ids or [2, B] tokens and log-probs, the
        lm_head's output [B, V]).
        """
        # NOTE: no duck sizing while the regions compile: it makes one symbol of every two sizes
        # that happen to be equal (a PLE slice's storage offset and a batch slot row's, say), and
        # the next layer or bucket then fails the guard and compiles again.
        with fx_config.patch(use_duck_shape=False) if self.compile_decode else contextlib.nullcontext():
            regime_tensors, hidden_B1E, layer_inputs = self.decode_prologue(input_ids_B, input_pos_B, batch_idx_B)
            masks, physical_slots = {}, {}
            for regime, (kv_num_blocks, kv_indices, physical_slots_B) in regime_tensors.items():
                mark_compile_shapes("static_batch", kv_num_blocks, kv_indices, is_batch_symbolic=self.compile_decode)
                mark_compile_shapes("batch", physical_slots_B, is_batch_symbolic=self.compile_decode)
                table = self.page_tables[regime]
                masks[regime] = PagedDecodeMask(
                    kv_num_blocks,
                    kv_indices,
                    input_pos_B,
                    batch_idx_B,
                    table.physical_to_logical,
                    self.page_size,
                    self.sliding_windows[regime],
                )
                physical_slots[regime] = physical_slots_B
            step = DecodeStep(masks, physical_slots, self.kv_caches, self.kernel_options, self.decode_attention)
            hidden_B1E = self.run_layers(
                hidden_B1E, layer_inputs, step, range(len(self.decoder.layers)), self._run_decode_layer
            )
            mark_compile_shapes("batch", hidden_B1E, is_batch_symbolic=self.compile_decode)
            if mode == GREEDY_MODE:
                next_ids_B, head_out_BV = self.decode_epilogue(hidden_B1E)
                return next_ids_B, next_ids_B, head_out_BV
            bucket = input_ids_B.shape[0]
            float_params_B3, int_params_B2 = self.static_sampling_float[:bucket], self.static_sampling_int[:bucket]
            mark_compile_shapes("batch", float_params_B3, int_params_B2, is_batch_symbolic=self.compile_decode)
            next_ids_B, logprobs_B, head_out_BV = self.decode_sampling_epilogue(
                hidden_B1E, float_params_B3, int_params_B2, input_pos_B, mode == FILTERED_MODE
            )
            mark_compile_shapes("batch", next_ids_B, logprobs_B, is_batch_symbolic=self.compile_decode)
            return next_ids_B, self.pack_samples(next_ids_B, logprobs_B), head_out_BV

    def _static_step_inputs(self, bucket: int) -> list[torch.Tensor]:
        """Rows 0..bucket-1 of the static token ids, positions and batch slots."""
        input_ids_B, input_pos_B, batch_idx_B = self.static_step_inputs[:, :bucket]
        mark_compile_shapes("batch", input_ids_B, is_batch_symbolic=self.compile_decode)
        # positions and slots also cross into flex_attention (its mask_mod reads them)
        mark_compile_shapes("static_batch", input_pos_B, batch_idx_B, is_batch_symbolic=self.compile_decode)
        return [input_ids_B, input_pos_B, batch_idx_B]

    def launch_decode(
        self, rows: list[Sequence], use_graph: bool, previous: DecodeLaunch | None = None
    ) -> DecodeLaunch:
        """Queues one decode step for `rows` and returns without waiting for it.

        Fresh steps take their inputs from the host bookkeeping. A chained step (`previous`, the
        step just queued for the same rows) takes the tokens `previous` sampled, on the device, one
        position further: the GPU runs it while the host reads and books `previous`'s tokens.
        """
        B = len(rows)
        # Eager decode pads to the same buckets as the graphs: one compiled kernel per bucket.
        bucket = next(b for b in self.buckets if b >= B)
        mode = sampling_mode(rows) if previous is None else previous.mode  # a chained step's rows are the same
        if previous is None:
            # Rows: last token, its position, batch slot; padding rows aim at the reserved slot 0.
            padding = [0] * (bucket - B)
            step_inputs = torch.tensor([
                [seq.output_ids[-1] for seq in rows] + padding,  # a running sequence has output
                [seq.seq_len - 1 for seq in rows] + padding,
                [seq.batch_idx for seq in rows] + padding,
            ])  # fmt: skip
            self.flush_page_tables()
            self.static_step_inputs[:, :bucket].copy_(step_inputs, non_blocking=True)
            if mode != GREEDY_MODE:
                float_params_B3, int_params_B2 = sampling_inputs(rows, bucket)
                self.static_sampling_float[:bucket].copy_(float_params_B3, non_blocking=True)
                self.static_sampling_int[:bucket].copy_(int_params_B2, non_blocking=True)
        else:
            self.static_step_inputs[0, :B].copy_(previous.next_ids[:B])
            self.static_step_inputs[1, :B] += 1
            finished = [i for i, seq in enumerate(rows) if seq.finished]
            if finished:  # they ride along as padding rows (token 0 at position 0 of slot 0: page 0)
                self.static_step_inputs.index_fill_(1, torch.tensor(finished, device=self.device), 0)
        if use_graph:
            graph, next_ids, host_source, head_out = self.cuda_graphs[bucket, mode]
            graph.replay()
        else:
            next_ids, host_source, head_out = self._decode_step(*self._static_step_inputs(bucket), mode)
        # The tokens go to a host buffer of their own: a chained step overwrites a graph's outputs.
        host_buffers = self.host_next_ids if mode == GREEDY_MODE else self.host_samples
        host_out = host_buffers[self.num_decode_launches % 2][..., :B]
        self.num_decode_launches += 1
        host_out.copy_(host_source[..., :B], non_blocking=True)
        is_done = None
        if self.device.type == "cuda":
            is_done = torch.cuda.Event()
            is_done.record()
        # a copy: the next replay overwrites the graph's output
        logits_BV = self.final_logits(head_out[:B].clone()) if any(seq.record_logits for seq in rows) else None
        return DecodeLaunch(rows, mode, next_ids, host_out, is_done, logits_BV)

    def capture_cuda_graphs(self, buckets: list[int] | None = None, modes=(GREEDY_MODE,)) -> dict[tuple, float]:
        """One graph per batch bucket (default: all) and sampling mode, largest first, all in one
        memory pool. Returns the seconds each newly captured graph took (warm-up included)."""
        if self.device.type != "cuda":
            raise FlexInferenceError("CUDA graphs need a CUDA device", "capture_cudagraph")
        keys = [(b, mode) for mode in modes for b in (buckets or self.buckets) if (b, mode) not in self.cuda_graphs]
        self.flush_page_tables()
        graph_s = {}
        with programmatic_launch_settings():
            for bucket, mode in sorted(keys, reverse=True):
                graph_s[bucket, mode] = self._capture_cuda_graph(bucket, mode)
        if graph_s:
            torch.cuda.synchronize()
        return graph_s

    def drop_cuda_graphs(self) -> None:
        """Forgets every captured graph (and their memory pool): the next generate captures again."""
        self.cuda_graphs.clear()
        self.graph_pool = None

    def graph_pool_bytes(self) -> int:
        """Device memory the captured graphs' pool holds (its segments, in use or kept for the next
        replay): it stays held while the engine sleeps, since freeing it would force a recapture."""
        if self.graph_pool is None:
            return 0
        pool = tuple(self.graph_pool)
        return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot() if tuple(seg["segment_pool_id"]) == pool)

    def _capture_cuda_graph(self, bucket: int, mode: str) -> float:
        """Captures the decode graph of one bucket and mode; returns its seconds (warm-up included)."""
        start = time.perf_counter()
        self.static_step_inputs[:, :bucket].zero_()  # every row a padding row: slot 0, page 0
        self.static_sampling_float[:bucket], self.static_sampling_int[:bucket] = sampling_inputs([], bucket)
        step_inputs = self._static_step_inputs(bucket)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # eager warm-up compiles this bucket's kernels
            self._decode_step(*step_inputs, mode)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            outputs = self._decode_step(*step_inputs, mode)
        self.graph_pool = graph.pool()
        self.cuda_graphs[bucket, mode] = (graph, *outputs)
        return time.perf_counter() - start


@dataclass
class DecodeLaunch:
    """A decode step queued on the device; `read()` waits for its sampled tokens."""

    rows: list[Sequence]
    mode: str  # sampling_mode of the rows
    next_ids: torch.Tensor  # [bucket] on the device
    # host buffer (pinned on CUDA) the step's output is copied into: tokens [B] (greedy), or
    # tokens and log-probs [2, B] as float64 (sampling)
    host_out: torch.Tensor
    is_done: torch.cuda.Event | None  # None on the CPU, where every copy is synchronous
    logits_BV: torch.Tensor | None  # kept only when a row records its logits

    def read(self) -> tuple[list[int], list[float] | None]:
        """The step's tokens and their log-probs (None for a greedy step)."""
        if self.is_done is not None:
            self.is_done.synchronize()  # the one device->host sync per decode step
        if self.host_out.dim() == 1:
            return self.host_out.tolist(), None
        return self.host_out[0].long().tolist(), self.host_out[1].tolist()


def sampling_mode(sequences: list[Sequence]) -> str:
    """How a step over `sequences` picks tokens: greedy (every row greedy without log-probs: the
    plain argmax step), filtered (a sampling row uses top-k, top-p or min-p), or sample."""
    params = [seq.sampling or GREEDY for seq in sequences]
    if any(p.is_filtered and not p.is_greedy for p in params):
        return FILTERED_MODE
    if any(not p.is_greedy or p.is_logprobs for p in params):
        return SAMPLE_MODE
    return GREEDY_MODE


def sampling_inputs(sequences: list[Sequence], num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' sampling parameters, padded to `num_rows` with greedy rows: (temperature, top_p,
    min_p) [num_rows, 3] and (top_k, seed) [num_rows, 2], on the CPU."""
    float_rows, int_rows = [], []
    for seq in sequences:
        params = seq.sampling or GREEDY
        float_rows.append([params.temperature, params.top_p, params.min_p])
        int_rows.append([params.top_k, seq.seed])
    padding = num_rows - len(sequences)
    float_rows += [[0.0, 1.0, 0.0]] * padding
    int_rows += [[0, 0]] * padding
    return torch.tensor(float_rows, dtype=torch.float32), torch.tensor(int_rows, dtype=torch.long)


def sequences_last_positions(sequences: list[Sequence]) -> list[int]:
    """Index of each sequence's last token in the packed prefill row."""
    ends, total = [], 0
    for seq in sequences:
        total += seq.seq_len
        ends.append(total - 1)
    return ends


def batch_buckets(max_batch_size: int, smallest: int = 1) -> list[int]:
    """smallest, 2 * smallest, ... up to max_batch_size (always included)."""
    buckets, size = [], min(smallest, max_batch_size)
    while size < max_batch_size:
        buckets.append(size)
        size *= 2
    return buckets + [max_batch_size]


def call_layer(layer: nn.Module, hidden_states: torch.Tensor, **layer_kwargs) -> torch.Tensor:
    """One decoder layer (HF's own forward). With compile_decode the runner compiles this once:
    layers of one kind (same shapes and attention regime) then share one compiled graph.

    NOTE: its forward, not its __call__: a trainer's model (zero copy) in train mode with gradient
    checkpointing on (TRL's default) would wrap the layer in torch.utils.checkpoint there."""
    return layer.forward(hidden_states, **layer_kwargs)


# ---------------------------------------------------------------------------------------------
# Attention over the paged cache: per-step views, the KV cache, block masks, the decode op
# ---------------------------------------------------------------------------------------------


@dataclass
class PackedKV:
    """Prefill: the fresh K/V [1, H_kv, T, D] a cache-owning layer wrote. Its own queries attend
    over it, and so do the KV-shared layers that read that layer's cache (Gemma-4): this holder is
    the writer's output and their input."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None


@dataclass
class PrefillStep:
    """A packed prefill as the layers see it: every admitted prompt in one row ([1, H, T, D]),
    attending over its own fresh K/V with a document-causal mask."""

    block_masks: dict[str, BlockMask]  # attention regime -> mask over the packed row
    physical_slots: dict[str, torch.Tensor]  # attention regime -> [T] cache row of every packed token
    kv_caches: list[PagedKVCache | None]  # per layer; None for layers that own no cache
    packed_kv: list[PackedKV | None]  # per layer, beside its cache
    kernel_options: dict[int, KernelOptions]  # head_dim -> options
    document_id_C: torch.Tensor  # [max_packed_tokens]: which sequence each packed token belongs to (padding after T)
    num_tokens: int  # T, the packed row's length

    def for_layer(self, cache_layer_idx: int, regime: str = FULL_ATTENTION) -> PrefillLayerStep:
        """The step as one layer sees it: the cache it writes (or, KV-shared, reads) and its regime's mask."""
        return PrefillLayerStep(
            self.kv_caches[cache_layer_idx],
            self.packed_kv[cache_layer_idx],
            self.block_masks[regime],
            self.physical_slots[regime],
            self.kernel_options,
        )


@dataclass
class PrefillLayerStep:
    """One layer's view of a PrefillStep; the patched attention calls `attend`."""

    cache: PagedKVCache
    packed_kv: PackedKV
    block_mask: BlockMask
    physical_slots: torch.Tensor  # [T] cache row of every packed token
    kernel_options: dict[int, KernelOptions]

    def attend(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, scale: float) -> torch.Tensor:
        """Writes k/v into the cache and the packed K/V (None: a KV-shared layer, which reads its
        store layer's), then flex-attends over the packed K/V.

        q: [1, H, T, D]; k, v: [1, H_kv, T, D]; returns [1, H, T, D]. The packed K/V is kept at the
        cache's head dim (`kernel_head_dim`), so the KV-shared layers read it padded already.
        """
        if k is not None:
            padded_head_dim = self.cache.k_cache.shape[-1]
            k, v = pad_head_dim(k, padded_head_dim), pad_head_dim(v, padded_head_dim)
            self.cache.write(k, v, self.physical_slots)
            self.packed_kv.k, self.packed_kv.v = k, v
        k, v = self.packed_kv.k, self.packed_kv.v
        options = self.kernel_options[q.shape[-1]].prefill
        return flex_attention_padded(q, k, v, self.block_mask, scale, options, shape_role="packed")


@dataclass
class DecodeStep:
    """A decode step as the layers see it: one query token per row ([B, H, 1, D]), attending over
    the paged cache."""

    masks: dict[str, PagedDecodeMask]  # attention regime -> the rows' visible pages
    physical_slots: dict[str, torch.Tensor]  # attention regime -> [B] cache row of each row's token
    kv_caches: list[PagedKVCache | None]  # per layer; None for layers that own no cache
    kernel_options: dict[int, KernelOptions]  # head_dim -> options
    attention_backend: str  # "triton" (paged_decode_attention_triton) or "flex"

    def for_layer(self, cache_layer_idx: int, regime: str = FULL_ATTENTION) -> DecodeLayerStep:
        """The step as one layer sees it: the cache it writes (or, KV-shared, reads) and its regime's mask.

        NOTE: picked here, outside the layer, so a compiled layer reads no layer index: dynamo
        specialises on every int it reads, and would compile each layer on its own.
        """
        return DecodeLayerStep(
            self.kv_caches[cache_layer_idx],
            self.masks[regime],
            self.physical_slots[regime],
            self.kernel_options,
            self.attention_backend,
        )


@dataclass
class DecodeLayerStep:
    """One layer's view of a DecodeStep; the patched attention calls `attend`."""

    cache: PagedKVCache
    mask: PagedDecodeMask
    physical_slots: torch.Tensor  # [B] cache row of each row's token
    kernel_options: dict[int, KernelOptions]
    attention_backend: str

    def attend(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, scale: float) -> torch.Tensor:
        """Writes k/v (None: a KV-shared layer) into the cache, then attends over the rows' pages.

        q: [B, H, 1, D]; k, v: [B, H_kv, 1, D]; returns [B, H, 1, D].
        """
        if k is not None:
            self.cache.write(k, v, self.physical_slots)
        mask = self.mask
        return paged_decode_attention(
            q,
            self.cache.k_cache,
            self.cache.v_cache,
            mask.kv_num_blocks,
            mask.kv_indices,
            mask.input_pos_B,
            mask.batch_idx_B,
            mask.physical_to_logical,
            mask.page_size,
            mask.sliding_window,
            float(scale),
            self.kernel_options[q.shape[-1]].decode,
            self.attention_backend,
        )


class PagedKVCache:
    """One attention layer's K/V pool, shared by all sequences through the page table."""

    def __init__(self, n_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype, device, memory: KVMemory):
        # NOTE: stored at kernel_head_dim (on the CPU a multiple of 16, its NOTE), zero columns past
        # head_dim, so decode never pads the cache.
        shape = (1, num_kv_heads, n_pages * page_size, kernel_head_dim(head_dim, torch.device(device)))
        # k_cache, v_cache: [1, H_kv, n_pages * page_size, D]; row = physical_page * page_size + offset
        self.k_cache = memory.zeros(shape, dtype)
        self.v_cache = memory.zeros(shape, dtype)
        mark_compile_shapes("static", self.k_cache, self.v_cache)

    @property
    def bytes_per_token(self) -> int:
        _, num_kv_heads, _, head_dim = self.k_cache.shape
        return 2 * num_kv_heads * head_dim * self.k_cache.element_size()

    def write(self, k: torch.Tensor, v: torch.Tensor, physical_slots: torch.Tensor) -> None:
        """k, v: [B, H_kv, S, D] with B * S == len(physical_slots) (packed prefill: B = 1; decode: S = 1),
        zero-padded here to the cache's head dim."""
        k, v = pad_head_dim(k, self.k_cache.shape[-1]), pad_head_dim(v, self.v_cache.shape[-1])
        B, H, S, D = k.shape
        # NOTE: an index_put_ on the whole cache; inductor turns index_copy_ on the [0] view
        # into a copy of the entire cache per write.
        self.k_cache[:, :, physical_slots] = k.transpose(0, 1).reshape(1, H, B * S, D)
        self.v_cache[:, :, physical_slots] = v.transpose(0, 1).reshape(1, H, B * S, D)


class KVMemory:
    """Where the KV pool lives. With sleep mode its memory can be given back while a trainer trains
    (`sleep`) and taken again (`wake_up`, zeroed). On CUDA every tensor keeps its device address
    across a sleep (`RemappableCudaMemory`), so CUDA graphs captured over the pool stay valid."""

    def __init__(self, device: torch.device, is_sleep_mode: bool):
        self.device = device
        self.is_sleep_mode = is_sleep_mode
        self.is_asleep = False
        self.tensors: list[torch.Tensor] = []
        self.cuda_memories: list[RemappableCudaMemory] = []

    def zeros(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        if not (self.is_sleep_mode and self.device.type == "cuda"):
            tensor = torch.zeros(shape, dtype=dtype, device=self.device)
        else:
            memory = RemappableCudaMemory(math.prod(shape) * dtype.itemsize, self.device)
            self.cuda_memories.append(memory)
            tensor = memory.tensor(shape, dtype).zero_()
        self.tensors.append(tensor)
        return tensor

    def sleep(self) -> None:
        if self.is_asleep:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no queued kernel may still read the pool
            for memory in self.cuda_memories:
                memory.unmap()
        else:
            for tensor in self.tensors:
                tensor.untyped_storage().resize_(0)
        self.is_asleep = True

    def wake_up(self) -> None:
        if not self.is_asleep:
            return
        if self.device.type == "cuda":
            for memory in self.cuda_memories:
                memory.map()
        else:
            for tensor in self.tensors:
                tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
        for tensor in self.tensors:  # padding rows read page 0: never uninitialised memory
            tensor.zero_()
        self.is_asleep = False


class _CuMemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _CuMemAllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _CuMemAllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _CuMemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _CuMemAllocFlags),
    ]


class _CuMemAccessDesc(ctypes.Structure):
    _fields_ = [("location", _CuMemLocation), ("flags", ctypes.c_int)]


# The CUDA driver's enum values these calls use (cuda.h).
CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_LOCATION_TYPE_DEVICE, CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 1, 1, 3


class RemappableCudaMemory:
    """Device memory at a fixed virtual address whose physical pages can be unmapped (given back to
    the driver) and mapped again: CUDA's virtual memory management (cuMemAddressReserve, cuMemCreate,
    cuMemMap), called through the driver library with ctypes, as vLLM's sleep mode does in C++."""

    def __init__(self, num_bytes: int, device: torch.device):
        self.driver = ctypes.CDLL("libcuda.so.1")
        self.device = device
        ordinal = device.index if device.index is not None else torch.cuda.current_device()
        location = _CuMemLocation(CU_MEM_LOCATION_TYPE_DEVICE, ordinal)
        self.properties = _CuMemAllocationProp(type=CU_MEM_ALLOCATION_TYPE_PINNED, location=location)
        granularity = ctypes.c_size_t()
        self.call("cuMemGetAllocationGranularity", ctypes.byref(granularity), ctypes.byref(self.properties), 0)
        self.num_bytes = -(-num_bytes // granularity.value) * granularity.value
        self.address = ctypes.c_uint64()
        self.call(
            "cuMemAddressReserve",
            ctypes.byref(self.address),
            ctypes.c_size_t(self.num_bytes),
            ctypes.c_size_t(0),
            ctypes.c_uint64(0),
            ctypes.c_ulonglong(0),
        )
        self.handle: ctypes.c_uint64 | None = None
        self.map()

    def call(self, name: str, *args) -> None:
        result = getattr(self.driver, name)(*args)
        if result != 0:
            raise FlexInferenceError(f"the CUDA driver's {name} failed (CUresult {result}) for the sleepable KV pool")

    def map(self) -> None:
        handle, size = ctypes.c_uint64(), ctypes.c_size_t(self.num_bytes)
        self.call("cuMemCreate", ctypes.byref(handle), size, ctypes.byref(self.properties), ctypes.c_ulonglong(0))
        self.call("cuMemMap", self.address, size, ctypes.c_size_t(0), handle, ctypes.c_ulonglong(0))
        access = _CuMemAccessDesc(self.properties.location, CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        self.call("cuMemSetAccess", self.address, size, ctypes.byref(access), ctypes.c_size_t(1))
        self.handle = handle

    def unmap(self) -> None:
        self.call("cuMemUnmap", self.address, ctypes.c_size_t(self.num_bytes))
        self.call("cuMemRelease", self.handle)
        self.handle = None

    def __del__(self) -> None:  # the engine is gone (its pool tensors and graphs with it): give back the range
        if self.handle is not None:
            torch.cuda.synchronize(self.device)
            self.unmap()
        self.driver.cuMemAddressFree(self.address, ctypes.c_size_t(self.num_bytes))

    def tensor(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A tensor over the memory (the memory must outlive it: the engine holds both)."""
        interface = {"data": (self.address.value, False), "shape": (self.num_bytes,), "typestr": "|u1", "version": 3}
        holder = type("CudaArray", (), {"__cuda_array_interface__": interface})()
        flat_bytes = torch.as_tensor(holder, device=self.device)
        return flat_bytes[: math.prod(shape) * dtype.itemsize].view(dtype).view(shape)


def mask_constant(value: int, device) -> torch.Tensor:
    """A number a mask_mod reads (a sliding window, a page size), as a 0-dim tensor.

    NOTE: a Python int in a mask_mod's closure that differs between two engines in one process
    becomes a symbol of the compiled kernel (automatic dynamic shapes), and inductor's CPU flex
    template corrupts symbols by text replacement (packed_block_masks' NOTE); a 0-dim tensor is a
    buffer of one fixed shape, whatever its value.
    """
    return torch.full((), value, dtype=torch.long, device=device)


def causal_mask_mod(sliding_window: torch.Tensor | int | None = None):
    """Logical causal mask (optionally windowed exactly as HF: kv > q - window)."""

    def mask_mod(b, h, q_idx, kv_idx):
        is_visible = q_idx >= kv_idx
        if sliding_window is not None:
            is_visible = is_visible & (q_idx - kv_idx < sliding_window)
        return is_visible

    return mask_mod


def document_causal_mask_mod(document_id_C: torch.Tensor, sliding_window: torch.Tensor | None = None):
    """Packed prefill: every prompt sees only itself, causally (windowed if asked); document_id_C[i]
    is token i's prompt."""
    causal = causal_mask_mod(sliding_window)

    def mask_mod(b, h, q_idx, kv_idx):
        return (document_id_C[q_idx] == document_id_C[kv_idx]) & causal(b, h, q_idx, kv_idx)

    return mask_mod


def gathered_rows_mask_mod(mask_mod, row_idx_R: torch.Tensor):
    """A mask over only some query rows of another: query n is row row_idx_R[n] of `mask_mod`."""

    def gathered(b, h, q_idx, kv_idx):
        return mask_mod(b, h, row_idx_R[q_idx], kv_idx)

    return gathered


def packed_block_masks(
    document_id_C: torch.Tensor,
    num_tokens: int,
    sliding_windows: dict,
    device,
    query_rows_N: torch.Tensor | None = None,
    max_query_rows: int = 0,
) -> dict:
    """Each attention regime's document-causal BlockMask over a packed row of `num_tokens` (T)
    tokens, whose document ids are the first T of `document_id_C`; with `query_rows_N`, for those
    query rows only ([N, T]).

    NOTE: a mask_mod reads no symbol of the compiled kernel: every tensor it captures keeps one size
    for the engine's life (the document ids padded to the longest packed row, the query rows to
    `max_query_rows`, numbers as 0-dim tensors: `mask_constant`). A captured size or int that varies
    becomes a symbol, and inductor's CPU flex template renames its KV block-size symbol by text
    replacement, which corrupts every symbol sharing its prefix (`ks5` inside `ks51`:
    "'cur_kvSplitSize1' was not declared", torch 2.13).
    """
    query_rows_R = (
        None if query_rows_N is None else nn.functional.pad(query_rows_N, (0, max_query_rows - len(query_rows_N)))
    )
    mark_compile_shapes("static", document_id_C, query_rows_R)  # another engine's sizes: a recompile, not a symbol
    masks = {}
    for regime, window in sliding_windows.items():
        mask_mod = document_causal_mask_mod(document_id_C, None if window is None else mask_constant(window, device))
        if query_rows_N is None:
            masks[regime] = create_block_mask(mask_mod, None, None, num_tokens, num_tokens, device=device)
        else:
            masks[regime] = create_block_mask(
                gathered_rows_mask_mod(mask_mod, query_rows_R), None, None, len(query_rows_N), num_tokens, device=device
            )
    return masks


def offset_mask_mod(mask_mod, input_pos_B: torch.Tensor):
    """Decode: the single query token sits at logical position input_pos_B[b], not at q_idx = 0."""

    def offset(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_idx + input_pos_B[b], kv_idx)

    return offset


def visible_logical_blocks(
    input_pos_B: torch.Tensor, page_size: int, sliding_window: int | None, max_logical_blocks: int
) -> tuple:
    """Every logical block a decode query at input_pos_B[b] sees (a window's left edge to the query's
    own block): (kv_num_blocks [B, 1, 1], kv_indices [B, 1, 1, max_logical_blocks]), all partial.

    NOTE: no full blocks on purpose. With full blocks, flex's decode kernel splits the whole pool
    length (KV_LEN) among its SPLIT_KV programs, so a row's few pages all land in the first split
    and one program per row does all the work; with partial blocks only, it splits the row's own
    blocks. The mask_mod is exact either way.
    """
    last_block_B = input_pos_B // page_size
    if sliding_window is None:
        first_block_B = torch.zeros_like(last_block_B)
    else:
        first_block_B = (input_pos_B - sliding_window + 1).clamp(min=0) // page_size
    B = input_pos_B.shape[0]
    kv_num_blocks = (last_block_B - first_block_B + 1).to(torch.int32).view(B, 1, 1)
    logical_BL = first_block_B[:, None] + torch.arange(max_logical_blocks, device=input_pos_B.device)
    kv_indices = logical_BL.clamp(max=max_logical_blocks - 1).to(torch.int32).view(B, 1, 1, max_logical_blocks)
    return kv_num_blocks, kv_indices


def physical_mask_mod(
    logical_mask_mod, physical_to_logical: torch.Tensor, batch_idx_B: torch.Tensor, page_size: torch.Tensor
):
    """`logical_mask_mod` over physical cache rows: False on every page the row's slot does not
    own, so it is exact on its own, with or without the block indices (eager flex on CPU applies
    only the mask_mod)."""

    def mask_mod(b, h, q_idx, physical_kv_idx):
        logical_block_idx = physical_to_logical[batch_idx_B[b], physical_kv_idx // page_size]
        logical_kv_idx = logical_block_idx * page_size + physical_kv_idx % page_size
        return (logical_block_idx >= 0) & logical_mask_mod(b, h, q_idx, logical_kv_idx)

    return mask_mod


@dataclass
class PagedDecodeMask:
    """One attention regime's decode mask as tensors and numbers, so it can cross into the decode
    attention op (`paged_decode_attention`), which rebuilds the BlockMask and its mask_mod."""

    kv_num_blocks: torch.Tensor  # [B, 1, 1]
    kv_indices: torch.Tensor  # [B, 1, 1, n_pages] physical pages (partial blocks only: see visible_logical_blocks)
    input_pos_B: torch.Tensor  # logical position of each row's query token
    batch_idx_B: torch.Tensor  # each row's batch slot
    physical_to_logical: torch.Tensor  # [slots, n_pages] -> logical block, -1 if not owned
    page_size: int
    sliding_window: int | None  # None: full causal

    def block_mask(self) -> BlockMask:
        """One query row per sequence over the whole pool. seq_lengths must equal the real q/kv
        lengths (torch >= 2.9 checks); no q blocks are needed without a backward pass."""
        device = self.kv_indices.device
        window = None if self.sliding_window is None else mask_constant(self.sliding_window, device)
        logical_mask_mod = offset_mask_mod(causal_mask_mod(window), self.input_pos_B)
        page_size = mask_constant(self.page_size, device)
        full_blocks = (None, None)
        if self.kv_indices.device.type == "cpu":
            # NOTE: torch's C++ flex kernel does not compile without full blocks: give it none.
            full_blocks = (torch.zeros_like(self.kv_num_blocks), torch.zeros_like(self.kv_indices))
        return BlockMask.from_kv_blocks(
            self.kv_num_blocks,
            self.kv_indices,
            *full_blocks,
            BLOCK_SIZE=self.page_size,
            mask_mod=physical_mask_mod(logical_mask_mod, self.physical_to_logical, self.batch_idx_B, page_size),
            seq_lengths=(1, self.physical_to_logical.shape[1] * self.page_size),
            compute_q_blocks=False,
        )


@torch.library.custom_op("flex_inference::paged_decode_attention", mutates_args=())
def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_num_blocks: torch.Tensor,
    kv_indices: torch.Tensor,
    input_pos_B: torch.Tensor,
    batch_idx_B: torch.Tensor,
    physical_to_logical: torch.Tensor,
    page_size: int,
    sliding_window: int | None,
    scale: float,
    kernel_options: str,
    backend: str,
) -> torch.Tensor:
    """Decode attention over the paged cache: q [B, H, 1, D], caches [1, H_kv, rows, D'] -> [B, H, 1, D]
    (D' >= D: the cache's head dim, `kernel_head_dim`, zero past D).

    `backend` "triton": the project's paged kernel over each row's listed pages
    (paged_decode_attention_triton); "flex": flex_attention's decode kernel with the rebuilt
    BlockMask and `kernel_options`.
    An opaque op, so a compiled decode step with a symbolic batch size still calls flex_attention's
    decode kernel compiled for the concrete batch bucket: traced into the symbolic-batch graph,
    that kernel ran several times slower (scripts/benchmarks/README.md).
    """
    if backend == "triton":
        pages_BP = kv_indices.view(q.shape[0], -1)
        return paged_decode_attention_triton(
            q, k_cache, v_cache, pages_BP, input_pos_B, page_size, sliding_window, scale
        )
    block_mask = PagedDecodeMask(
        kv_num_blocks, kv_indices, input_pos_B, batch_idx_B, physical_to_logical, page_size, sliding_window
    ).block_mask()
    mark_compile_shapes("static", *block_mask.as_tuple()[2:6])
    options = json.loads(kernel_options)
    if q.is_cuda and q.shape[0] <= 8 and q.shape[-1] == 256:
        # NOTE: flex's default SPLIT_KV is 2 x SMs / rows, and only the splits that a row's few
        # pages reach do work; 16 splits are faster at small batches (kernel-option sweep).
        options.setdefault("SPLIT_KV", 16)
    # NOTE: called from a compiled step, this op's first calls run below ADInplaceOrView (the
    # dispatcher's key for views and in-place ops) and its later calls not; flex's compiled frame
    # guards the dispatch keys of the cache and of the mask's tensors, so each way compiled a kernel
    # of its own. Always below it (nothing here is autograd's): one compile per attention kind.
    with torch._C._AutoDispatchBelowADInplaceOrView():
        return flex_attention_padded(q, k_cache, v_cache, block_mask, scale, options, shape_role="static").contiguous()


@paged_decode_attention.register_fake
def _paged_decode_attention_shape(q, *args):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


# ---------------------------------------------------------------------------------------------
# Tokens out
# ---------------------------------------------------------------------------------------------


def vocabulary_chunks(vocab_size: int) -> int:
    """How many chunks a vocabulary row is reduced in: the largest power of two up to 256 that
    divides it.

    NOTE: one reduction over a long vocabulary row runs as one program per row, slow at small
    batches (scripts/benchmarks/README.md); C chunks a row give the compiled step C times the programs.
    """
    return min(vocab_size & -vocab_size, 256)


def first_argmax(x_BV: torch.Tensor) -> torch.Tensor:
    """x_BV.argmax(-1), the first index of each row's maximum, in two stages: the maximum of each
    vocabulary chunk, then of the chunks."""
    B, V = x_BV.shape
    num_chunks = vocabulary_chunks(V)
    chunk_max_BC, chunk_argmax_BC = x_BV.view(B, num_chunks, V // num_chunks).max(-1)
    best_chunk_B = chunk_max_BC.argmax(-1)  # the first chunk holding the row's maximum
    return best_chunk_B * (V // num_chunks) + chunk_argmax_BC.gather(1, best_chunk_B[:, None]).squeeze(1)


def pack_samples(tokens_B: torch.Tensor, logprobs_B: torch.Tensor) -> torch.Tensor:
    """Sampled tokens and their log-probs as one [2, B] float64 tensor: one copy to the host."""
    return torch.stack([tokens_B.double(), logprobs_B.double()])


def sample_tokens(
    logits_BV: torch.Tensor,
    float_params_B3: torch.Tensor,
    int_params_B2: torch.Tensor,
    position_B: torch.Tensor,
    is_filtered: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's next token and its log-probability, drawn as HF's sampling does: logits / T,
    then top-k, then top-p, then min-p; a row with temperature 0 takes the argmax.

    float_params_B3: temperature, top_p, min_p per row; int_params_B2: top_k, seed per row;
    position_B: the position the sampled token takes in its sequence. `is_filtered`: whether any
    row uses top-k, top-p or min-p (without, their passes are skipped).
    The draw is Gumbel-max over the kept tokens with noise from a hash of (seed, position, token):
    it depends on nothing else, so neither the batch, its bucket, preemption nor another GPU can
    change a sequence's tokens. Log-probs are log_softmax(logits / T) at the chosen token, over the
    whole vocabulary (what a GRPO trainer computes); at temperature 0, log_softmax(logits).
    """
    temperature_B, top_p_B, min_p_B = float_params_B3.unbind(1)
    top_k_B, seed_B = int_params_B2.unbind(1)
    B, V = logits_BV.shape
    is_greedy_B = temperature_B <= 0
    z_BV = logits_BV / torch.where(is_greedy_B, 1.0, temperature_B)[:, None]
    # Each row's maximum and log-normaliser from its vocabulary chunks' (a chunk's maximum clamped
    # to a finite value, so that a chunk of -inf adds 0): with the chunked argmax below, the
    # compiled step reads the logits once.
    z_BCK = z_BV.view(B, vocabulary_chunks(V), -1)
    chunk_max_BC1 = z_BCK.amax(-1, keepdim=True).clamp(min=torch.finfo(z_BV.dtype).min)
    chunk_sum_BC = torch.exp(z_BCK - chunk_max_BC1).sum(-1)
    z_max_B1 = chunk_max_BC1.amax(1)
    row_sum_B = (chunk_sum_BC * torch.exp(chunk_max_BC1.squeeze(2) - z_max_B1)).sum(-1)
    log_normalizer_B = z_max_B1.squeeze(1) + torch.log(row_sum_B)
    # A greedy row draws no noise: its score's first maximum is the logits' (every filter keeps a maximum).
    score_BV = z_BV + torch.where(is_greedy_B[:, None], 0.0, sampling_noise(seed_B, position_B, V))
    if is_filtered:
        keep_BV = z_BV - z_max_B1 >= torch.log(min_p_B)[:, None]  # min-p: p >= min_p * max p
        keep_BV = keep_BV & top_k_top_p_mask(z_BV, z_max_B1, top_k_B, top_p_B)
        score_BV = torch.where(keep_BV, score_BV, -torch.inf)
    tokens_B = first_argmax(score_BV)
    logprobs_B = z_BV.gather(1, tokens_B[:, None]).squeeze(1) - log_normalizer_B
    return tokens_B, logprobs_B


def top_k_top_p_mask(
    z_BV: torch.Tensor, z_max_B1: torch.Tensor, top_k_B: torch.Tensor, top_p_B: torch.Tensor
) -> torch.Tensor:
    """The tokens HF's top-k and then top-p keep (top_k 0 and top_p 1.0: all), found without
    sorting the vocabulary: radix selects of a threshold, 4 passes each (FlashInfer's sampling
    kernels avoid the sort too). Ties at a threshold are kept, as HF keeps them for top-k."""
    B, V = z_BV.shape
    key_BV = sortable_key(z_BV)
    top_k_target_B = torch.where((top_k_B > 0) & (top_k_B < V), top_k_B, V)
    top_k_key_B = radix_select(key_BV, torch.ones_like(key_BV), top_k_target_B)
    keep_BV = key_BV >= top_k_key_B[:, None]
    # top-p over the top-k tokens' probabilities, in fixed point so that the masses add up exactly
    # (integer atomics: the same threshold whatever order the GPU adds them in)
    mass_BV = torch.where(keep_BV, torch.exp(z_BV - z_max_B1) * 2.0**40, 0.0).to(torch.int64)
    top_p_target_B = (top_p_B.double() * mass_BV.sum(-1).double()).ceil().to(torch.int64)
    top_p_key_B = torch.where(top_p_B < 1, radix_select(key_BV, mass_BV, top_p_target_B), 0)
    return keep_BV & (key_BV >= top_p_key_B[:, None])


def sortable_key(x: torch.Tensor) -> torch.Tensor:
    """float32 -> int64 in [0, 2**32) with the same order (-inf lowest): the bits, with the
    magnitude bits of negative numbers flipped, offset to be non-negative."""
    bits = x.float().view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits) + 2**31


def radix_select(key_BV: torch.Tensor, weight_BV: torch.Tensor, target_B: torch.Tensor) -> torch.Tensor:
    """Per row, the largest key t with sum(weight where key >= t) >= target, one byte of t per
    pass from the top: a histogram of the weights of the keys that match the bytes found so far.
    key_BV: int64 in [0, 2**32); weight_BV: int64 >= 0; target_B: int64.

    NOTE: each row's histogram is kept in 32 lanes (token id mod 32), added up after: a row's keys
    share few top bytes, and the lanes spread neighbouring tokens' atomic adds over 32 addresses
    (1.7x faster on an H200, scripts/benchmarks/README.md).
    """
    B, V = key_BV.shape
    num_lanes = 32
    bins_256 = torch.arange(256, device=key_BV.device)
    lane_V = torch.arange(V, device=key_BV.device) % num_lanes
    prefix_B = torch.zeros(B, dtype=torch.int64, device=key_BV.device)
    weight_above_B = torch.zeros_like(prefix_B)  # weight of the keys above the prefix found so far
    for shift in (24, 16, 8, 0):
        is_candidate_BV = (key_BV >> (shift + 8)) == prefix_B[:, None]
        bin_BV = ((key_BV >> shift) & 255) * num_lanes + lane_V
        hist_BL = torch.zeros(B, 256 * num_lanes, dtype=torch.int64, device=key_BV.device)
        hist_BL = hist_BL.scatter_add(1, bin_BV, torch.where(is_candidate_BV, weight_BV, 0))
        hist_B256 = hist_BL.view(B, 256, num_lanes).sum(-1)
        at_or_above_B256 = hist_B256.flip(1).cumsum(1).flip(1)
        is_enough_B256 = weight_above_B[:, None] + at_or_above_B256 >= target_B[:, None]
        byte_B = torch.where(is_enough_B256, bins_256, 0).amax(1)  # the highest byte still reaching the target
        weight_above_B = weight_above_B + (at_or_above_B256 - hist_B256).gather(1, byte_B[:, None]).squeeze(1)
        prefix_B = prefix_B * 256 + byte_B
    return prefix_B


def sampling_noise(seed_B: torch.Tensor, position_B: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel noise [B, V] from a counter-based hash of (seed, position, token id): the same
    numbers for the same triple on any device, batch or step."""
    low, high = seed_B & 0xFFFFFFFF, (seed_B >> 32) & 0xFFFFFFFF
    key_B = mix32(mix32(mix32(low) ^ high) ^ (position_B & 0xFFFFFFFF))
    token_V = torch.arange(vocab_size, device=seed_B.device)
    bits_BV = mix32(mix32(key_B[:, None] ^ token_V))
    uniform_BV = ((bits_BV >> 8).float() + 0.5) * 2.0**-24  # 24 random bits, in (0, 1)
    return -torch.log(-torch.log(uniform_BV))


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (x: int64 in [0, 2**32)); products stay below 2**59, so int64 never overflows."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
    x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
    return (x >> 16) ^ x


# ---------------------------------------------------------------------------------------------
# Kernels: compiled flex_attention, its options, the compile-shape policy
# ---------------------------------------------------------------------------------------------

# Compiled once for the whole process. Decode's with dynamo's automatic dynamic shapes under the
# engine's static marks; prefill's (the packed row, and Gemma's shortcut rows) with every size symbolic
# but those marked static (mark_compile_shapes "packed"): the packed length, and the mask's sizes that
# follow it.
flex_attention_compiled = torch.compile(flex_attention, fullgraph=True)
flex_attention_compiled_packed = torch.compile(flex_attention, fullgraph=True, dynamic=True)


def kernel_head_dim(head_dim: int, device: torch.device) -> int:
    """The head dim flex_attention's kernel sees, and the KV cache is stored at: on the CPU the
    model's rounded up to a multiple of 16, elsewhere the model's own.

    NOTE: inductor's C++ flex template renames its KV block-size symbol by text replacement, which
    corrupts symbols sharing its prefix; head dims that are no multiple of 16 made it emit such
    symbols ("'cur_kvSplitSize4' was not declared": Gemma-4 at head dims 12 and 24, torch 2.13,
    AVX-512/AMX). Zero columns leave q.k and the output's first head_dim columns as they are.
    """
    return -(-head_dim // 16) * 16 if device.type == "cpu" else head_dim


def pad_head_dim(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """t zero-padded on its last dim to head_dim (t itself when it has that many columns already)."""
    return t if t.shape[-1] == head_dim else nn.functional.pad(t, (0, head_dim - t.shape[-1]))


def flex_attention_padded(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: BlockMask,
    scale: float,
    kernel_options: dict,
    shape_role: str,
) -> torch.Tensor:
    """Compiled flex_attention (prefill's packed row: flex_attention_compiled_packed) with q, k and v
    zero-padded to `kernel_head_dim` (k and v may come padded already: the CPU's KV cache), the
    output cut back to q's head dim.

    q, k and v share one head dim (every model here). `scale` is the model's, from the true head
    dim: flex's default would take it from the padded one. The tensors the kernel sees are marked
    with `shape_role` (mark_compile_shapes): marks on an unpadded tensor would not reach its copy.
    """
    head_dim = q.shape[-1]
    padded = kernel_head_dim(head_dim, q.device)
    q, k, v = pad_head_dim(q, padded), pad_head_dim(k, padded), pad_head_dim(v, padded)
    mark_compile_shapes(shape_role, q, k, v)
    compiled, settings = flex_attention_compiled, contextlib.nullcontext()
    if shape_role == "packed":
        # NOTE: with every size symbolic, dynamo would make `scale` a symbolic float too, which
        # the pass that turns such floats into tensors gave up on, restarting the trace with it
        # constant: the first compile traced twice, in warm processes too (tiny Gemma-4 on the
        # CPU, compiled step: the first generate on warm caches 8.3-8.8 s with this, 8.8-9.6 s
        # without, three runs each). It is one constant per head dim, so it is one from the start.
        compiled, settings = flex_attention_compiled_packed, torch._dynamo.config.patch(specialize_float=True)
    with settings:
        out = compiled(
            q,
            k,
            v,
            block_mask=block_mask,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
            kernel_options=kernel_options,
        )
    return out if padded == head_dim else out[..., :head_dim]


def compile_settings():
    """The dynamo settings the engine's compiled calls need, set around them (importing this
    module changes none).

    NOTE: every distinct prefill length, head_dim and decode batch bucket is its own compiled
    specialisation; the default limit of 8 would silently fall back to eager flex attention.
    """
    return torch._dynamo.config.patch(recompile_limit=256, accumulated_recompile_limit=4096)


def programmatic_launch_settings():
    """Programmatic dependent launch (is_programmatic_launch_on) for the kernels compiled and
    launched inside, inductor's and the project's, unless TORCHINDUCTOR_ENABLE_PDL=0: set around
    the capture of the decode graphs (ModelRunner.capture_cuda_graphs).

    NOTE: on an H200 it took batch-1 decode from 2.72 to 2.48 ms a step, but made the eager
    prefill slower (a launch with attributes leaves inductor's static launcher), so it is kept to
    the graphs, whose replays cost the host nothing (scripts/benchmarks/README.md, round 2).
    """
    return inductor_config.patch({"triton.enable_pdl": os.environ.get("TORCHINDUCTOR_ENABLE_PDL", "1") == "1"})


def mark_compile_shapes(role: str, *tensors: torch.Tensor | None, is_batch_symbolic: bool = False) -> None:
    """The one compile-shape policy: which dimensions of a compiled call's inputs torch.compile
    may treat as symbolic, by the role the tensor plays.

    - "static": every dimension static. The KV caches and page tables (marked when made: a mark
      added after a compiled region first saw them would recompile it), and q and the mask
      tensors inside the decode attention op: flex's decode kernel is compiled per batch bucket
      (and the CPU kernel indexes out of bounds with a symbolic KV length).
    - "packed": prefill's q, k, v: all but the packed length (dim 2) static; flex_attention_padded
      compiles them with dynamic sizes from the first call. Left to automatic dynamic shapes, the
      second length seen compiled every prefill kernel again (its int sizes in the block mask were
      constants in the first compile; on an H100, E2B: 4 kernels, ~15 s, in a GRPO step).
    - "batch": inputs of the compiled decode regions (prologue, layer, epilogues, sample packing): with
      `is_batch_symbolic` (compile_decode) dim 0, the batch, is symbolic, so one compile serves
      every bucket; a weak mark, so a graph that needs a fixed size (a bucket of 1) specialises it.
    - "static_batch": decode region inputs that also cross into flex_attention (positions, batch
      slots, the block tensors of the masks): static in every dimension, except that the regions
      see dim 0 as "batch" does (a weak dynamic mark takes precedence over a static one).

    NOTE: without marks, automatic dynamic shapes make a dimension symbolic once a second value
    is seen. Marks count only on the inputs of a compiled call: nothing is marked while tracing.
    """
    if torch.compiler.is_compiling():
        return
    for t in tensors:
        if t is None:
            continue
        static_dims = {"static": range(t.dim()), "static_batch": range(t.dim()), "packed": (0, 1, 3), "batch": ()}[role]
        for dim in static_dims:
            torch._dynamo.mark_static(t, dim)
        if is_batch_symbolic and role in ("batch", "static_batch"):
            torch._dynamo.maybe_mark_dynamic(t, 0)


@dataclass(frozen=True)
class KernelOptions:
    """flex_attention kernel options for one head_dim: prefill's as a dict, decode's as JSON (they
    cross into the decode attention op as a string)."""

    prefill: dict
    decode: str

    @staticmethod
    def pick(
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
        page_size: int,
        fa4_prefill: bool,
        prefill_overrides: dict | None,
        decode_overrides: dict | None,
    ):
        """The defaults for this head_dim, device, dtype and page size, FLASH for prefill when asked,
        then the overrides."""
        prefill, decode = default_kernel_options(head_dim, device, dtype, page_size)
        if fa4_prefill:
            prefill = {"BACKEND": "FLASH"}
        return KernelOptions(
            {**prefill, **(prefill_overrides or {})}, json.dumps({**decode, **(decode_overrides or {})})
        )


def default_kernel_options(
    head_dim: int, device: torch.device, dtype: torch.dtype, page_size: int
) -> tuple[dict, dict]:
    """(prefill, decode) flex_attention kernel options per head_dim and dtype, picked with the
    kernel-option sweep on an H200 (scripts/benchmarks/flex_kernel_options.py; E2B heads: 8 query, 1 KV).

    NOTE: above head_dim 256 the default prefill tiles need more shared memory than an H200 block
    has, so prefill takes 32x32 tiles (the fastest that fit); float32 doubles every tile's bytes,
    so its tiles shrink further, to one pipeline stage. Decode over a pool of pages with partial
    blocks: BLOCK_N 32 with one stage at head_dim 256, BLOCK_N 16 at 512 (which fit in float32
    too), and never wider than a page, decode's sparse block (flex asserts it);
    paged_decode_attention adds the batch-dependent SPLIT_KV.
    """
    if device.type != "cuda" or head_dim <= 128:
        return {}, {}
    decode = {"BLOCK_N": min(16 if head_dim > 256 else 32, page_size), "num_stages": 1}
    if dtype == torch.float32:
        prefill = {"BLOCK_M": 32, "BLOCK_N": 16 if head_dim > 256 else 32, "num_stages": 1}
    else:
        prefill = {"BLOCK_M": 32, "BLOCK_N": 32} if head_dim > 256 else {"BLOCK_M": 64, "BLOCK_N": 64}
    return prefill, decode


def flash_prefill_supported(head_dim: int, device: torch.device) -> bool:
    """Whether flex_attention's FLASH backend (flash-attn-4, CuTe DSL) can run this prefill."""
    if device.type != "cuda" or importlib.util.find_spec("flash_attn") is None:
        return False
    major, _ = torch.cuda.get_device_capability(device)
    # NOTE: FLASH cannot do head_dim 512 on Hopper.
    return major in (9, 10) and head_dim <= 256


def resolve_fa4_prefill(fa4_prefill: bool | None, head_dims: set[int], device: torch.device) -> bool:
    """Whether prefill uses the FLASH backend: where asked for (None: wherever supported) and
    supported for every head_dim."""
    is_supported = all(flash_prefill_supported(head_dim, device) for head_dim in head_dims)
    if fa4_prefill and not is_supported:
        warnings.warn("fa4_prefill asked for, but flex_attention's FLASH backend cannot run here; using Triton")
    return bool(is_supported if fa4_prefill is None else fa4_prefill and is_supported)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half RoPE. x: [B, H, S, D]; cos, sin: [B, S, D] from the model's own rotary module."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def is_programmatic_launch_on(device: torch.device) -> bool:
    """Whether the project's Triton kernels launch with programmatic dependent launch (PDL): with
    inductor's own switch (`torch._inductor.config.triton.enable_pdl`, TORCHINDUCTOR_ENABLE_PDL=1),
    on Hopper or later; programmatic_launch_settings turns it on. A kernel launched so may start while the
    previous one finishes: it waits (gdc_wait) before it reads anything the previous kernels write."""
    is_enabled = device.type == "cuda" and triton is not None and inductor_config.triton.enable_pdl
    return is_enabled and torch.cuda.get_device_capability(device)[0] >= 9


def use_inductors_ptxas() -> None:
    """Sets TRITON_PTXAS_PATH as inductor does (torch's own ptxas, where the install has one and the
    variable is unset), before the project's first Triton build, so that every process builds the
    project's kernels in one setting.

    NOTE: inductor sets the variable in a process only when it builds or loads a kernel in that
    process itself. Without this, on an H100 (torch 2.11, Triton 3.6), the second process on one
    set of cache folders built every one of the project's Triton kernels again (40 variants, the
    same IR and options under new cache keys; 1.7-4.2 s per decode graph captured), and the third
    none. With it, the second builds none (tests/test_gpu.py); its start-up took 15.6 s against
    30.2 s (scripts/benchmarks/README.md, round 3). Which part of Triton's key changed is not
    pinned down: the two ptxas binaries there print the same version.
    """
    try:
        from torch._inductor.runtime.compile_tasks import _set_triton_ptxas_path
    except ImportError:  # another torch: its inductor does not set the variable this way
        return
    _set_triton_ptxas_path()


def programmatic_launch_option(use_pdl: bool) -> dict:
    """The launch keyword of a PDL launch (none otherwise: triton's interpreter takes no such keyword)."""
    return {"launch_pdl": True} if use_pdl else {}


# ---------------------------------------------------------------------------------------------
# Skinny decode GEMMs: a Triton GEMV for few rows, raced against cuBLAS per weight shape
# ---------------------------------------------------------------------------------------------

# A decode GEMM at small batch reads every weight byte once and does 2 * M FLOPs per weight
# element: its time is the weight's bytes over the bandwidth reached, and cuBLAS's skinny kernels
# reach well below the copy bandwidth on E2B's decode weights (scripts/benchmarks/README.md). The
# kernel below streams the weight; skinny_linear races it against cuBLAS per (shape, dtype, row
# block) on the GPU it runs on and keeps the faster one.
#
# Kernel design (out[M, N] = x[M, K] @ w[N, K]^T, M <= SKINNY_KERNEL_MAX_ROWS):
# - Program (n, s) owns BLOCK_N output features and the s-th of SPLIT_K runs of K; it walks its K
#   run in [BLOCK_N, BLOCK_K] tiles of w and multiplies each tile with all M rows of x, so every
#   weight byte is read once whatever M is.
# - The product is a tl.dot with w as the wide left operand and x^T padded to BLOCK_M columns, the
#   row bucket but at least 16 (masked rows load nothing). The w tile is K-contiguous and 16-byte
#   aligned (K a multiple of 16, which Triton specialises on), so it is fetched with 16-byte vector
#   loads (cp.async into shared memory when num_stages > 1), and the software pipeline keeps
#   num_stages - 1 tiles per program in flight: 8-96 KB per program with the configs below, several
#   programs per SM. The padding wastes tensor-core FLOPs, which are not the limit: 16 columns at 4.8
#   TB/s need ~80 of the H200's ~990 bf16 TFLOP/s. Broadcast-multiply + tl.sum would put the products
#   on the CUDA cores instead: at 16 rows that is 3.8e13 fp32 FMAs/s at full bandwidth, more than the
#   H200's ~3.4e13, plus a cross-thread reduction per row and tile (or M * BLOCK_N * BLOCK_K fp32
#   accumulators in registers).
# - Split-K, because E2B's o, down and PLE projections have N = 1536 or 256 (2-96 row blocks, too
#   few programs to keep 132 SMs' worth of bytes in flight) and a smaller BLOCK_N alone cannot fix that
#   (the MMA wants BLOCK_N >= 16: still 96 programs, each a long serial K loop). One launch, and
#   deterministic: each split writes fp32 partials [SPLIT_K, M, N] and takes a ticket (an atomic
#   counter per output tile); the tile's last split sums the partials in split order, casts, and
#   puts the counter back to 0 for the next launch (or graph replay). The counters are one int32
#   buffer per device; kernels on one stream never overlap (under PDL each waits for the previous
#   one before it touches them). A second reduction kernel cost more (scripts/benchmarks/README.md).
# - Under programmatic dependent launch (is_programmatic_launch_on) a program prefetches its first
#   weight lines into L2 before it waits for the previous kernel: the weight never depends on it.

# NOTE: up to 64 rows because that is where it paid on an H200 (scripts/benchmarks/README.md,
# round 7): raced up to 64 rows, under programmatic dependent launch (a Triton GEMM's launch
# overlaps the previous kernel's tail; cuBLAS's never does), the step at batch 64 went from 3.46 to
# 3.33 ms, though timed alone the kernel is only level with cuBLAS there. At 128-256 rows, wgmma
# tiles of 64 x 128-256 lost to cuBLAS on every E2B shape but the PLE projection, and the step did
# not gain (4.93 against 4.91 ms at batch 256).
SKINNY_MAX_ROWS = 64  # rows (decode batch) up to which skinny_linear races the Triton kernel against cuBLAS
SKINNY_KERNEL_MAX_ROWS = 64  # rows the kernel takes (BLOCK_M: the row bucket, at least 16)
SKINNY_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SKINNY_TICKETS = 8192  # split-K ticket counters per device: one per output tile of a launch
# weight bytes each program prefetches into L2 before it waits for the previous kernel, under
# programmatic dependent launch: a few MB for the programs resident at once, far below L2's 50 MB
SKINNY_PREFETCH_BYTES = 32 * 1024


@dataclass(frozen=True)
class SkinnyConfig:
    """One launch configuration of the skinny GEMM kernel."""

    block_n: int  # output features (rows of w) per program
    block_k: int  # K chunk per loop iteration
    split_k: int  # programs sharing one row block's K (1: out written directly, one kernel)
    num_warps: int
    num_stages: int  # software-pipeline depth: num_stages - 1 tiles of w in flight per program


# NOTE: picked for E2B's bf16 decode shapes on an H200 (132 SMs, 227 KB shared memory per block):
# each shape has configs giving >= ~130 programs with work, except the 0.79 MB PLE ones, whose time
# is latency: their config is one kernel with all of a program's K chunks in flight at once. Shared
# memory per program is about num_stages * (block_n + 16) * block_k * 2 bytes; configs that exceed
# the limit (in float32) fail to launch there and are dropped by the race.
SKINNY_CONFIGS = (
    SkinnyConfig(128, 128, 1, 8, 4),  # very wide N: lm_head (262144), gate_up of the KV-shared layers (24576)
    SkinnyConfig(64, 128, 1, 4, 4),  # wide N: gate_up (12288), per-layer model projection (8960)
    SkinnyConfig(64, 256, 1, 4, 3),  # the same in longer K chunks
    SkinnyConfig(64, 128, 2, 4, 4),  # N 4096-9000 at K 1536: qkv, q of the full-attention layers
    SkinnyConfig(32, 128, 4, 4, 4),  # N 2048-2560 at K 1536: qkv, q of the sliding layers
    SkinnyConfig(32, 256, 8, 4, 3),  # N 1536 at K 2048-12288: o and down projections
    SkinnyConfig(64, 256, 8, 4, 3),  # the same in fewer, longer programs (down of the KV-shared layers)
    SkinnyConfig(
        16, 256, 1, 4, 6
    ),  # tiny weights (PLE gate 256 x 1536, projection 1536 x 256): up to 6 K chunks in flight
)

if triton is not None:
    # NOTE: M and the strides that change with M are not specialised on: Triton would otherwise
    # compile another variant for M == 1 or M == 16, and compiling while a CUDA graph is captured
    # is not allowed. One variant per config and dtype, compiled by skinny_linear's race.
    @triton.jit(do_not_specialize=["M", "stride_split"])
    def _skinny_matmul_kernel(
        x_ptr, w_ptr, out_ptr, partials_ptr, tickets_ptr, M, N, K, stride_xm, stride_wn, stride_om, stride_split,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        INPUT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr,
        LINE_ELEMS: tl.constexpr,
    ):  # fmt: skip
        """out[M, N] = x[M, K] @ w[N, K]^T, fp32 accumulation; program (n, s) sums split s's run of
        K chunks of output tile n (see the comment above SkinnyConfig)."""
        pid_n = tl.program_id(0)
        pid_split = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        chunks_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
        k_start = pid_split * chunks_per_split * BLOCK_K
        k_end = tl.minimum(k_start + chunks_per_split * BLOCK_K, K)  # the last splits may be empty
        if USE_PDL:
            # Launched early (programmatic dependent launch): the first PREFETCH_LINES 128-byte
            # lines of each of this program's weight rows go to L2 while the previous kernel
            # finishes, since the weight does not depend on it; x is read and out written only
            # after the wait.
            offs_line_k = k_start + tl.arange(0, PREFETCH_LINES) * LINE_ELEMS
            is_line = (offs_n[:, None] < N) & (offs_line_k[None, :] < k_end)
            line_ptrs = tl.where(is_line, w_ptr + offs_n[:, None] * stride_wn + offs_line_k[None, :], w_ptr)
            tl.inline_asm_elementwise(
                "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [line_ptrs], dtype=tl.int32, is_pure=False, pack=1
            )
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        acc_NM = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            w_NK = tl.load(
                w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                mask=(offs_n[:, None] < N) & (offs_k[None, :] < K),
                other=0.0,
            )
            x_MK = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                mask=(offs_m[:, None] < M) & (offs_k[None, :] < K),
                other=0.0,
            )
            acc_NM = tl.dot(w_NK, tl.trans(x_MK), acc_NM, input_precision=INPUT_PRECISION)
        is_in = (offs_m[None, :] < M) & (offs_n[:, None] < N)
        out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
        if SPLIT_K == 1:
            tl.store(out_ptrs, acc_NM.to(out_ptr.dtype.element_ty), mask=is_in)
        else:
            partial_ptrs = partials_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
            tl.store(partial_ptrs + pid_split * stride_split, acc_NM, mask=is_in)
            tl.debug_barrier()  # every thread's partial stores precede the ticket's release
            if tl.atomic_add(tickets_ptr + pid_n, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
                tl.store(tickets_ptr + pid_n, 0)  # the tile's last split: every partial is written
                sum_NM = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                for split in tl.static_range(SPLIT_K):  # in split order: bitwise reproducible
                    sum_NM += tl.load(partial_ptrs + split * stride_split, mask=is_in, other=0.0, cache_modifier=".cg")
                tl.store(out_ptrs, sum_NM.to(out_ptr.dtype.element_ty), mask=is_in)


# device -> int32 [SKINNY_TICKETS], all 0 between launches
_skinny_tickets: dict[torch.device, torch.Tensor] = {}


def skinny_tickets(device: torch.device) -> torch.Tensor:
    """The device's split-K ticket counters (allocated, zeroed, on the first launch there: an eager one)."""
    tickets = _skinny_tickets.get(device)
    if tickets is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the skinny GEMM's ticket counters must exist before a CUDA graph is captured")
        tickets = _skinny_tickets[device] = torch.zeros(SKINNY_TICKETS, dtype=torch.int32, device=device)
    return tickets


def skinny_matmul_triton(
    x2d_MK: torch.Tensor, w_NK: torch.Tensor, config: SkinnyConfig, build_only: bool = False
) -> torch.Tensor | None:
    """out_MN = x2d_MK @ w_NK^T through the Triton kernel(s) of one config.

    M <= SKINNY_KERNEL_MAX_ROWS; x and w of one dtype in SKINNY_DTYPES, K contiguous in both; fp32
    accumulation, out_MN in x's dtype. Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1.
    `build_only`: builds (or loads) the kernel this call would launch, launches nothing and returns
    None (Triton's warmup: a build reads the tensors' dtypes and alignment, so empty ones stand in
    for the outputs).
    """
    M, K = x2d_MK.shape
    N = w_NK.shape[0]
    is_k_contiguous = x2d_MK.stride(1) == 1 and w_NK.stride(1) == 1
    if not (0 < M <= SKINNY_KERNEL_MAX_ROWS and w_NK.shape[1] == K and is_k_contiguous):
        raise ValueError(
            f"skinny_matmul_triton needs 1..{SKINNY_KERNEL_MAX_ROWS} rows and K contiguous: "
            f"x {tuple(x2d_MK.shape)}, w {tuple(w_NK.shape)}"
        )
    if x2d_MK.dtype != w_NK.dtype or x2d_MK.dtype not in SKINNY_DTYPES:
        raise ValueError(
            f"skinny_matmul_triton needs x and w of one dtype in {SKINNY_DTYPES}: x {x2d_MK.dtype}, w {w_NK.dtype}"
        )
    # NOTE: the kernel's offsets are int32, so w must have fewer than 2**31 elements.
    if w_NK.numel() >= 2**31:
        raise ValueError(f"skinny_matmul_triton needs a weight of fewer than 2**31 elements: {tuple(w_NK.shape)}")
    num_tiles = triton.cdiv(N, config.block_n)
    if config.split_k > 1 and num_tiles > SKINNY_TICKETS:
        raise ValueError(
            f"skinny_matmul_triton has {SKINNY_TICKETS} split-K ticket counters, fewer than {num_tiles} tiles"
        )
    out_rows = 0 if build_only else M  # a zero-size tensor's data pointer is null: aligned, as a fresh one's
    out_MN = torch.empty(out_rows, N, dtype=x2d_MK.dtype, device=x2d_MK.device)
    # partials_SMN: [split_k, M, N] fp32; without split-K neither it nor the counters are used
    partials_SMN, tickets = out_MN, out_MN
    if config.split_k > 1:
        partials_SMN = torch.empty(config.split_k, out_rows, N, dtype=torch.float32, device=x2d_MK.device)
        tickets = skinny_tickets(x2d_MK.device)
    use_pdl = is_programmatic_launch_on(x2d_MK.device)
    line_elems = 128 // x2d_MK.element_size()
    grid = (num_tiles, config.split_k)
    launch = functools.partial(_skinny_matmul_kernel.warmup, grid=grid) if build_only else _skinny_matmul_kernel[grid]
    launch(
        x2d_MK, w_NK, out_MN, partials_SMN, tickets, M, N, K, x2d_MK.stride(0), w_NK.stride(0), N, M * N,
        BLOCK_M=skinny_block_rows(M), BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=config.split_k,
        # NOTE: float32 operands would go through TF32 by default (~1e-3 relative error); "ieee" keeps fp32.
        INPUT_PRECISION="ieee" if x2d_MK.dtype == torch.float32 else "tf32",
        USE_PDL=use_pdl, PREFETCH_LINES=max(1, SKINNY_PREFETCH_BYTES // (config.block_n * 128)), LINE_ELEMS=line_elems,
        num_warps=config.num_warps, num_stages=config.num_stages, **programmatic_launch_option(use_pdl),
    )  # fmt: skip
    return None if build_only else out_MN


# (N, K, dtype name, row block: skinny_block_rows) -> {"winner": "cublas" or an index into
# SKINNY_CONFIGS, "us": backend -> median GPU us per call, "failed": config index -> why it was dropped}
SKINNY_CHOICES: dict = {}
SKINNY_TUNE_WARMUP_CALLS = 3
SKINNY_TUNE_RUNS = 3  # timed runs of back-to-back calls per backend; the median run counts
SKINNY_TUNE_CALLS_PER_RUN = 24
# GPU clock cycles of torch.cuda._sleep per queued call (~100 us at 2 GHz) before a timed run: the
# CPU queues the run's calls meanwhile, so that Python and launch overhead (absent in a CUDA graph)
# stay out of the times.
SKINNY_TUNE_QUEUE_AHEAD_CYCLES_PER_CALL = 200_000


# The races' picks kept on disk for later processes (start-up races no shape a process before it
# raced): a folder named by this environment variable, by default ~/.cache/flex_inference; empty: none.
SKINNY_CACHE_DIR_ENV = "FLEX_INFERENCE_CACHE_DIR"
SKINNY_SAVED: dict = {}  # the cache file's path -> its picks ("N,K,dtype,bucket" -> choice), read once a process


def skinny_cache_path(device: torch.device) -> Path | None:
    """The file of saved picks for this GPU model, software and tuning: its name hashes all that can
    change a pick (the kernel's source, its configs, the race's constants, TF32, PDL); None: no cache."""
    root = os.environ.get(SKINNY_CACHE_DIR_ENV, str(Path.home() / ".cache" / "flex_inference"))
    if not root:
        return None
    tuning = (
        torch.cuda.get_device_properties(device).name,
        torch.__version__,
        triton.__version__,
        inspect.getsource(_skinny_matmul_kernel.fn),
        SKINNY_CONFIGS,
        SKINNY_PREFETCH_BYTES,
        SKINNY_TUNE_WARMUP_CALLS,
        SKINNY_TUNE_RUNS,
        SKINNY_TUNE_CALLS_PER_RUN,
        SKINNY_TUNE_QUEUE_AHEAD_CYCLES_PER_CALL,
        torch.backends.cuda.matmul.allow_tf32,
        is_programmatic_launch_on(device),
    )
    return Path(root) / f"skinny_choices_{hashlib.sha256(repr(tuning).encode()).hexdigest()[:16]}.json"


def skinny_choice(key: tuple, x2d_MK: torch.Tensor, w_NK: torch.Tensor) -> dict:
    """The pick for `key`: one an earlier process saved (marked "saved"), else a race's, saved for
    later processes (written whole to a new file, then renamed over the old: readers never see half)."""
    path = skinny_cache_path(x2d_MK.device)
    if path is None:
        return race_skinny_backends(x2d_MK, w_NK)
    if path not in SKINNY_SAVED:
        SKINNY_SAVED[path] = json.loads(path.read_text()) if path.exists() else {}
    saved, name = SKINNY_SAVED[path], ",".join(map(str, key))
    if name in saved:
        return {**saved[name], "saved": True}
    saved[name] = race_skinny_backends(x2d_MK, w_NK)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as file:
        json.dump(saved, file)
    os.replace(file.name, path)
    return saved[name]


# NOTE: rows that share the kernel's BLOCK_M share one race, so 1-16 rows race once: on an H100 (E2B,
# bf16, 14 decode shapes) each 2-, 4- and 8-row pick was within 1.5% of the 16-row pick's time on the
# same shape, cuBLAS won none of them, and the 42 races they skip took 4.4 s of a cold start's 19.8
# (scripts/benchmarks/README.md, round 3).
def skinny_block_rows(num_rows: int) -> int:
    """The kernel's BLOCK_M for num_rows (the power of two >= num_rows, at least 16: the MMA's
    smallest), and the decode batches that share one entry of SKINNY_CHOICES."""
    return max(16, 1 << (num_rows - 1).bit_length())


def skinny_tolerance(dtype: torch.dtype) -> float:
    """Largest ||out - ref|| / ||ref|| accepted from a Triton config against F.linear: loose enough
    for two summation orders over K = 12288, far below the O(1) error of a broken config."""
    if dtype != torch.float32:
        return 1e-2
    # NOTE: with TF32 allowed, cuBLAS's float32 result is itself only ~1e-3 accurate.
    return 5e-3 if torch.backends.cuda.matmul.allow_tf32 else 1e-4


def _gpu_us_per_call(call, num_weights: int) -> float:
    """GPU time in us of one call(weight_idx), timed over runs of back-to-back calls that go round
    num_weights weight copies: the median run's time over its calls."""
    calls = itertools.count()
    for _ in range(SKINNY_TUNE_WARMUP_CALLS):
        call(next(calls) % num_weights)
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(SKINNY_TUNE_RUNS)
    ]
    for start, end in events:
        torch.cuda._sleep(SKINNY_TUNE_QUEUE_AHEAD_CYCLES_PER_CALL * SKINNY_TUNE_CALLS_PER_RUN)
        start.record()
        for _ in range(SKINNY_TUNE_CALLS_PER_RUN):
            call(next(calls) % num_weights)
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) * 1e3 for start, end in events) / SKINNY_TUNE_CALLS_PER_RUN


def build_skinny_configs(x2d_MK: torch.Tensor, w_NK: torch.Tensor) -> None:
    """Builds (or loads) the kernel of every config of SKINNY_CONFIGS for this input, on one thread
    each, before the race calls them. A build that fails is left to the race's call, which raises
    it again and drops the config.

    NOTE: the first race of each row block (BLOCK_M) built the 8 configs' kernels one after another
    in its first calls: 5.3, 3.1 and 2.9 s of a cold start's 19.8 s of races on an H100, against
    0.07-0.12 s for a race that builds nothing (scripts/benchmarks/README.md, round 3). Built on
    threads, a cold start's 42 races took 7.6 s against 14.4 s, in one call on an H100.
    """
    skinny_tickets(x2d_MK.device)  # allocated once, here, not by two threads at once

    def build(config: SkinnyConfig) -> None:
        with torch.cuda.device(x2d_MK.device):  # Triton builds for, and caches under, the thread's current device
            skinny_matmul_triton(x2d_MK, w_NK, config, build_only=True)

    with concurrent.futures.ThreadPoolExecutor(len(SKINNY_CONFIGS), thread_name_prefix="skinny_build") as pool:
        concurrent.futures.wait([pool.submit(build, config) for config in SKINNY_CONFIGS])


def race_skinny_backends(x2d_MK: torch.Tensor, w_NK: torch.Tensor) -> dict:
    """Times F.linear and every config of SKINNY_CONFIGS on this input's shape; returns an entry of
    SKINNY_CHOICES (with the race's own seconds, "race_s").

    A config is first checked against F.linear on a fresh random x (seeded, its own generator, so
    the caller's RNG stream is untouched; the caller's x may be all zeros in a warm-up) with the
    real weight; one that raises (e.g. out of shared memory) or misses skinny_tolerance is dropped.

    NOTE: times are taken as a decode step's CUDA graph runs the GEMM: back to back after other
    kernels (under programmatic dependent launch, with the overlap of a launch and the previous
    kernel's tail that it brings), on a weight that is not in L2. So each backend runs back to back
    over copies of the weight totalling at least twice the L2 (50 MB on an H200): on one weight
    below ~50 MB the calls would be served from L2, a case a decode step never has (every other
    weight streams through between two uses of one). The check of the whole is a decode step on
    the GPU with and without skinny_linear (scripts/benchmarks/bench_rollouts.py);
    scripts/benchmarks/bench_gemv.py times each shape the same way inside a CUDA graph.
    """
    start = time.perf_counter()
    generator = torch.Generator(device=x2d_MK.device).manual_seed(0)
    x_check_MK = torch.randn(x2d_MK.shape, generator=generator, device=x2d_MK.device).to(x2d_MK.dtype)
    build_skinny_configs(x_check_MK, w_NK)
    ref_MN = nn.functional.linear(x_check_MK, w_NK).float()
    l2_bytes = torch.cuda.get_device_properties(x2d_MK.device).L2_cache_size
    num_weights = math.ceil(2 * l2_bytes / (w_NK.numel() * w_NK.element_size()))
    weights = [w_NK] + [w_NK.clone() for _ in range(num_weights - 1)]
    candidates = {"cublas": lambda i: nn.functional.linear(x_check_MK, weights[i])}
    failed = {}
    for idx, config in enumerate(SKINNY_CONFIGS):
        try:
            got_MN = skinny_matmul_triton(x_check_MK, w_NK, config).float()
        except Exception as error:  # any compile or launch failure (e.g. triton's OutOfResources) drops the config
            failed[idx] = f"{type(error).__name__}: {str(error)[:200]}"
            continue
        rel_err = ((got_MN - ref_MN).norm() / ref_MN.norm().clamp_min(1e-30)).item()
        if not rel_err <= skinny_tolerance(w_NK.dtype):  # also drops NaN
            failed[idx] = f"relative error {rel_err:.2e} against F.linear"
            continue
        candidates[idx] = lambda i, config=config: skinny_matmul_triton(x_check_MK, weights[i], config)
    us = {name: _gpu_us_per_call(fn, num_weights) for name, fn in candidates.items()}
    return {"winner": min(us, key=us.get), "us": us, "failed": failed, "race_s": time.perf_counter() - start}


def linear_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) without bias (x [..., K], weight [N, K] -> [..., N]), multiplied as rows
    [tokens, K]. NOTE: never on x itself: decode's [rows, 1, K] attention output can come out of a
    compiled step strided (K, 1, 1), and so can a strided slice such as a fused GEMM's adapter
    columns; F.linear does not fold such an x into one GEMM but runs aten::bmm with the weight
    broadcast, read once per row (a fused o_proj at 64 rows on an H100: 74-143 us against 5-8 us;
    scripts/benchmarks/bench_zero_copy.py)."""
    return nn.functional.linear(x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("flex_inference::skinny_linear", mutates_args=())
def skinny_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) without bias (x [..., K], weight [N, K] -> [..., N]), through the Triton
    GEMV where it beat cuBLAS for this (N, K, dtype, row block) on this GPU.

    Plain F.linear on rows (linear_rows) on CPU, without triton, above SKINNY_MAX_ROWS rows, or for
    dtypes/layouts the kernel does not take. The first call of a new key outside CUDA-graph capture
    races the backends (race_skinny_backends), unless an earlier process saved its pick
    (skinny_choice), and stores the outcome in SKINNY_CHOICES; a new key met during capture gets
    linear_rows (never time inside a capture), so warm every decode bucket up eagerly first.
    Deterministic: once chosen, a key always runs the same kernel, which sums split-K partials in a
    fixed order. NOTE: a process that races a key again (no saved pick: another cache folder, GPU or
    software) may pick another backend where two are within timing noise, so results are bitwise
    reproducible among processes sharing saved picks, and equal only to rounding across others.
    An opaque op, so it sits in a torch.compile(fullgraph=True) graph with a symbolic batch.
    NOTE: the race compares GPU time only, which is what a CUDA graph replays; called eagerly, a
    Triton launch from Python costs tens of us of CPU time, more than it saves at these sizes.
    """
    N, K = weight.shape
    num_rows = x.numel() // K
    is_skinny = 0 < num_rows <= SKINNY_MAX_ROWS and x.dtype == weight.dtype and x.dtype in SKINNY_DTYPES
    is_k_contiguous = x.stride(-1) == 1 and weight.stride(1) == 1
    if triton is None or x.device.type != "cuda" or not is_skinny or not is_k_contiguous or weight.numel() >= 2**31:
        return linear_rows(x, weight)
    x2d_MK = x.reshape(num_rows, K)
    key = (N, K, str(x.dtype).removeprefix("torch."), skinny_block_rows(num_rows))
    choice = SKINNY_CHOICES.get(key)
    if choice is None:
        if torch.cuda.is_current_stream_capturing():
            return linear_rows(x, weight)
        with torch.cuda.device(x.device):  # the race's sleep, events and syncs act on the current device
            choice = SKINNY_CHOICES[key] = skinny_choice(key, x2d_MK, weight)
    if choice["winner"] == "cublas":
        return linear_rows(x, weight)
    return skinny_matmul_triton(x2d_MK, weight, SKINNY_CONFIGS[choice["winner"]]).view(*x.shape[:-1], N)


@skinny_linear.register_fake
def _skinny_linear_shape(x, weight):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# ---------------------------------------------------------------------------------------------
# Paged decode attention: a Triton kernel over each row's own pages (CUDA)
# ---------------------------------------------------------------------------------------------

# flex_attention's decode path launches four kernels a layer (the block mask's mask_mod tensors,
# the split-KV main kernel, its combine), most of a small decode step's attention time
# (scripts/benchmarks/README.md, "Speed, round 2"). The kernel below reads the rows' pages straight
# from the block tensors the step already has (the physical pages of each row's visible logical
# blocks), and needs no mask tensors: one launch a layer, two with splits.
#
# Kernel design (q [B, H, D] over caches [1, H_kv, rows, D]; FlashDecoding's split-KV):
# - Program (b, kv_head, split) owns row b's query heads of one KV head (the GQA group, padded to
#   16 rows for the MMA) and the split-th run of the row's visible chunks of BLOCK_N positions
#   (a window's left edge to the query's own position); BLOCK_N divides the page size, so a chunk
#   lies in one page. Every K/V byte of the row is read once whatever the group size is.
# - Online softmax in fp32 (exp2, scale folded with log2(e)); p is cast to V's dtype for the PV
#   product, as flex does. Positions outside the window or past the query are masked to -inf; a
#   chunk always holds at least one visible position, so no row of a run is all -inf.
# - One split: the program writes the output. Several: each writes fp32 (acc, max, sum) partials
#   and a second kernel combines them in split order (deterministic, no atomics). The split count
#   is fixed per batch bucket (a CUDA graph replays it): enough programs to fill the SMs, at
#   most PAGED_DECODE_MAX_SPLITS; a split a short row does not reach exits at once.

PAGED_DECODE_MAX_SPLITS = 16

if triton is not None:

    @triton.jit(do_not_specialize=["scale"])
    def _paged_decode_attention_kernel(
        q_ptr, k_ptr, v_ptr, pages_ptr, pos_ptr, out_ptr, partial_ptr, stats_ptr, scale,
        stride_qb, stride_qh, stride_kh, stride_kr, stride_vh, stride_vr, stride_pb,
        NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SLIDING_WINDOW: tl.constexpr,
        NUM_SPLITS: tl.constexpr, INPUT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
    ):  # fmt: skip
        """Row b, one KV head's query group, one run of the row's visible chunks: out [B, H, D]
        (one split), or partial [B, H, S, D] fp32 and stats [2, B, H, S] (max, sum of exp2)."""
        if USE_PDL:  # q and the new token's K/V come from the previous kernels
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        b = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        end = tl.load(pos_ptr + b).to(tl.int32) + 1  # visible logical positions: [start, end)
        start = 0
        if SLIDING_WINDOW > 0:
            start = tl.maximum(end - SLIDING_WINDOW, 0)
        first_block = start // PAGE_SIZE  # the logical block of the row's first listed page
        first_chunk = start // BLOCK_N
        num_chunks = (end - 1) // BLOCK_N - first_chunk + 1
        chunks_per_split = tl.cdiv(num_chunks, NUM_SPLITS)
        chunk_lo = first_chunk + split * chunks_per_split
        chunk_hi = tl.minimum(chunk_lo + chunks_per_split, first_chunk + num_chunks)
        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        offs_n = tl.arange(0, BLOCK_N)
        heads_G = kv_head * GROUP + offs_g
        is_head_G = offs_g < GROUP
        is_dim_D = offs_d < HEAD_DIM
        q_GD = tl.load(
            q_ptr + b * stride_qb + heads_G[:, None] * stride_qh + offs_d[None, :],
            mask=is_head_G[:, None] & is_dim_D[None, :],
            other=0.0,
        )
        qk_scale = scale * 1.4426950408889634  # exp(x) = exp2(x * log2(e))
        max_G = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
        sum_G = tl.zeros((GROUP_PAD,), dtype=tl.float32)
        acc_GD = tl.zeros((GROUP_PAD, HEAD_DIM_PAD), dtype=tl.float32)
        for chunk in range(chunk_lo, chunk_hi):
            logical_N = chunk * BLOCK_N + offs_n
            page = tl.load(pages_ptr + b * stride_pb + (chunk * BLOCK_N) // PAGE_SIZE - first_block).to(tl.int64)
            rows_N = page * PAGE_SIZE + logical_N % PAGE_SIZE
            k_ND = tl.load(
                k_ptr + kv_head * stride_kh + rows_N[:, None] * stride_kr + offs_d[None, :],
                mask=is_dim_D[None, :],
                other=0.0,
            )
            v_ND = tl.load(
                v_ptr + kv_head * stride_vh + rows_N[:, None] * stride_vr + offs_d[None, :],
                mask=is_dim_D[None, :],
                other=0.0,
            )
            s_GN = tl.dot(q_GD, tl.trans(k_ND), input_precision=INPUT_PRECISION) * qk_scale
            is_visible_N = (logical_N >= start) & (logical_N < end)
            s_GN = tl.where(is_visible_N[None, :], s_GN, float("-inf"))
            new_max_G = tl.maximum(max_G, tl.max(s_GN, 1))
            alpha_G = tl.math.exp2(max_G - new_max_G)
            p_GN = tl.math.exp2(s_GN - new_max_G[:, None])
            sum_G = sum_G * alpha_G + tl.sum(p_GN, 1)
            acc_GD = acc_GD * alpha_G[:, None] + tl.dot(p_GN.to(v_ND.dtype), v_ND, input_precision=INPUT_PRECISION)
            max_G = new_max_G
        store_mask = is_head_G[:, None] & is_dim_D[None, :]
        if NUM_SPLITS == 1:
            out_ptrs = out_ptr + (b * NUM_HEADS + heads_G[:, None]) * HEAD_DIM + offs_d[None, :]
            tl.store(out_ptrs, (acc_GD / sum_G[:, None]).to(out_ptr.dtype.element_ty), mask=store_mask)
        else:
            row_split_G = (b * NUM_HEADS + heads_G) * NUM_SPLITS + split
            tl.store(partial_ptr + row_split_G[:, None] * HEAD_DIM + offs_d[None, :], acc_GD, mask=store_mask)
            num_stats = tl.num_programs(0) * NUM_HEADS * NUM_SPLITS
            tl.store(stats_ptr + row_split_G, max_G, mask=is_head_G)
            tl.store(stats_ptr + num_stats + row_split_G, sum_G, mask=is_head_G)

    @triton.jit
    def _paged_decode_combine_kernel(
        partial_ptr, stats_ptr, out_ptr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, USE_PDL: tl.constexpr,
    ):  # fmt: skip
        """out[b, h] from the splits' partials, in split order: with w_s = 2^(max_s - max over splits),
        sum_s w_s acc_s / sum_s w_s sum_s."""
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        row = tl.program_id(0) * NUM_HEADS + tl.program_id(1)
        offs_s = tl.arange(0, NUM_SPLITS)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        num_stats = tl.num_programs(0) * NUM_HEADS * NUM_SPLITS
        max_S = tl.load(stats_ptr + row * NUM_SPLITS + offs_s)
        sum_S = tl.load(stats_ptr + num_stats + row * NUM_SPLITS + offs_s)
        row_max = tl.max(max_S, 0)
        weight_S = tl.where(max_S > float("-inf"), tl.math.exp2(max_S - row_max), 0.0)  # an empty split weighs 0
        acc_SD = tl.load(
            partial_ptr + (row * NUM_SPLITS + offs_s[:, None]) * HEAD_DIM + offs_d[None, :],
            mask=offs_d[None, :] < HEAD_DIM,
            other=0.0,
        )
        out_D = tl.sum(acc_SD * weight_S[:, None], 0) / tl.sum(sum_S * weight_S, 0)
        tl.store(out_ptr + row * HEAD_DIM + offs_d, out_D.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def resolve_decode_attention(decode_attention: str | None, device: torch.device) -> str:
    """The decode attention backend: by default the Triton kernel on CUDA, which measured faster
    than flex's decode kernel at 1-256 rows of E2B's attention (bench_decode_attention.py;
    numbers in scripts/benchmarks/README.md), and flex elsewhere."""
    if decode_attention is None:
        return "triton" if device.type == "cuda" and triton is not None else "flex"
    if decode_attention not in ("triton", "flex"):
        raise FlexInferenceError(
            f"decode_attention must be triton or flex, got {decode_attention!r}", "decode_attention"
        )
    if decode_attention == "triton" and (device.type != "cuda" or triton is None):
        raise FlexInferenceError(
            "decode_attention triton needs a CUDA device and triton; flex runs everywhere", "decode_attention"
        )
    return decode_attention


def paged_decode_splits(num_rows: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits of each row's positions: the largest power of two, up to PAGED_DECODE_MAX_SPLITS, that
    keeps the programs within two per SM (the fastest split counts at 1 to 256 rows of E2B's
    attention on an H200: bench_decode_attention.py)."""
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    splits = 1
    while splits < PAGED_DECODE_MAX_SPLITS and num_rows * num_kv_heads * splits * 2 <= 2 * num_sms:
        splits *= 2
    return splits


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pages_BP: torch.Tensor,
    input_pos_B: torch.Tensor,
    page_size: int,
    sliding_window: int | None,
    scale: float,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
) -> torch.Tensor:
    """Decode attention over the paged cache through the Triton kernel(s).

    q [B, H, 1, D]; caches [1, H_kv, rows, D] (row = physical page * page_size + offset);
    pages_BP [B, >= visible blocks]: row b's visible logical blocks' physical pages, in logical
    order from the window's left edge (PageTable.decode_blocks); input_pos_B: each query's logical
    position. Returns [B, H, 1, D] in q's dtype. Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1.
    num_splits, block_n (positions a loop step), num_warps and num_stages default to the engine's
    choice; the benchmark sweeps them.
    """
    B, H, _, D = q.shape
    num_kv_heads = k_cache.shape[1]
    if H % num_kv_heads or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError(
            f"paged decode attention needs query heads a multiple of KV heads and D contiguous caches: "
            f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}"
        )
    group = H // num_kv_heads
    # NOTE: 32 positions a step and 4 warps at head_dim 256 and 512 in bf16 (the tile sweep of
    # bench_decode_attention.py); float32 at 512 halves the step to fit two stages in shared memory.
    tile_bytes = D * q.element_size()
    block_n = block_n or min(page_size, 32 if tile_bytes <= 1024 else 16)
    if page_size % block_n:
        raise ValueError(f"paged decode attention needs a page size that is a multiple of {block_n}: {page_size}")
    num_splits = num_splits or paged_decode_splits(B, num_kv_heads, q.device)
    if num_splits & (num_splits - 1):
        raise ValueError(f"paged decode attention needs a power-of-two split count: {num_splits}")
    q_BHD = q.reshape(B, H, D)
    if q_BHD.stride(-1) != 1:
        q_BHD = q_BHD.contiguous()
    out_BHD = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    # partial_BHSD: fp32 partial outputs per split; stats_2BHS: their running max and exp2 sum
    partial_BHSD = stats_2BHS = out_BHD
    if num_splits > 1:
        partial_BHSD = torch.empty(B, H, num_splits, D, dtype=torch.float32, device=q.device)
        stats_2BHS = torch.empty(2, B, H, num_splits, dtype=torch.float32, device=q.device)
    head_dim_pad = triton.next_power_of_2(D)
    use_pdl = is_programmatic_launch_on(q.device)
    _paged_decode_attention_kernel[(B, num_kv_heads, num_splits)](
        q_BHD, k_cache, v_cache, pages_BP, input_pos_B, out_BHD, partial_BHSD, stats_2BHS, scale,
        q_BHD.stride(0), q_BHD.stride(1), k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
        pages_BP.stride(0),
        NUM_HEADS=H, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=D,
        HEAD_DIM_PAD=head_dim_pad, PAGE_SIZE=page_size, BLOCK_N=block_n, SLIDING_WINDOW=sliding_window or 0,
        NUM_SPLITS=num_splits,
        # NOTE: float32 operands would go through TF32 by default (~1e-3 relative error); "ieee" keeps fp32.
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", USE_PDL=use_pdl,
        # 8 warps where a program's tiles (q, K, V, the fp32 accumulator) would spill from 4 warps' registers
        num_warps=num_warps or (8 if tile_bytes > 1024 else 4), num_stages=num_stages,
        **programmatic_launch_option(use_pdl),
    )  # fmt: skip
    if num_splits > 1:
        _paged_decode_combine_kernel[(B, H)](
            partial_BHSD, stats_2BHS, out_BHD, NUM_HEADS=H, HEAD_DIM=D, HEAD_DIM_PAD=head_dim_pad,
            NUM_SPLITS=num_splits, USE_PDL=use_pdl, **programmatic_launch_option(use_pdl),
        )  # fmt: skip
    return out_BHD.view(B, H, 1, D)


# ---------------------------------------------------------------------------------------------
# Model patches: Qwen3/Llama attention, fused projections, skinny linears
# ---------------------------------------------------------------------------------------------


def qwen3_llama_attention_forward(
    self, hidden_states, position_embeddings, attention_mask=None, layer_step=None, **kwargs
):
    """Replaces Qwen3Attention/LlamaAttention.forward: project, norm (Qwen3), RoPE, paged flex attention."""
    input_shape = hidden_states.shape[:-1]  # [B, S]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q, k, v = (t.view(hidden_shape) for t in project(self, qkv_projections(self), "fused_qkv_weight", hidden_states))
    if hasattr(self, "q_norm"):  # Qwen3 normalises each head; Llama does not
        q, k = self.q_norm(q), self.k_norm(k)
    cos, sin = position_embeddings
    q = apply_rotary(q.transpose(1, 2), cos, sin)  # [B, H, S, D]
    k = apply_rotary(k.transpose(1, 2), cos, sin)  # [B, H_kv, S, D]
    attn_output = layer_step.attend(q, k, v.transpose(1, 2), self.scaling)
    attn_output = attn_output.transpose(1, 2).reshape(*input_shape, -1)
    return self.o_proj(attn_output), None


def qkv_projections(attn) -> list[nn.Module]:
    """The q/k/v projections an attention layer has (KV-shared Gemma-4 layers: only q)."""
    return [proj for proj in (getattr(attn, name, None) for name in ("q_proj", "k_proj", "v_proj")) if proj is not None]


def project(owner: nn.Module, linears: list[nn.Module], fused_name: str, x: torch.Tensor) -> list[torch.Tensor]:
    """Each linear's output: one GEMM over the fused weight when there is one. An unmerged adapter's
    A rows ride below the fused weight's (`fuse_linears`): that GEMM also gives x A^T [..., ranks],
    and one more applies every target's B at once (block-diagonal), times its scaling."""
    fused = getattr(owner, fused_name, None)
    if fused is None:
        return [linear(x) for linear in linears]
    # both multiply rows (linear_rows): a strided x or lora_hidden slice stays one GEMM
    linear = skinny_linear if getattr(owner, "is_skinny", False) else linear_rows
    out = linear(x, fused)  # [..., sum of outputs (+ sum of ranks)]
    lora_B_OR = getattr(owner, fused_name + "_lora_B", None)  # [sum of outputs, sum of ranks]
    if lora_B_OR is not None:
        base_out, lora_hidden = out.split(list(lora_B_OR.shape), dim=-1)
        # decode's B products take skinny_linear too: its race picks their backend as for every decode GEMM
        lora_out = linear(lora_hidden, lora_B_OR) * getattr(owner, fused_name + "_lora_scaling")
        out = (base_out + lora_out).to(base_out.dtype)
    return list(out.split(getattr(owner, fused_name + "_sizes"), dim=-1))


def fuse_decoder_projections(
    causal_lm: nn.Module, is_lora_merged: bool, unmerged_lora_layers: dict[str, nn.Module], patches: ModelPatches
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """q/k/v and gate/up of every layer each become one GEMM (fewer, larger GEMMs read weights faster).

    An unmerged adapter (`unmerged_lora_layers`: PEFT LoRA layers by text-model name) rides along:
    each group's GEMM also computes x A^T for its targets, and o_proj and down_proj, when targeted,
    become groups of one for it. A and B are then the engine's copies, in the weights' dtype,
    refreshed in place (`refresh_unmerged_lora`); returns them by target name. The base weights
    become views of the fused tensors, with the same values (zero copy: the trainer's own).
    """
    module_names = {module: text_model_name(name) for name, module in causal_lm.named_modules()}
    lora_weights = {}
    for layer in causal_lm.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = qkv_projections(attn)
        linears = qkv + [mlp.gate_proj, mlp.up_proj, attn.o_proj, mlp.down_proj]
        if any(getattr(linear, "base_layer", linear).bias is not None for linear in linears):
            raise FlexInferenceError("fuse_projections supports bias-free projections only", "fuse_projections")
        if any(is_quantized_linear(linear) for linear in linears):
            raise FlexInferenceError(
                "fuse_projections needs float weights; 4-bit weights keep one GEMM per projection", "fuse_projections"
            )
        adapters = {linear: unmerged_lora_layers.get(module_names[linear]) for linear in linears}
        if not is_lora_merged and any(hasattr(linear, "lora_A") and not adapters[linear] for linear in linears):
            raise FlexInferenceError(
                "fuse_projections would skip an adapter the engine was not given: pass its PEFT model as peft_model=",
                "fuse_projections",
            )
        for linear, adapter in adapters.items():
            if adapter is not None:
                check_unmerged_lora_layout(module_names[linear], adapter)
        groups = [(attn, qkv, "fused_qkv_weight"), (mlp, [mlp.gate_proj, mlp.up_proj], "fused_gate_up_weight")]
        groups += [(linear, [linear], "fused_weight") for linear in (attn.o_proj, mlp.down_proj) if adapters[linear]]
        for owner, group, fused_name in groups:
            if len(group) > 1 or any(adapters[linear] for linear in group):
                group_adapters = [adapters[linear] for linear in group]
                views = fuse_linears(owner, group, fused_name, group_adapters)
                lora_weights.update({module_names[linear]: views[linear] for linear in views})
        patches.replace_forward(mlp, fused_mlp_forward.__get__(mlp))
        for linear in (attn.o_proj, mlp.down_proj):
            if hasattr(linear, "fused_weight"):
                patches.replace_forward(linear, fused_linear_forward.__get__(linear))
    return lora_weights


def fuse_linears(
    owner: nn.Module, linears: list[nn.Module], name: str, adapters: list[nn.Module | None]
) -> dict[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """Concatenates the weights of linears that read the same input into `owner.<name>`
    ([sum of outputs + sum of ranks, in]) and makes each linear's weight a view of its rows: one GEMM
    computes them all, and in-place writes to a linear's weight (the LoRA refresh) land in the fused
    one. Each linear's adapter (a PEFT LoRA layer, or None) gets its A's rows below the weights and
    its B a block of `owner.<name>_lora_B` [sum of outputs, sum of ranks] (zero elsewhere), with its
    scaling on its output columns in `owner.<name>_lora_scaling`. Returns the (A, B) views by linear."""
    bases = [getattr(linear, "base_layer", linear) for linear in linears]
    sizes = [base.weight.shape[0] for base in bases]
    weights_A = {
        linear: adapter.lora_A[adapter.active_adapters[0]].weight
        for linear, adapter in zip(linears, adapters)
        if adapter is not None
    }
    ranks = [weight.shape[0] for weight in weights_A.values()]
    like = bases[0].weight
    fused = torch.empty(sum(sizes) + sum(ranks), like.shape[1], dtype=like.dtype, device=like.device)
    start = 0
    for base in bases:
        rows = base.weight.shape[0]
        fused[start : start + rows] = base.weight.detach()
        base.weight = nn.Parameter(fused[start : start + rows], requires_grad=False)
        start += rows
    setattr(owner, name, fused)
    setattr(owner, name + "_sizes", sizes)
    if not weights_A:
        return {}
    lora_B_OR = torch.zeros(sum(sizes), sum(ranks), dtype=like.dtype, device=like.device)
    scaling_O = torch.zeros(sum(sizes), dtype=torch.float32, device=like.device)
    views = {}
    row_start, rank_start = 0, 0
    for linear, adapter, size in zip(linears, adapters, sizes):
        if adapter is not None:
            rank = weights_A[linear].shape[0]
            rows, cols = slice(row_start, row_start + size), slice(rank_start, rank_start + rank)
            lora_A_RI = fused[sum(sizes) + rank_start : sum(sizes) + rank_start + rank]
            views[linear] = (lora_A_RI, lora_B_OR[rows, cols])
            scaling_O[rows] = adapter.scaling[adapter.active_adapters[0]]
            rank_start += rank
        row_start += size
    setattr(owner, name + "_lora_B", lora_B_OR)
    setattr(owner, name + "_lora_scaling", scaling_O)
    return views


def fused_mlp_forward(self, x):
    """Replaces the gated MLP's forward when gate/up are fused: down(act(gate) * up)."""
    gate, up = project(self, [self.gate_proj, self.up_proj], "fused_gate_up_weight", x)
    return self.down_proj(self.act_fn(gate) * up)


def fused_linear_forward(self, x):
    """Replaces an adapted o_proj's or down_proj's forward: its weight and the adapter's A in one GEMM."""
    return project(self, [self], "fused_weight", x)[0]


def route_linears_through_skinny(modules: list[nn.Module], patches: ModelPatches) -> None:
    """Every bias-free nn.Linear among `modules` and their fused projections go through
    skinny_linear: decode's few-row GEMMs take the Triton kernel wherever it beat cuBLAS on this
    GPU (prefill's many rows, and every GEMM on the CPU, stay F.linear)."""
    for module in modules:
        # NOTE: exact type: quantized linears (bitsandbytes' Linear4bit) subclass nn.Linear.
        if type(module) is nn.Linear and module.bias is None:
            patches.replace_forward(module, skinny_linear_forward.__get__(module))
        if any(hasattr(module, name) for name in ("fused_qkv_weight", "fused_gate_up_weight", "fused_weight")):
            module.is_skinny = True


def skinny_linear_forward(self, x):
    """Replaces a bias-free nn.Linear's forward: the same product through skinny_linear."""
    return skinny_linear(x, self.weight)


def unwrap_causal_lm(model: nn.Module) -> nn.Module:
    """The HF *ForCausalLM inside a PEFT wrapper (or the model itself)."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


# ---------------------------------------------------------------------------------------------
# LoRA double-copy, unmerged LoRA, and drift verification
# ---------------------------------------------------------------------------------------------
# The inference weights of every LoRA target are always rebuilt as pristine + delta from a
# pristine copy kept beside them, never by PEFT's merge/unmerge: in bf16, W + d - d != W, so a
# merge/unmerge cycle per training step drifts the base weights further every step. 4-bit weights
# cannot hold a merged delta at all: there the adapter runs beside them, unmerged.


def text_model_name(name: str) -> str:
    """A module's name in the text-only causal LM: PEFT's prefix stripped, and a multimodal Gemma-4's
    `model.language_model.` read as the text model's `model.`."""
    return name.removeprefix("base_model.model.").replace("model.language_model.", "model.")


def lora_layers(peft_model: nn.Module) -> dict[str, nn.Module]:
    """PEFT LoRA layers by the text-model name of the module they adapt (`text_model_name`)."""
    layers = {}
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and hasattr(module, "base_layer") and len(module.lora_A) > 0:
            if getattr(module, "use_dora", {}) and any(module.use_dora.values()):
                raise FlexInferenceError("DoRA adapters are not supported by the LoRA double-copy")
            layers[text_model_name(name)] = module
    return layers


def is_adapter_training(peft_model: nn.Module) -> bool:
    """True when some LoRA weight takes gradients: the model is a trainer's (get_peft_model), not an
    adapter loaded for inference (PeftModel.from_pretrained, which freezes it)."""
    return any(p.requires_grad for layer in lora_layers(peft_model).values() for p in layer.lora_A.parameters())


def lora_target_weights(causal_lm: nn.Module, peft_model: nn.Module) -> dict[str, torch.Tensor]:
    """The inference model's weight tensor for every module the adapter targets."""
    modules = dict(causal_lm.named_modules())
    targets = {}
    for name in lora_layers(peft_model):
        module = modules.get(name)
        if module is None:
            raise FlexInferenceError(f"the adapter targets {name}, which the inference model does not have")
        targets[name] = getattr(module, "base_layer", module).weight
    return targets


def snapshot_pristine_lora_weights(targets: dict[str, torch.Tensor], base_model: nn.Module | None = None) -> dict:
    """Pristine copies of the LoRA-target weights only (views of `base_model`'s when it is given)."""
    if base_model is None:
        return {name: weight.detach().clone() for name, weight in targets.items()}
    modules = {text_model_name(name): module for name, module in unwrap_causal_lm(base_model).named_modules()}
    pristine = {}
    for name in targets:
        module = modules[name]
        pristine[name] = getattr(module, "base_layer", module).weight.detach()
    return pristine


@torch.no_grad()
def refresh_lora_merge_from_pristine(
    targets: dict, pristine: dict, peft_model: nn.Module, adapter_name: str | None = None
) -> None:
    """Writes pristine + scaling * B @ A (computed in float32, rounded once) into each target in place.

    In place keeps the same storage, so captured CUDA graphs stay valid. PEFT's layers are marked
    merged so that, if `peft_model` wraps the inference model itself, its forward skips the adapter.
    """
    for name, layer in lora_layers(peft_model).items():
        adapter = adapter_name or layer.active_adapters[0]
        weight_A = layer.lora_A[adapter].weight.float()
        weight_B = layer.lora_B[adapter].weight.float()
        delta = (weight_B @ weight_A) * layer.scaling[adapter]
        if layer.fan_in_fan_out:
            delta = delta.T
        target = targets[name]
        merged = pristine[name].to(device=target.device, dtype=torch.float32) + delta.to(target.device)
        target.copy_(merged.to(target.dtype))
        if target is layer.base_layer.weight:
            layer.merged_adapters = [adapter]


def is_quantized_linear(module: nn.Module) -> bool:
    """True for a bitsandbytes 4-bit linear (its weight packed, not a float tensor)."""
    return not getattr(module, "base_layer", module).weight.is_floating_point()


def resolve_merge_lora(merge_lora: bool | None, causal_lm: nn.Module, peft_model: nn.Module) -> bool:
    """Whether the adapter is merged: None merges unless a target is 4-bit (a merge would quantise
    the delta away), where it is refused."""
    modules = dict(causal_lm.named_modules())
    is_quantized = any(is_quantized_linear(modules[name]) for name in lora_layers(peft_model) if name in modules)
    if merge_lora and is_quantized:
        raise FlexInferenceError(
            "a LoRA adapter cannot be merged into 4-bit weights (the merge would quantise it away): "
            "leave merge_lora unset",
            "merge_lora",
        )
    return not is_quantized if merge_lora is None else merge_lora


def attach_unmerged_lora(
    causal_lm: nn.Module, peft_model: nn.Module, patches: ModelPatches, is_live_adapter: bool, skip=()
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Gives every module the adapter targets (but those in `skip`, fused with their projections) a
    forward (inside the engine's calls) of base(x) + (x A^T) B^T * scaling, PEFT's own order of
    operations and dtypes, with A [rank, in] and B [out, rank]: the adapter's own parameters when
    `is_live_adapter` (zero copy: the engine runs the trainer's PEFT model, whose optimizer updates
    them in place), else the engine's copies of them, refreshed in place. Either way captured CUDA
    graphs stay valid. A PEFT layer's adapter path is replaced (its base layer computes the base).
    Returns (A, B) by module name."""
    modules = dict(causal_lm.named_modules())
    device = causal_lm.model.embed_tokens.weight.device
    lora_weights = {}
    for name, layer in lora_layers(peft_model).items():
        if name in skip:
            continue
        module = modules.get(name)
        if module is None:
            raise FlexInferenceError(f"the adapter targets {name}, which the inference model does not have")
        check_unmerged_lora_layout(name, layer)
        adapter = layer.active_adapters[0]
        lora_A_RI, lora_B_OR = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
        if is_live_adapter:  # views: they keep the storage the graphs read, whatever the trainer reassigns
            lora_A_RI, lora_B_OR = lora_A_RI.detach(), lora_B_OR.detach()
        else:
            lora_A_RI = torch.zeros(lora_A_RI.shape, dtype=lora_A_RI.dtype, device=device)
            lora_B_OR = torch.zeros(lora_B_OR.shape, dtype=lora_B_OR.dtype, device=device)
        base_layer = getattr(module, "base_layer", None)
        base_forward = base_layer if base_layer is not None else patches.forward_of(module)
        patches.replace_forward(
            module,
            unmerged_lora_forward.__get__(module),
            flex_lora_base_forward=base_forward,
            flex_lora_A_RI=lora_A_RI,
            flex_lora_B_OR=lora_B_OR,
            flex_lora_scaling=layer.scaling[adapter],
        )
        lora_weights[name] = (lora_A_RI, lora_B_OR)
    return lora_weights


def check_unmerged_lora_layout(name: str, layer: nn.Module) -> None:
    """An unmerged adapter multiplies by A and B as they are: one stored transposed is refused."""
    if layer.fan_in_fan_out:
        raise FlexInferenceError(f"{name} stores its weight transposed (fan_in_fan_out): not supported")


def unmerged_lora_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A LoRA target's forward inside the engine: the base product plus the adapter's, unmerged; the
    adapter's product in its weights' dtype and the sum back in the base's, as PEFT computes them.
    Its base forward, A [rank, in], B [out, rank] and scaling are the module's `flex_lora_*`
    attributes, set only while the engine's patches are installed."""
    base_out = module.flex_lora_base_forward(x)
    lora_A_RI, lora_B_OR = module.flex_lora_A_RI, module.flex_lora_B_OR
    lora_out = linear_rows(linear_rows(x.to(lora_A_RI.dtype), lora_A_RI), lora_B_OR) * module.flex_lora_scaling
    return (base_out + lora_out).to(base_out.dtype)


@torch.no_grad()
def refresh_unmerged_lora(lora_weights: dict, peft_model: nn.Module, adapter_name: str | None = None) -> None:
    """Copies the adapter's A and B into the engine's (its scaling is fixed when they are attached)."""
    for name, layer in lora_layers(peft_model).items():
        adapter = adapter_name or layer.active_adapters[0]
        lora_A_RI, lora_B_OR = lora_weights[name]
        lora_A_RI.copy_(layer.lora_A[adapter].weight)
        lora_B_OR.copy_(layer.lora_B[adapter].weight)


def reads_live_adapter(lora_weights: dict, peft_model: nn.Module) -> bool:
    """Zero copy: whether the engine's A and B are still the adapter's own storage and dtype (a
    trainer may replace them, e.g. TRL casts a 4-bit model's adapter to bf16 when it starts)."""
    for name, layer in lora_layers(peft_model).items():
        adapter = layer.active_adapters[0]
        for engine_weight, weight in zip(
            lora_weights[name], (layer.lora_A[adapter].weight, layer.lora_B[adapter].weight)
        ):
            if engine_weight.data_ptr() != weight.data_ptr() or engine_weight.dtype != weight.dtype:
                return False
    return True


def sha256_of(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@torch.no_grad()
def run_drift_verification(
    targets: dict, pristine: dict, peft_model: nn.Module, refresh, iterations: int = 5, seed: int = 0
) -> dict:
    """Perturbs the LoRA weights `iterations` times, calling `refresh` each time; then restores the
    first adapter. Passes when the `pristine` weights never changed and the restored `targets` (what
    the refresh writes) are bit-equal to the first ones."""
    generator = torch.Generator().manual_seed(seed)
    layers = lora_layers(peft_model)
    lora_params = {
        f"{name}.{part}": getattr(layer, part)[layer.active_adapters[0]].weight
        for name, layer in layers.items()
        for part in ("lora_A", "lora_B")
    }
    first_adapter = {name: p.detach().clone() for name, p in lora_params.items()}
    pristine_before = sha256_of(pristine)
    refresh()
    merged_first = sha256_of(targets)
    merged_per_iteration = []
    for _ in range(iterations):
        for p in lora_params.values():
            noise = torch.randn(p.shape, generator=generator) * (p.float().std().item() + 1e-3)
            p.add_(noise.to(device=p.device, dtype=p.dtype))
        refresh()
        merged_per_iteration.append(sha256_of(targets))
    for name, p in lora_params.items():
        p.copy_(first_adapter[name])
    refresh()
    merged_restored = sha256_of(targets)
    pristine_after = sha256_of(pristine)
    result = {
        "iterations": iterations,
        "pristine_sha256_before": pristine_before,
        "pristine_sha256_after": pristine_after,
        "merged_sha256_first": merged_first,
        "merged_sha256_restored": merged_restored,
        "merged_sha256_per_iteration": merged_per_iteration,
        "pristine_unchanged": pristine_before == pristine_after,
        "restored_matches_first": merged_first == merged_restored,
        "adapter_changed_merge": all(h != merged_first for h in merged_per_iteration),
    }
    result["passed"] = (
        result["pristine_unchanged"] and result["restored_matches_first"] and result["adapter_changed_merge"]
    )
    return result


# ---------------------------------------------------------------------------------------------
# Data parallel: one engine per rank (torchrun)
# ---------------------------------------------------------------------------------------------

# What generate() fills in, sent from the rank that generated a sequence to every rank (input_ids
# and max_new_tokens are set on every rank already: generate_shard prepares every sequence).
GATHERED_FIELDS = ("output_ids", "output_logprobs", "finished", "finish_reason", "num_preemptions")


def is_torchrun() -> bool:
    """True when torchrun (or a launcher that sets the same variables) started this process."""
    return all(name in os.environ for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"))


def init_data_parallel(device: torch.device) -> torch.device:
    """Under torchrun: joins its process group (nccl on CUDA, gloo on the CPU) and returns this
    rank's device, on CUDA cuda:LOCAL_RANK made the current device; a process group that is already
    initialised is used as it is. Otherwise returns `device` as it is.
    """
    if not is_torchrun():
        return device
    # NOTE: NVLink multicast (NCCL's NVLS, symmetric-memory multicast) stays off: on a shared host
    # it can take the GPUs out of service, and gathering completions gains nothing from it. NCCL
    # reads these when the process group starts, so they are set before.
    for name, value in (
        ("NCCL_NVLS_ENABLE", "0"),
        ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
        ("NVSHMEM_DISABLE_NVLS", "1"),
    ):
        os.environ.setdefault(name, value)
    if device.type == "cuda":
        num_local_ranks, num_gpus = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count()
        if num_local_ranks > num_gpus:
            raise FlexInferenceError(
                f"torchrun started {num_local_ranks} processes on a host with {num_gpus} GPUs: "
                "start at most one per GPU"
            )
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)  # object collectives over nccl run on the current device
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None
        )
    return device


def is_data_parallel() -> bool:
    """True once a process group is initialised (by init_data_parallel or by the caller)."""
    return dist.is_available() and dist.is_initialized()


def shard_slice(num_items: int, rank: int, world_size: int) -> slice:
    """Rank's contiguous block of num_items; the first num_items % world_size ranks hold one more.
    With more ranks than items the last ranks get an empty block."""
    base, extra = divmod(num_items, world_size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


def generate_shard(engine: FlexInference, sequences: list[Sequence], group=None, **generate_kwargs) -> list[Sequence]:
    """Generates this rank's shard_slice of `sequences` and returns that block (every sequence
    without a process group). Every rank of `group` (None: the default group) passes the same list
    and an engine of the same seed; each checks, tokenizes and seeds all of it once (a sequence
    without a seed draws by its index in the whole list), then generates its own block: the tokens
    are one process's, whatever the number of ranks."""
    if not is_data_parallel():
        return engine.generate(sequences, **generate_kwargs)
    # NOTE: every rank checks every sequence, so bad input fails on all ranks alike instead of on
    # one, which would leave the others waiting in the gather until the process group times out.
    shard = shard_slice(len(sequences), dist.get_rank(group), dist.get_world_size(group))
    return engine.generate(sequences, shard=shard, **generate_kwargs)


def gather_outputs(sequences: list[Sequence], group=None) -> list[Sequence]:
    """After generate_shard on every rank: copies each rank's results into `sequences` on every rank
    (all_gather_object), so every rank holds all of them, in input order. `output_logits` are not
    sent: they stay on the rank that generated them. Without a process group: nothing to do."""
    if not is_data_parallel():
        return sequences
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    shard = sequences[shard_slice(len(sequences), rank, world_size)]
    local = (len(sequences), [[getattr(seq, name) for name in GATHERED_FIELDS] for seq in shard])
    gathered = [None] * world_size  # gathered[rank] = (number of sequences, that rank's results)
    dist.all_gather_object(gathered, local, group=group)
    num_sequences = [num for num, _ in gathered]
    if len(set(num_sequences)) != 1:
        raise FlexInferenceError(f"the ranks passed {num_sequences} sequences: every rank must pass the same list")
    results = [values for _, block in gathered for values in block]  # blocks in rank order = input order
    for seq, values in zip(sequences, results):
        for name, value in zip(GATHERED_FIELDS, values):
            setattr(seq, name, value)
    return sequences


def generate_sharded(engine: FlexInference, sequences: list[Sequence], group=None, **generate_kwargs) -> list[Sequence]:
    """Data-parallel `engine.generate`: every rank of `group` (None: the default group) passes the
    same `sequences` and its own engine, generates a contiguous block of them, and gets all of them
    back filled in, in input order: the tokens of `engine.generate(sequences)` in one process, seeds
    included (`generate_shard`). `generate_kwargs` go to `engine.generate`. Without a process
    group this is `engine.generate(sequences)`. Prompts may be given as `generate` takes them."""
    sampling = generate_kwargs.get("sampling_params")
    sequences = [engine.as_sequence(prompt, i, sampling) for i, prompt in enumerate(sequences)]
    generate_shard(engine, sequences, group, **generate_kwargs)
    return gather_outputs(sequences, group)


# ---------------------------------------------------------------------------------------------
# TRL: the engine as GRPOTrainer's rollout backend
# ---------------------------------------------------------------------------------------------
# GRPOTrainer(..., rollout_func=make_trl_rollout_func(engine)). TRL calls rollout_func(prompts,
# trainer) with this process's slice of the generation batch: each prompt repeated num_generations
# times in a row (its RepeatSampler's order), and wants one completion per entry back, in that order.


def make_trl_rollout_func(
    engine: FlexInference,
    sampling_params: SamplingParams | None = None,
    capture_cudagraph: bool = False,
    freeze_gc: bool = True,
):
    """A `rollout_func` for TRL's `GRPOTrainer` that samples on `engine`.

    At each new trainer step it syncs the weights first: `engine.refresh_lora()` when the trainer
    trains a PEFT adapter (build the engine with `peft_model=` the trainer's model and `base_model=`
    it too, so its frozen base weights are the pristine copy), `engine.load_weights` of the trainer's
    parameters otherwise. Prompts are tokenized as TRL does (its chat template for conversational
    prompts, its tokenizer with special tokens for text). Temperature, top-p, top-k, min-p, the
    completion length and the number of completions (`num_generations`, `num_generations_eval` in
    eval) come from the trainer's `GRPOConfig`; `sampling_params` gives the rest (seed, None: a new
    one each call; stop_token_ids; ignore_eos). Returns TRL's `prompt_ids`, `completion_ids` and
    per-token `logprobs` (log_softmax(logits / temperature) of each chosen token, as TRL computes
    them). `capture_cudagraph` decodes with CUDA graphs (captured on the first call; the in-place
    weight syncs keep them valid). An engine built with `enable_sleep_mode` holds its KV pool only
    while it generates: it sleeps through the trainer's log-prob pass, backward and optimizer step.
    `freeze_gc`: at the weight sync after the first step (compiles, captures, the optimizer's state
    all made), one full garbage collection, then `gc.freeze()`. The objects alive then (models,
    compiled code, the trainer's) leave the collector's view until training ends (`gc.unfreeze()`
    in the trainer's `on_train_end`): its full collections meanwhile scan only newer objects.
    Without it, each of them scans the whole heap: 0.35-0.51 s once every two or three steps of
    TRL's E2B step on a GPU, and 0.29 s against 0.4 ms frozen on the CPU for the trained CI Gemma-4
    (scripts/benchmarks/README.md). A training run that raises leaves the heap frozen: call
    `gc.unfreeze()` before dropping its models, or their memory stays held.
    """
    base_params = sampling_params or SamplingParams()
    synced_step = [None]  # the trainer step whose weights the engine holds
    is_freeze_due = [freeze_gc]  # gc.freeze() at the next weight sync after the first

    def rollout_func(prompts: list, trainer) -> dict[str, list]:
        with awake_while_generating(engine):
            return generate_for_trl(prompts, trainer)

    def generate_for_trl(prompts: list, trainer) -> dict[str, list]:
        if trainer.state.global_step != synced_step[0]:
            if synced_step[0] is not None and is_freeze_due[0]:  # a step done: what is alive now lives on
                gc.collect()
                gc.freeze()
                trainer.add_callback(thaw_heap_at_train_end())
                is_freeze_due[0] = False
            sync_trainer_weights(engine, trainer.accelerator.unwrap_model(trainer.model))
            synced_step[0] = trainer.state.global_step
        num_generations = trainer.num_generations if trainer.model.training else trainer.num_generations_eval
        # NOTE: a process's slice may cut a prompt group (several processes): then each entry is a prompt of its own.
        is_grouped = len(prompts) % num_generations == 0 and all(
            prompts[i] == prompts[i - i % num_generations] for i in range(len(prompts))
        )
        n = num_generations if is_grouped else 1
        unique_ids = trl_prompt_ids(trainer, prompts[::n])
        params = trl_sampling_params(trainer, base_params, n)
        if params.seed is None:  # NOTE: every process's engine has the same seed; its index keeps their draws apart
            params = dataclasses.replace(
                params, seed=engine.seeds.getrandbits(60) + trainer.accelerator.process_index * 2**40
            )
        groups = engine.rollouts(unique_ids, params, capture_cudagraph)
        return {
            "prompt_ids": [ids for ids, group in zip(unique_ids, groups) for _ in group],
            "completion_ids": [seq.output_ids for group in groups for seq in group],
            "logprobs": [seq.output_logprobs for group in groups for seq in group],
        }

    return rollout_func


def thaw_heap_at_train_end():
    """A trainer callback that gives the frozen heap (`make_trl_rollout_func`'s `freeze_gc`) back to
    the garbage collector when training ends, so a later run's deleted models are collected."""
    from transformers import TrainerCallback

    class ThawHeapAtTrainEnd(TrainerCallback):
        def on_train_end(self, args, state, control, **kwargs):
            gc.unfreeze()

    return ThawHeapAtTrainEnd()


@contextlib.contextmanager
def awake_while_generating(engine: FlexInference):
    """With sleep mode, the engine's KV pool is held only while it generates: given back for the
    trainer's log-prob pass, backward and optimizer step."""
    is_sleep_mode = engine.runner.kv_memory.is_sleep_mode
    if is_sleep_mode:
        engine.wake_up()
    try:
        yield
    finally:
        if is_sleep_mode:
            engine.sleep()


def sync_trainer_weights(engine: FlexInference, trainer_model: nn.Module) -> None:
    """Brings the engine's weights to the trainer's: re-merges the adapter, or copies every weight;
    zero copy (the engine runs the trainer's own model) has nothing to bring."""
    is_peft = callable(getattr(trainer_model, "get_base_model", None))
    if engine.peft_model is not None:
        if engine.peft_model is not trainer_model:
            raise FlexInferenceError("the engine's peft_model is not the trainer's model: build it with that model")
        engine.refresh_lora()  # zero copy: only checks that the engine still reads the adapter's storage
    elif is_peft:
        raise FlexInferenceError(
            "the trainer trains a PEFT adapter the engine does not know: wrap the model with get_peft_model "
            "yourself and give it to the trainer and to the engine as peft_model= (zero copy: as model= too)"
        )
    elif unwrap_causal_lm(trainer_model) is not engine.causal_lm:
        engine.load_weights(trainer_model.named_parameters())
    elif engine.fuse_projections:  # else zero copy: the weights are the trainer's, updated in place
        raise FlexInferenceError(TRAINERS_OWN_MODEL)


def trl_prompt_ids(trainer, prompts: list) -> list[list[int]]:
    """The prompts' token ids as GRPOTrainer builds them: its chat template with the generation
    prompt for conversational prompts, its tokenizer (special tokens included) for text."""
    from trl.data_utils import is_conversational

    if trainer.tools:
        raise FlexInferenceError("tool calling is not supported by the engine's TRL rollouts")
    if not is_conversational({"prompt": prompts[0]}):
        return trainer.processing_class(text=prompts)["input_ids"]
    return trainer.processing_class.apply_chat_template(
        conversation=prompts,
        chat_template=trainer.chat_template,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        **trainer.chat_template_kwargs,
    )["input_ids"]


def trl_sampling_params(trainer, base: SamplingParams, n: int) -> SamplingParams:
    """`base` with the sampling of the trainer's GRPOConfig, `n` completions per prompt and their log-probs."""
    if trainer.repetition_penalty != 1.0 or trainer.args.generation_kwargs:
        raise FlexInferenceError(
            "the engine's TRL rollouts support no repetition_penalty or generation_kwargs: leave them unset"
        )
    return dataclasses.replace(
        base,
        temperature=trainer.temperature,
        top_p=trainer.top_p,
        top_k=trainer.top_k or 0,
        min_p=trainer.min_p or 0.0,
        n=n,
        max_tokens=trainer.max_completion_length,
        stop_token_ids=tuple(base.stop_token_ids) + tuple(trainer.eos_token_ids),
        logprobs=0,
    )


# The importance-sampling modes of GRPOConfig's `vllm_importance_sampling_mode`.
IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# GRPO's loss types whose per-token policy loss is linear in the advantage, with a factor chosen by its sign.
ADVANTAGE_LINEAR_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo")

# The multimodal inputs of TRL's `_get_per_token_logps_and_entropies`, as `_compute_loss` reads them from the batch.
TRL_MULTIMODAL_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


def sampler_corrected(trainer_class=None) -> type:
    """A subclass of `trainer_class` (default: TRL's `GRPOTrainer`) that applies TRL's importance-sampling
    correction to the log-probs a `rollout_func` returns, as TRL 1.16 does only on its vLLM path.

    With GRPOConfig's `vllm_importance_sampling_correction` (TRL's default), after each generation:
    the trainer's log-probs of the completions (`old_per_token_logps`, one no-grad forward over the
    batch unless TRL computed them; kept in the batch, so the PPO ratio starts from them as on the vLLM
    path), the ratio exp(trainer - sampler) of TRL's `vllm_importance_sampling_mode` (per token or per
    sequence; truncated or masked at `vllm_importance_sampling_clip_min/max`; see
    `sampler_importance_ratio`), and TRL's metrics `sampling/sampling_logp_difference/{mean,max}` and
    `sampling/importance_sampling_ratio/{min,mean,max}`. Without the correction it changes nothing.
    `use_vllm=True` (TRL corrects itself) and loss types outside `ADVANTAGE_LINEAR_LOSS_TYPES` (`vespo`)
    are refused with one sentence.

    NOTE: TRL multiplies each token's policy loss by the ratio (non-negative, detached) before adding
    the KL term. For every loss in `ADVANTAGE_LINEAR_LOSS_TYPES` that policy loss is linear in the
    advantage A with a factor chosen by A's sign (`-min(coef_1 * A, coef_2 * A)`, cispo's and sapo's
    `-c * A`), so the ratio is folded into the advantages instead, without a copy of `_compute_loss`:
    `advantages` becomes (B, T) in token modes, (B, 1) in sequence modes (`_compute_loss` takes both;
    the batch's shuffle and split cut along B only). Loss and gradient are TRL's; only its clip-ratio
    metrics, which read A's sign and shape, tell the two apart: a token whose ratio is 0 (mask modes) no
    longer counts as clipped, and with `importance_sampling_level="sequence"` and a token mode they
    average over tokens, not sequences.
    """
    if trainer_class is None:
        from trl import GRPOTrainer

        trainer_class = GRPOTrainer

    class SamplerCorrected(trainer_class):
        def __init__(self, model, reward_funcs=None, args=None, *rest, **kwargs):
            if args is not None:  # before TRL's init, which starts vLLM for use_vllm=True
                check_sampler_correction(args)
            super().__init__(model, reward_funcs, args, *rest, **kwargs)

        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            if self.vllm_importance_sampling_correction and output.get("sampling_per_token_logps") is not None:
                check_sampler_correction(self)
                correct_for_sampler(self, output)
            return output

    SamplerCorrected.__name__ = SamplerCorrected.__qualname__ = f"SamplerCorrected{trainer_class.__name__}"
    return SamplerCorrected


def check_sampler_correction(config) -> None:
    """Refuses what `sampler_corrected` cannot do as TRL does; `config` is a GRPOConfig or the trainer
    (both carry the same attribute names)."""
    if not config.vllm_importance_sampling_correction:
        return
    if config.use_vllm:
        raise FlexInferenceError(
            "TRL applies its importance-sampling correction itself with use_vllm=True: "
            "use GRPOTrainer, not sampler_corrected"
        )
    if config.loss_type not in ADVANTAGE_LINEAR_LOSS_TYPES:
        raise FlexInferenceError(
            f"sampler_corrected cannot fold the importance-sampling ratio into loss_type {config.loss_type!r} "
            "(TRL's vespo reweights by it inside its gamma weights): use one of "
            f"{', '.join(ADVANTAGE_LINEAR_LOSS_TYPES)} or vllm_importance_sampling_correction=False"
        )
    if config.vllm_importance_sampling_mode not in IMPORTANCE_SAMPLING_MODES:
        raise FlexInferenceError(
            f"unknown vllm_importance_sampling_mode {config.vllm_importance_sampling_mode!r}: "
            f"use one of {', '.join(IMPORTANCE_SAMPLING_MODES)}"
        )


def correct_for_sampler(trainer, output: dict) -> None:
    """TRL's vLLM-path correction on one generation batch `output`, in place: `old_per_token_logps`
    (computed if TRL did not), the metrics, and the ratio folded into `advantages`."""
    from trl.models.utils import disable_gradient_checkpointing

    mode = "train" if trainer.model.training else "eval"
    completion_mask_BT = output["completion_mask"]
    mask_BT = completion_mask_BT if output.get("tool_mask") is None else completion_mask_BT * output["tool_mask"]
    if output.get("old_per_token_logps") is None:
        batch_size = (
            trainer.args.per_device_train_batch_size if mode == "train" else trainer.args.per_device_eval_batch_size
        )
        # The inputs `_compute_loss` gives the model, so the PPO ratio starts at 1 from these log-probs.
        multimodal = {key: output.get(key) for key in TRL_MULTIMODAL_KEYS}
        with torch.no_grad(), disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs):
            output["old_per_token_logps"], _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model,
                torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1),
                torch.cat([output["prompt_mask"], completion_mask_BT], dim=1),
                output["completion_ids"].size(1),
                batch_size=batch_size,
                **multimodal,
            )
    trainer_logps_BT, sampler_logps_BT = output["old_per_token_logps"], output["sampling_per_token_logps"]
    ratio = sampler_importance_ratio(
        trainer_logps_BT,
        sampler_logps_BT,
        mask_BT,
        trainer.vllm_importance_sampling_mode,
        trainer.vllm_importance_sampling_clip_min,
        trainer.vllm_importance_sampling_clip_max,
    )
    is_sequence_level = trainer.vllm_importance_sampling_mode.startswith("sequence_")
    log_sampler_metrics(trainer, mode, trainer_logps_BT, sampler_logps_BT, mask_BT.bool(), ratio, is_sequence_level)
    advantages = output["advantages"]
    if advantages.dim() == 1:  # TRL's advantages are (B,); a subclass may give (B, T)
        advantages = advantages.unsqueeze(1)
    output["advantages"] = advantages * ratio  # (B, T) token modes, (B, 1) sequence modes


def sampler_importance_ratio(
    trainer_logps_BT: torch.Tensor,
    sampler_logps_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> torch.Tensor:
    """TRL 1.16's importance-sampling ratio of its vLLM path, from the trainer's and the sampler's log-probs.

    The difference trainer - sampler is 0 outside `mask_BT` and where the sampler's log-prob is NaN
    (one it could not give). `token_*` modes: exp of each token's difference, (B, T); `sequence_*`:
    exp of their sum over the sequence, (B, 1). `*_truncate` clamps the ratio to [clip_min, clip_max];
    `*_mask` sets a ratio outside that range to 0. A None bound is open.
    """
    difference_BT = torch.nan_to_num((trainer_logps_BT - sampler_logps_BT) * mask_BT, nan=0.0)
    if mode.startswith("sequence_"):
        difference_BT = difference_BT.sum(dim=-1, keepdim=True)
    ratio = torch.exp(difference_BT)
    if mode.endswith("_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    lower = -math.inf if clip_min is None else clip_min
    upper = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < lower) | (ratio > upper), 0.0)


def log_sampler_metrics(
    trainer, mode: str, trainer_logps_BT, sampler_logps_BT, mask_BT, ratio, is_sequence_level: bool
) -> None:
    """TRL's vLLM-path metrics, gathered over the processes as TRL gathers them: |trainer - sampler| over
    the masked tokens the sampler scored (mean, max), and the ratio over the masked tokens, or over the
    sequences in sequence modes (min, mean, max)."""
    from trl.trainer.utils import nanmax, nanmin

    device, metrics = mask_BT.device, trainer._metrics[mode]
    delta = torch.abs(trainer_logps_BT - sampler_logps_BT)
    delta = delta[mask_BT & ~torch.isnan(delta)]
    zero = torch.tensor(0.0, device=device)
    metrics["sampling/sampling_logp_difference/mean"].append(
        trainer.accelerator.gather(delta.mean() if delta.numel() else zero).mean().item()
    )
    metrics["sampling/sampling_logp_difference/max"].append(
        trainer.accelerator.gather(delta.max() if delta.numel() else zero).max().item()
    )
    flat_ratio = ratio.flatten() if is_sequence_level else ratio[mask_BT]
    if not flat_ratio.numel():
        flat_ratio = zero.unsqueeze(0)
    metrics["sampling/importance_sampling_ratio/min"].append(
        nanmin(trainer.accelerator.gather(flat_ratio.min())).item()
    )
    metrics["sampling/importance_sampling_ratio/mean"].append(
        trainer.accelerator.gather(flat_ratio.mean()).nanmean().item()
    )
    metrics["sampling/importance_sampling_ratio/max"].append(
        nanmax(trainer.accelerator.gather(flat_ratio.max())).item()
    )


# ---------------------------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------------------------

PRESETS_DIR = Path(__file__).resolve().parent / "scripts" / "presets"


def check_model_path(model_name: str) -> None:
    """A local-looking path that does not exist fails here rather than as a hub lookup, and so does a
    hub id that is not in the Hugging Face cache while the hub cannot be reached (transformers would
    retry for over a minute before failing). A local folder must hold config.json (check_model_folder)."""
    path = os.path.expanduser(model_name)
    if os.path.isdir(path):
        check_model_folder(model_name)
        return
    if os.path.exists(path):
        raise FlexInferenceError(
            f"model path {model_name} is a file: pass the checkpoint folder that holds config.json"
        )
    if model_name.startswith((".", "/", "~")) or model_name.count("/") != 1:
        raise FlexInferenceError(f"model path {model_name} does not exist: pass a checkpoint folder or a hub id")
    if is_in_hub_cache(model_name):
        return
    reason = hub_unreachable_reason()
    if reason is not None:
        raise FlexInferenceError(
            f"{model_name} is not a local folder and not in the Hugging Face cache, and the hub cannot be reached "
            f"({reason}): pass a checkpoint folder, or download it where the hub is reachable"
        )


def check_model_folder(model_name: str) -> None:
    """Refuses a local folder without config.json in one sentence that says what it is instead: a
    LoRA adapter (adapter_config.json; its base model named where the adapter records it), a folder
    of model folders (one or two named), or neither."""
    folder = Path(model_name).expanduser()
    if (folder / "config.json").is_file():
        return
    if (folder / "adapter_config.json").is_file():
        base_model = adapter_base_model(folder)
        base = f"its base model {base_model}" if base_model else "the base model it was trained on"
        raise FlexInferenceError(
            f"{model_name} is a LoRA adapter, not a model: pass {base} as model_name and it as lora_adapter",
            "model_name",
            "lora_adapter",
        )
    models = sorted(child.name for child in folder.iterdir() if (child / "config.json").is_file())
    if models:
        such_as = " and ".join(os.path.join(model_name, name) for name in models[:2])
        raise FlexInferenceError(
            f"{model_name} has no config.json but holds model folders, such as {such_as}: pass one of them"
        )
    raise FlexInferenceError(
        f"{model_name} has no config.json, so it is not a checkpoint folder: pass one that holds config.json "
        "and the weights, or a hub id"
    )


def adapter_base_model(adapter_folder: Path) -> str | None:
    """The base model a PEFT adapter folder records (base_model_name_or_path); None when it records none."""
    try:
        base_model = json.loads((adapter_folder / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):  # unreadable, not JSON, or not an object: no name to give
        return None
    return base_model if isinstance(base_model, str) and base_model else None


def is_in_hub_cache(repo_id: str) -> bool:
    """Whether the Hugging Face cache holds the config of hub model `repo_id`."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except ValueError:  # not a valid repo id
        return False


TRUE_VALUES = ("1", "ON", "YES", "TRUE")  # how huggingface_hub reads a boolean environment variable


def hub_unreachable_reason(timeout_s: float = 2.0) -> str | None:
    """Why the Hugging Face hub cannot be reached (offline mode, or no TCP connection to it, or to
    the HTTPS proxy, within `timeout_s`); None when it can."""
    from huggingface_hub import constants

    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(name, "").upper() in TRUE_VALUES or (name == "HF_HUB_OFFLINE" and constants.HF_HUB_OFFLINE):
            return f"{name} is set"
    url = urllib.parse.urlparse(urllib.request.getproxies().get("https") or constants.ENDPOINT)
    if url.hostname is None:
        return None
    address = (url.hostname, url.port or (443 if url.scheme == "https" else 80))
    try:
        # NOTE: the timeout does not bound the DNS lookup, which fails fast where there is no network.
        socket.create_connection(address, timeout=timeout_s).close()
    except OSError as error:
        return f"no connection to {address[0]}:{address[1]}: {error.strerror or error}"
    return None


def preset_config_path(model_name: str) -> Path | None:
    path = PRESETS_DIR / (model_name.replace("/", "__") + ".json")
    return path if path.exists() else None


def load_config(model_name: str, trust_remote_code: bool = False, use_preset: bool = True):
    """The model's config: with `use_preset`, a shipped preset (no download) for a hub id under
    scripts/presets; otherwise, or without one, the checkpoint's own."""
    from transformers import AutoConfig

    preset = preset_config_path(model_name) if use_preset else None
    if preset is not None and not os.path.isdir(model_name):
        return AutoConfig.for_model(**json.loads(preset.read_text()))
    check_model_path(model_name)
    try:
        return AutoConfig.from_pretrained(model_name, trust_remote_code=trust_remote_code)
    except OSError as error:
        raise FlexInferenceError(f"could not read the config of {model_name}: {str(error).splitlines()[0]}")


def load_tokenizer(model_name: str, trust_remote_code: bool = False, required: bool = True):
    """The checkpoint's tokenizer; None when there is none and it is not `required`."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        if required:
            raise FlexInferenceError(f"could not load the tokenizer of {model_name}: {str(error).splitlines()[0]}")
        return None


def load_causal_lm(
    path: str,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    load_in_4bit: bool = False,
    trust_remote_code: bool = False,
    allow_pickle_weights: bool = False,
    seed: int = 0,
    model_class=None,
    config_hook=None,
    say=None,
) -> nn.Module:
    """Loads a causal LM (eager attention) on `device`, in eval mode.

    load_format "dummy" builds it from its config alone with random weights (seeded; for
    benchmarks). Weights come from safetensors unless `allow_pickle_weights` (pickles can run
    code). `load_in_4bit` quantises every decoder linear to bitsandbytes NF4 while loading, with
    `dtype` as the compute dtype (lm_head and the embeddings, tied or not, stay in `dtype`); a
    checkpoint that is bitsandbytes 4-bit already loads as it is, with or without it.
    `config_hook` maps the config before a dummy build (e.g. to a multimodal config's text part).
    `say`, when given, is called with one line before a dummy build saying what it builds (a large
    build takes minutes on a CPU).
    """
    from transformers import AutoModelForCausalLM

    model_class = model_class or AutoModelForCausalLM
    if load_format == "dummy":
        config = load_config(path, trust_remote_code)
        if config_hook is not None:
            config = config_hook(config)
        if say is not None:
            say(dummy_build_line(path, config, dtype, device))
        torch.manual_seed(seed)
        with torch.device(device), explain_out_of_memory(path, config, AutoModelForCausalLM, dtype, device, False):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
        if load_in_4bit:
            return quantized_dummy(model, dtype, device, model_class)
        return model.eval()
    check_model_path(path)
    kwargs = dict(dtype=dtype, attn_implementation="eager", trust_remote_code=trust_remote_code)
    kwargs["use_safetensors"] = None if allow_pickle_weights else True
    is_prequantized = is_bnb_4bit_checkpoint(load_config(path, trust_remote_code, use_preset=False))
    if load_in_4bit or is_prequantized:
        check_bnb_4bit(device)
        if not is_prequantized:
            kwargs["quantization_config"] = nf4_config(dtype)
        kwargs["device_map"] = device_map_of(device)
    try:
        with explain_out_of_memory(path, None, model_class, dtype, device, load_in_4bit, trust_remote_code):
            model = model_class.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as error:
        if isinstance(error, FlexInferenceError):
            raise
        first_line = str(error).strip().splitlines()[0]
        if "safetensors" in first_line or ".bin" in first_line or "pytorch_model" in first_line:
            raise FlexInferenceError(
                f"{path} has no safetensors weights; pickled ones can run code, "
                "so they load only with allow_pickle_weights",
                "allow_pickle_weights",
            )
        raise FlexInferenceError(f"could not load {path}: {first_line}")
    if not (load_in_4bit or is_prequantized):
        with explain_out_of_memory(path, model.config, model_class, dtype, device, load_in_4bit):
            model = model.to(device)
    fit_bnb_cpu_kernels(model)
    return model.eval()


def dummy_build_line(path: str, config, dtype: torch.dtype, device: torch.device) -> str:
    """What a dummy build of `config` makes, in one line: its parameter count and their size at `dtype`."""
    from transformers import AutoModelForCausalLM

    as_dtype = f"as {str(dtype).removeprefix('torch.')}"
    num_params = count_parameters(path, config, AutoModelForCausalLM)
    if num_params is not None:
        num_bytes = num_params * dtype.itemsize
        count = f"{num_params / 1e9:.3g}B" if num_params >= 1e8 else f"{num_params / 1e6:.3g}M"
        size = f"{num_bytes / 1e9:.3g} GB" if num_bytes >= 1e8 else f"{num_bytes / 1e6:.3g} MB"
        as_dtype = f"{count} parameters, {size} {as_dtype}"
    return f"building {path}'s architecture with random weights ({as_dtype}) on {device}"


def device_map_of(device: torch.device) -> dict:
    """transformers' device_map that puts the whole model on `device` (quantised loads place it so)."""
    return {"": device.index or 0} if device.type == "cuda" else {"": device.type}


def nf4_config(compute_dtype: torch.dtype):
    """bitsandbytes NF4 (no double quantisation: one float32 scale per 64 weights)."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype)


def is_bnb_4bit_checkpoint(config) -> bool:
    """True for a checkpoint saved in bitsandbytes 4-bit (its config names the quantisation)."""
    quantization = getattr(config, "quantization_config", None) or {}
    if not isinstance(quantization, dict):
        quantization = quantization.to_dict()
    return quantization.get("quant_method") == "bitsandbytes" and bool(quantization.get("load_in_4bit"))


def check_bnb_4bit(device: torch.device) -> None:
    """Refuses, in one sentence, a device the installed bitsandbytes cannot run 4-bit on."""
    try:
        import bitsandbytes.functional as bnb_functional

        packed, state = bnb_functional.quantize_4bit(torch.ones(64, 64, device=device), quant_type="nf4")
        bnb_functional.dequantize_4bit(packed, state)
    except Exception as error:  # ImportError, or a backend without this device's kernels
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise FlexInferenceError(
            f"4-bit weights need bitsandbytes with 4-bit kernels for {device.type}: {reason}", "load_in_4bit"
        ) from None


def fit_bnb_cpu_kernels(model: nn.Module) -> None:
    """bitsandbytes repacks a 4-bit weight for its AVX512-BF16 CPU kernel at the first forward: that
    kernel computes in bfloat16 (its scales too), and the repacking needs out_features divisible by
    32 and in_features by the quantisation block. Linears computing in float32, or of other shapes,
    keep the plain kernel (dequantise, then a float32 product)."""
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            blocksize = module.weight.quant_state.blocksize
            if module.compute_dtype == torch.float32 or module.out_features % 32 or module.in_features % blocksize:
                module.support_avx512bf16_for_cpu = False


def quantized_dummy(model: nn.Module, dtype: torch.dtype, device: torch.device, model_class) -> nn.Module:
    """A random-weight model in 4 bits, quantised exactly as a real checkpoint is while loading:
    saved, then loaded back through transformers' bitsandbytes path (benchmarks only)."""
    check_bnb_4bit(device)
    with tempfile.TemporaryDirectory(prefix="dummy_4bit_") as folder:
        model.save_pretrained(folder)
        del model
        quantized = model_class.from_pretrained(
            folder,
            dtype=dtype,
            attn_implementation="eager",
            quantization_config=nf4_config(dtype),
            device_map=device_map_of(device),
        )
    fit_bnb_cpu_kernels(quantized)
    return quantized.eval()


@contextlib.contextmanager
def explain_out_of_memory(path, config, model_class, dtype, device, load_in_4bit, trust_remote_code=False):
    """Turns running out of memory while the weights load into one sentence: about how many GB they
    need (from `config`, or the checkpoint's own when None), and what lowers it."""
    try:
        yield
    except (RuntimeError, MemoryError) as error:
        message = str(error)
        if not (isinstance(error, (torch.OutOfMemoryError, MemoryError)) or "not enough memory" in message):
            raise
        as_what = "in 4 bits" if load_in_4bit else f"as {str(dtype).removeprefix('torch.')}"
        num_params = count_parameters(path, config, model_class, trust_remote_code)
        size = f"do not fit {as_what} in the memory {device} has free"
        if num_params is not None:
            num_bytes = num_params * (0.5 if load_in_4bit else dtype.itemsize)
            size = f"need about {num_bytes / 1e9:.3g} GB {as_what}, more than {device} has free"
        if load_in_4bit:
            raise FlexInferenceError(f"the weights of {path} {size}: pick a GPU with more free memory") from None
        raise FlexInferenceError(
            f"the weights of {path} {size}: pick a smaller dtype, or load_in_4bit", "dtype", "load_in_4bit"
        ) from None


def count_parameters(path, config, model_class, trust_remote_code: bool = False) -> int | None:
    """The model's parameter count, from a build on the meta device (no memory); None if that fails."""
    from transformers import AutoModelForCausalLM

    try:
        if config is None:
            config = load_config(path, trust_remote_code, use_preset=False)
        with torch.device("meta"):
            if model_class is AutoModelForCausalLM:
                model = AutoModelForCausalLM.from_config(config)
            else:
                model = model_class(config)
    except Exception:  # an estimate for an error message: without it the message only drops the number
        return None
    return sum(param.numel() for param in model.parameters())


def load_qwen3_llama(path: str, dtype: torch.dtype, device: torch.device, **load_kwargs) -> nn.Module:
    """load_causal_lm for this engine (`load_kwargs` as for it), refusing a Gemma-4 checkpoint
    before its weights load."""
    is_dummy = load_kwargs.get("load_format") == "dummy"
    config = load_config(path, load_kwargs.get("trust_remote_code", False), use_preset=is_dummy)
    if config.model_type.startswith("gemma4"):
        raise FlexInferenceError(
            f"{path} is a {config.model_type} checkpoint, not Qwen3/Llama: run it with gemma4_flex_inference.py"
        )
    return load_causal_lm(path, dtype, device, **load_kwargs)


def load_peft_adapter(model: nn.Module, adapter_path: str):
    """The PEFT adapter at `adapter_path` on `model`, refused when it was made for another model: its
    weights' modules are missing or shaped otherwise, or its target_modules select modules it has no
    weights for (PEFT would only warn, and leave those modules unadapted)."""
    from peft import PeftModel

    weights = read_adapter_weights(adapter_path)
    check_adapter_weights_fit(model, weights, adapter_path)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Found missing adapter keys")  # refused just below
        peft_model = PeftModel.from_pretrained(model, adapter_path, is_trainable=False)
    if weights:
        adapted = {lora_module_name(key) for key in weights}
        targets = [name for name, module in peft_model.named_modules() if len(getattr(module, "lora_A", ()))]
        missing = [name for name in map(lora_module_name, targets) if name not in adapted]
        if missing:
            raise FlexInferenceError(
                f"the adapter at {adapter_path} does not fit this model: its target_modules select {missing[0]} "
                f"here ({len(missing)} modules in all), which it has no weights for"
            )
    return peft_model


def read_adapter_weights(adapter_path: str) -> dict[str, torch.Tensor]:
    """The adapter's safetensors weights by PEFT's saved names; empty when it has none."""
    from safetensors.torch import load_file

    weights_path = Path(adapter_path) / "adapter_model.safetensors"
    return load_file(weights_path) if weights_path.exists() else {}


def lora_module_name(key: str) -> str:
    """The module a saved adapter weight adapts: base_model.model.<module>.lora_A.weight -> <module>."""
    return key.removeprefix("base_model.model.").split(".lora_")[0]


def check_adapter_weights_fit(model: nn.Module, weights: dict[str, torch.Tensor], adapter_path: str) -> None:
    """Before PEFT wraps `model`: every module the adapter's lora_A / lora_B weights adapt exists, and
    lora_A [r, in_features] and lora_B [out_features, r] match its features."""
    modules = dict(model.named_modules())
    for key, weight in weights.items():
        name, part = lora_module_name(key), key.partition(".lora_")[2][:2]
        if part not in ("A.", "B."):
            continue  # embedding LoRA, DoRA magnitudes: left to PEFT
        module = modules.get(name)
        if module is None:
            raise FlexInferenceError(
                f"the adapter at {adapter_path} does not fit this model: it adapts {name}, which the model lacks"
            )
        in_features, out_features = getattr(module, "in_features", None), getattr(module, "out_features", None)
        if in_features is None or out_features is None:
            continue  # not a linear layer: left to PEFT
        features = weight.shape[-1] if part == "A." else weight.shape[0]
        if weight.dim() != 2 or features != (in_features if part == "A." else out_features):
            raise FlexInferenceError(
                f"the adapter at {adapter_path} does not fit this model: {name}.lora_{part[0]} has shape "
                f"{tuple(weight.shape)}, but {name} maps {in_features} features to {out_features} here"
            )


def check_adapter_folder(adapter_path: str) -> None:
    """Refuses, in one sentence, an adapter path that is not a folder holding adapter_config.json."""
    if not os.path.isdir(adapter_path):
        if os.path.exists(adapter_path):
            raise FlexInferenceError(f"LoRA adapter path {adapter_path} is a file: pass the adapter's folder")
        raise FlexInferenceError(f"LoRA adapter folder {adapter_path} does not exist")
    if not os.path.isfile(os.path.join(adapter_path, "adapter_config.json")):
        if os.path.isfile(os.path.join(adapter_path, "config.json")):
            raise FlexInferenceError(
                f"{adapter_path} is a model, not a LoRA adapter (it has config.json but no adapter_config.json): "
                "pass the folder PEFT's save_pretrained wrote the adapter to"
            )
        raise FlexInferenceError(f"{adapter_path} has no adapter_config.json, so it is not a PEFT LoRA adapter folder")


def load_lora(model: nn.Module, adapter_path: str, load_adapter=None) -> nn.Module:
    """`model` wrapped with the PEFT LoRA adapter at `adapter_path` (through `load_adapter`,
    default load_peft_adapter), in eval mode."""
    check_adapter_folder(adapter_path)
    try:
        peft_model = (load_adapter or load_peft_adapter)(model, adapter_path)
    except FlexInferenceError:
        raise
    except (ValueError, KeyError, RuntimeError) as error:
        raise FlexInferenceError(
            f"the adapter at {adapter_path} does not fit this model: {str(error).strip().splitlines()[0]}"
        )
    return peft_model.eval()


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------

DEMO_PROMPTS_PATH = Path(__file__).resolve().parent / "scripts" / "demo_prompts.txt"
# A file of this name in a checkpoint folder marks its weights as random (the tiny test checkpoints).
RANDOM_WEIGHTS_MARKER = "RANDOM_WEIGHTS"

GRPO_SYSTEM_PROMPT = (
    "You are given a problem. Think about the problem and provide your working out. "
    "Place it between <start_working_out> and <end_working_out>. "
    "Then, provide your solution between <SOLUTION></SOLUTION>."
)


def main(argv=None) -> None:
    args = build_arg_parser(
        "unsloth/Qwen3-4B-Base", "Rollouts (greedy or sampled) for Qwen3 / Llama-3.2 on flex_attention."
    ).parse_args(argv)
    run_cli(args, load_model=load_qwen3_llama)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help with each flag's default appended, unless its help says what the default is itself (a
    --no_x flag, whose stored default True would read backwards; an automatic default shown as None)."""

    def _get_help_string(self, action):
        return action.help if "default" in (action.help or "") else super()._get_help_string(action)


def build_arg_parser(default_model_name: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)
    p.add_argument("--model_name", default=default_model_name, help="Hugging Face hub id or local checkpoint folder")
    p.add_argument(
        "--device", choices=["auto", "cuda", "cpu"], default="auto", help="where to run (auto: CUDA if available)"
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float16", "float32"],
        default="auto",
        help="weight and activation dtype (auto: bfloat16 on CUDA, float32 on CPU)",
    )
    p.add_argument(
        "--n_prompts", type=int, default=8, help="number of prompts per round (cycles through the prompt list)"
    )
    p.add_argument("--n_rounds", type=int, default=2, help="generation rounds; the first includes compilation")
    p.add_argument("--max_new_tokens", type=int, default=256, help="new tokens per prompt at most")
    p.add_argument("--max_batch_size", type=int, default=32, help="sequences decoded together at most")
    p.add_argument(
        "--max_seq_length",
        type=int,
        default=2048,
        help="prompt + completion tokens per sequence at most (a multiple of page_size)",
    )
    p.add_argument(
        "--n_pages",
        type=int,
        default=None,
        help=f"pages in the KV pool, page 0 reserved (default: auto: {CUDA_AUTO_N_PAGES} on CUDA; on the CPU "
        "enough for max_batch_size sequences of max_seq_length, within "
        f"{CPU_AUTO_MEMORY_FRACTION * 100:.0f}%% of the free RAM); a pool larger than the free memory is refused; "
        "--kv_cache_gb or --kv_cache_memory_fraction size it from a memory budget instead",
    )
    p.add_argument(
        "--kv_cache_gb",
        type=float,
        default=None,
        help="a memory budget for the KV pool in GB (1e9 bytes): the pool gets the most pages that fit in it, up to "
        "what max_batch_size sequences of max_seq_length can use (default: none, --n_pages sizes the pool)",
    )
    p.add_argument(
        "--kv_cache_memory_fraction",
        type=float,
        default=None,
        help="a memory budget for the KV pool as a share, in (0, 1], of the device's free memory when the engine "
        "is built, sized as --kv_cache_gb (default: none, --n_pages sizes the pool)",
    )
    p.add_argument("--page_size", type=int, default=128, help="tokens per KV page")
    p.add_argument("--capture_cudagraph", action="store_true", help="decode through CUDA graphs, one per batch bucket")
    p.add_argument(
        "--compile_decode",
        action="store_true",
        help="torch.compile the decode step by regions (prologue, one graph per kind of decoder layer, epilogue), "
        "once for all batch buckets (fuses norms, RoPE, residuals)",
    )
    p.add_argument(
        "--fuse_projections",
        action="store_true",
        help="one GEMM for q/k/v and one for gate/up per layer (weights become views of the fused ones)",
    )
    p.add_argument(
        "--no_skinny_gemms", dest="skinny_gemms", action="store_false",
        help="cuBLAS for every GEMM (default: off, so decode's few-row GEMMs race a Triton kernel against cuBLAS "
        "per weight shape on the GPU and keep the faster)",
    )  # fmt: skip
    p.add_argument(
        "--decode_attention", choices=("triton", "flex"), default=None,
        help="decode attention over the paged cache: the project's Triton kernel over each row's pages, or "
        "flex_attention's decode kernel (default: triton on CUDA, flex on the CPU)",
    )  # fmt: skip
    p.add_argument("--lora_adapter", default=None, help="PEFT LoRA adapter folder, merged with the double-copy refresh")
    p.add_argument(
        "--no_merge_lora",
        action="store_true",
        help="apply the adapter beside the weights (two small GEMMs per target) instead of merging it; "
        "4-bit weights always take it so",
    )
    p.add_argument(
        "--load_in_4bit",
        action="store_true",
        help="quantise the decoder's linears to bitsandbytes NF4 while loading, --dtype as compute dtype "
        "(a checkpoint in bitsandbytes 4-bit loads as it is without it)",
    )
    p.add_argument("--verify_no_drift", action="store_true", help="run the LoRA drift verification before generating")
    p.add_argument("--verify_iterations", type=int, default=5, help="adapter perturbations in the drift verification")
    p.add_argument("--stats_path", default=None, help="write run statistics as JSON here")
    p.add_argument(
        "--chat_template",
        choices=["auto", "grpo", "native"],
        default="auto",
        help="grpo: a system prompt asking for reasoning then a marked solution (a prompt's own system turn is "
        "kept instead); native: the turns as given; both in the tokenizer's chat template",
    )
    p.add_argument(
        "--fa4_prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prefill with flex_attention's FLASH backend, flash-attn-4 (default: auto, on wherever it can run: "
        "CUDA capability 9.x or 10.x, flash_attn installed, head_dim <= 256; --no-fa4_prefill: always Triton)",
    )
    p.add_argument(
        "--decode_kernel_options",
        default=None,
        help="JSON dict of flex_attention kernel options for decode, overriding the defaults",
    )
    p.add_argument(
        "--prefill_kernel_options",
        default=None,
        help="JSON dict of flex_attention kernel options for prefill, overriding the defaults",
    )
    p.add_argument(
        "--prompts_file",
        default=None,
        help="prompts as JSONL (prompt/text/messages per line) or one prompt per line "
        "(default: built-in math word problems)",
    )
    p.add_argument(
        "--load_format",
        choices=["auto", "dummy"],
        default="auto",
        help="dummy: random weights built from the config alone (benchmarks)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="random seed (dummy weights, drift perturbations; sampling: completion j of prompt i "
        "draws with seed + i * n + j)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument(
        "--top_p",
        type=float,
        default=1.0,
        help="nucleus sampling: the smallest set of tokens with this much probability (1.0: off)",
    )
    p.add_argument("--top_k", type=int, default=0, help="sample among the k most likely tokens (0: off)")
    p.add_argument(
        "--min_p", type=float, default=0.0, help="drop tokens less likely than min_p times the most likely (0.0: off)"
    )
    p.add_argument(
        "--n", type=int, default=1, help="completions per prompt (the prompt is prefilled once and its pages shared)"
    )
    p.add_argument("--trust_remote_code", action="store_true", help="allow code shipped inside the checkpoint to run")
    p.add_argument(
        "--allow_pickle_weights",
        action="store_true",
        help="allow pickled .bin weights (can run code); safetensors otherwise",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def run_cli(args, engine_class=None, load_model=None, default_chat_template: str = "grpo", load_adapter=None) -> dict:
    """Runs the CLI on parsed `args`; returns the stats. Bad input ends the process with one
    sentence and a non-zero exit, the library's parameter names written as flags."""
    try:
        return run_rounds(
            args, engine_class or FlexInference, load_model or load_causal_lm, default_chat_template, load_adapter
        )
    except FlexInferenceError as error:
        raise SystemExit(cli_message(error, vars(args)))


def cli_message(error: FlexInferenceError, flags) -> str:
    """The error's sentence with each parameter it names (that is also a flag) written as that flag."""
    message = str(error)
    for param in error.params:
        if param in flags:
            # NOTE: not inside a path the sentence names (runs/lora_adapter, model_name.json).
            message = re.sub(rf"(?<![\w/.-]){param}(?![\w/-]|\.\w)", "--" + param, message)
    return message


# Flags passed on as they are: to the model loader, and to the engine.
LOADER_FLAGS = ("load_format", "load_in_4bit", "trust_remote_code", "allow_pickle_weights", "seed")
ENGINE_FLAGS = (
    "max_batch_size", "max_seq_length", "n_pages", "kv_cache_gb", "kv_cache_memory_fraction", "page_size",
    "max_new_tokens", "fa4_prefill", "compile_decode", "fuse_projections", "skinny_gemms", "decode_attention",
)  # fmt: skip


def flags_of(args, names: tuple[str, ...]) -> dict:
    return {name: getattr(args, name) for name in names}


def check_cli_args(args) -> None:
    """Flag combinations the CLI refuses, before anything is loaded."""
    for flag in ("max_new_tokens", "n_rounds", "verify_iterations"):
        if getattr(args, flag) < 1:
            raise FlexInferenceError(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if args.verify_no_drift and args.lora_adapter is None:
        raise FlexInferenceError("--verify_no_drift checks a LoRA refresh: pass --lora_adapter too")
    if args.lora_adapter is not None:
        check_adapter_folder(args.lora_adapter)
    if args.stats_path is not None:
        check_writable_file(args.stats_path, "--stats_path")
    check_engine_limits(
        args.max_batch_size,
        args.max_seq_length,
        args.n_pages,
        args.page_size,
        args.max_new_tokens,
        args.kv_cache_gb,
        args.kv_cache_memory_fraction,
    )


def check_writable_file(path: str, flag: str) -> None:
    """Refuses, before any work, a `flag` file that could not be written once the work is done: a
    folder, one under a file, or one where writing is not permitted (read-only file system included)."""
    target = Path(path)
    if target.is_dir():
        raise FlexInferenceError(f"{flag} {path} is a folder: name a file, such as {os.path.join(path, 'stats.json')}")
    folder = target.parent
    while not folder.exists():  # the folders still to be created: the first that exists must take them
        folder = folder.parent
    if not folder.is_dir():
        raise FlexInferenceError(f"{flag} {path} cannot be created: {folder} is a file, not a folder")
    where = target if target.exists() else folder  # a file there is overwritten, a new one made in folder
    if not os.access(where, os.W_OK):
        raise FlexInferenceError(f"{flag} {path} cannot be written: {where} is read-only to this user")


def write_stats(stats: dict, path: str) -> None:
    """The run's stats as JSON at `path`, its folders created."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(stats, indent=2))
    except OSError as error:
        raise FlexInferenceError(f"could not write --stats_path {path}: {error.strerror or error}")


def run_rounds(args, engine_class, load_model, default_chat_template: str, load_adapter) -> dict:
    """Loads the model, builds the engine, generates --n_rounds times, prints one summary line.

    Under torchrun each rank runs one engine on its contiguous block of the prompts; rank 0 gathers
    the completions in input order, prints and writes the stats (totals and one entry per rank).
    """
    check_cli_args(args)
    sampling = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, n=args.n, seed=args.seed
    )
    decode_options = parse_json_dict(args.decode_kernel_options, "--decode_kernel_options")
    prefill_options = parse_json_dict(args.prefill_kernel_options, "--prefill_kernel_options")
    prompts = read_prompts(args.prompts_file, args.n_prompts)
    torch.manual_seed(args.seed)
    device, dtype = resolve_device_and_dtype(args.device, args.dtype)
    if args.capture_cudagraph and device.type != "cuda":
        raise FlexInferenceError("--capture_cudagraph needs a CUDA device")
    owns_process_group = is_torchrun() and not is_data_parallel()
    device = init_data_parallel(device)
    is_distributed = is_data_parallel()
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if is_distributed else (0, 1)
    if rank != 0:  # only rank 0 prints
        args.quiet = True
    quiet_libraries(args.quiet)

    start = time.perf_counter()
    model = load_model(
        args.model_name, dtype, device, say=lambda line: _say(args, line), **flags_of(args, LOADER_FLAGS)
    )
    # Dummy weights take a tokenizer only from a local folder: a preset needs no network.
    is_dummy = args.load_format == "dummy"
    tokenizer = None
    if not is_dummy or os.path.isdir(args.model_name):
        tokenizer = load_tokenizer(args.model_name, args.trust_remote_code, required=not is_dummy)
    peft_model = None
    if args.lora_adapter is not None:
        model = load_lora(model, args.lora_adapter, load_adapter)
        peft_model = model
    load_s = time.perf_counter() - start
    if is_dummy:
        _say(
            args, f"built {args.model_name}'s architecture with random weights (--load_format dummy) in {load_s:.1f} s"
        )
    else:
        _say(args, f"loaded {args.model_name} in {load_s:.1f} s")

    engine = engine_class(
        model,
        tokenizer,
        decode_kernel_options=decode_options,
        prefill_kernel_options=prefill_options,
        peft_model=peft_model,
        merge_lora=False if args.no_merge_lora else None,
        **flags_of(args, ENGINE_FLAGS),
    )
    drift = None
    if args.verify_no_drift:
        drift = engine.verify_no_drift(args.verify_iterations, args.seed)
        _say(
            args,
            f"drift verification: {'passed' if drift['passed'] else 'FAILED'} over {drift['iterations']} refreshes "
            f"of {drift['covers']}",
        )

    chat_template = default_chat_template if args.chat_template == "auto" else args.chat_template
    wall_times, rank_wall_times, n_decoded = [], [], 0
    sequences: list[Sequence] = []
    shard: list[Sequence] = []  # this rank's block of sequences (all of them in a plain run)
    for _ in range(args.n_rounds):
        prompt_sequences = make_sequences(prompts, tokenizer, chat_template, engine.config.vocab_size, args.seed)
        groups = completion_groups(prompt_sequences, sampling, args.seed)
        sequences = [seq for group in groups for seq in group]
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        shard = generate_shard(engine, sequences, capture_cudagraph=args.capture_cudagraph, progress=not args.quiet)
        rank_wall_times.append(time.perf_counter() - start)
        gather_outputs(sequences)  # a round ends when the slowest rank's completions are in
        wall_times.append(time.perf_counter() - start)
        n_decoded = sum(len(seq.output_ids) for seq in sequences)
    rank_n_decoded = sum(len(seq.output_ids) for seq in shard)
    rank_stats = {
        "rank": rank,
        "device": str(device),
        "n_prompts": len(shard),
        "n_decoded_tokens": rank_n_decoded,
        "wall_times_s": rank_wall_times,
        "decode_tps_median": statistics.median([rank_n_decoded / t for t in rank_wall_times]),
        # Last round, split by phase: prompt tokens per prefill second, tokens per decode-step second.
        "prefill_tps": engine.timings["num_prefill_tokens"] / max(engine.timings["prefill_s"], 1e-9),
        "decode_step_tps": engine.timings["num_decode_tokens"] / max(engine.timings["decode_s"], 1e-9),
        "peak_memory_gb": peak_memory_gb(device),
        "capture_s": engine.timings.get("capture_s"),
    }
    ranks = [rank_stats]  # ranks[rank] = that rank's stats
    if is_distributed:
        ranks = [None] * world_size
        dist.all_gather_object(ranks, rank_stats)
    if owns_process_group:
        dist.destroy_process_group()

    # Round 1 compiles kernels (and captures CUDA graphs): start-up, reported apart from the rounds after it.
    timed_wall_times = wall_times[1:] or wall_times
    decode_tps = [n_decoded / t for t in timed_wall_times]
    n_cut = sum(
        seq.finish_reason == "length" and len(seq.output_ids) < args.max_new_tokens for seq in sequences
    )  # stopped by max_seq_length before max_new_tokens
    stats = {
        "backend": "flex_attention"
        + ("+compiled_step" if args.compile_decode else "")
        + ("+cudagraph" if args.capture_cudagraph else ""),
        "model_name": args.model_name,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "capture_cudagraph": args.capture_cudagraph,
        "lora_adapter": args.lora_adapter,
        "lora_merged": peft_model is not None,
        "n_prompts": len(prompts),
        "n_completions": len(sequences),
        "sampling": {name: getattr(sampling, name) for name in ("temperature", "top_p", "top_k", "min_p", "n", "seed")},
        "n_decoded_tokens": n_decoded,
        "n_cut_by_max_seq_length": n_cut,
        "wall_times_s": wall_times,
        "first_round_s": wall_times[0],
        "timed_rounds": len(timed_wall_times),
        "median_wall_s": statistics.median(timed_wall_times),
        "best_wall_s": min(timed_wall_times),
        "decode_tps_median": statistics.median(decode_tps),
        "decode_tps_best": max(decode_tps),
        "max_new_tokens": args.max_new_tokens,
        "peak_memory_gb": max(r["peak_memory_gb"] for r in ranks),
        "kv_bytes_per_token": engine.runner.kv_bytes_per_token,
        # The KV pool as built: pages per attention regime's pool (page 0 reserved in each), all pools' GB.
        "kv_pool_pages": {regime: table.n_pages for regime, table in engine.scheduler.page_tables.items()},
        "kv_pool_gb": engine.runner.kv_pool_bytes / 1e9,
        "load_s": load_s,
        "capture_s": rank_stats["capture_s"],
        # Summed over the ranks (one rank in a plain run).
        "prefill_tps": sum(r["prefill_tps"] for r in ranks),
        "decode_step_tps": sum(r["decode_step_tps"] for r in ranks),
        "sample_completions": [
            tokenizer.decode(seq.output_ids, skip_special_tokens=True) if tokenizer is not None else seq.output_ids[:32]
            for seq in sequences[:3]
        ],
    }
    if drift is not None:
        stats["drift_verification"] = drift
    if is_distributed:
        stats.update(world_size=world_size, ranks=ranks)
    if args.stats_path and rank == 0:
        write_stats(stats, args.stats_path)
    if rank == 0:
        print_summary(stats, args, is_random=is_dummy or (Path(args.model_name) / RANDOM_WEIGHTS_MARKER).is_file())
    if drift is not None and not drift["passed"]:
        raise FlexInferenceError("drift verification failed: the pristine or restored weights changed")
    return stats


def print_summary(stats: dict, args, is_random: bool) -> None:
    """The run in a few lines on stdout: start-up apart from the timed rounds, what tok/s counts,
    length cuts, and the first completions."""
    on_ranks = f" on {stats['world_size']} ranks" if "world_size" in stats else ""
    n = stats["sampling"]["n"]
    print(
        f"{stats['backend']}: {stats['n_prompts']} prompts x {n} completion{'s' * (n > 1)}{on_ranks}, "
        f"{stats['n_decoded_tokens']} new tokens a round, KV pool {stats['kv_pool_gb']:.3g} GB, "
        f"peak {stats['peak_memory_gb']:.2f} GB"
    )
    capture = f", CUDA graphs captured in {stats['capture_s']:.1f} s" if stats.get("capture_s") else ""
    print(f"start-up: load {stats['load_s']:.1f} s, first round (compiles) {stats['first_round_s']:.2f} s{capture}")
    if args.n_rounds > 1:
        print(
            f"timed rounds ({stats['timed_rounds']} after the first): median {stats['median_wall_s']:.2f} s, "
            f"{stats['decode_tps_median']:.0f} new tokens/s (best {stats['decode_tps_best']:.0f}), "
            "each round end to end: tokenizing, prefill and decode"
        )
    else:
        tps = stats["decode_tps_median"]
        print(f"one round, compiles included: {tps:.0f} new tokens/s (--n_rounds 2 also times a warm round)")
    if stats["n_cut_by_max_seq_length"]:
        print(
            f"{stats['n_cut_by_max_seq_length']} of {stats['n_completions']} completions stopped at --max_seq_length "
            f"{args.max_seq_length} before --max_new_tokens {args.max_new_tokens}"
        )
    for number, text in enumerate(stats["sample_completions"][:2], 1):
        lines = text.strip().splitlines()[:12] if isinstance(text, str) else [f"token ids {text}"]
        print(f"completion {number}:")  # as written, indented: code and text read as they would in a file
        print("\n".join("    " + line[:160] for line in lines))
    if is_random:
        print("(random weights: the completions are random text by construction)")


def quiet_libraries(is_quiet: bool) -> None:
    """A CLI run's log: no transformers progress bars when quiet or not on a terminal."""
    from transformers.utils import logging as transformers_logging

    if is_quiet or not sys.stderr.isatty():
        transformers_logging.disable_progress_bar()


def _say(args, line: str) -> None:
    if not args.quiet:
        print(line, file=sys.stderr)


def parse_json_dict(text: str | None, flag: str) -> dict | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise FlexInferenceError(
            f"{flag} is not valid JSON ({error.msg}): pass a JSON object such as '{{\"BLOCK_N\": 32}}'"
        )
    if not isinstance(value, dict):
        raise FlexInferenceError(f"{flag} must be a JSON object such as '{{\"BLOCK_N\": 32}}'")
    return value


def resolve_device_and_dtype(device_name: str, dtype_name: str) -> tuple[torch.device, torch.dtype]:
    """--device and --dtype: auto picks CUDA where there is one, and bfloat16 on CUDA, float32 on the CPU."""
    if device_name == "cuda" and not torch.cuda.is_available():
        raise FlexInferenceError("--device cuda asked for, but no CUDA device is available")
    if device_name == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device_name)
    if dtype_name == "auto":
        dtype_name = "bfloat16" if device.type == "cuda" else "float32"
    return device, getattr(torch, dtype_name)


def demo_prompts() -> list[str]:
    """The built-in prompts: math word problems written for this project, so the demo needs no network."""
    return [line for line in DEMO_PROMPTS_PATH.read_text().splitlines() if line.strip()]


def read_prompts(prompts_file: str | None, n_prompts: int) -> list:
    """Prompts as strings or chat message lists (default: the demo prompts), cycled to `n_prompts`.

    A file is JSONL when its name ends in .jsonl or its first non-blank line starts with "{", one
    prompt per line otherwise; blank lines are skipped, and lines are numbered as in the file."""
    if n_prompts < 1:
        raise FlexInferenceError(f"n_prompts must be at least 1, got {n_prompts}", "n_prompts")
    prompts: list = demo_prompts()
    if prompts_file is not None:
        lines = [(number, line) for number, line in enumerate(read_prompt_lines(prompts_file), 1) if line.strip()]
        is_jsonl = prompts_file.endswith(".jsonl") or (lines and lines[0][1].lstrip().startswith("{"))
        prompts = []
        for number, line in lines:
            if not is_jsonl:
                prompts.append(line)
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise FlexInferenceError(f"line {number} of {prompts_file} is not valid JSON")
            problem = prompt_record_problem(record)
            if problem is not None:
                raise FlexInferenceError(f"line {number} of {prompts_file} {problem}")
            prompts.append(record if isinstance(record, str) else record[prompt_field(record)])
        if not prompts:
            raise FlexInferenceError(f"prompts file {prompts_file} holds no prompts")
    return [prompts[i % len(prompts)] for i in range(n_prompts)]


def read_prompt_lines(path: str) -> list[str]:
    """The lines of the prompts file at `path`, refused in one sentence when it cannot be read as text."""
    if not os.path.exists(path):
        raise FlexInferenceError(f"prompts file {path} does not exist")
    if os.path.isdir(path):
        raise FlexInferenceError(f"prompts file {path} is a folder: pass a JSONL or text file")
    try:
        return Path(path).read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise FlexInferenceError(
            f"prompts file {path} is not UTF-8 text (byte {error.start} is {error.object[error.start]:#x})"
        )
    except OSError as error:
        raise FlexInferenceError(f"could not read prompts file {path}: {error.strerror or error}")


PROMPT_FIELDS = ("messages", "prompt", "text")  # a JSONL record's prompt: the first of these it has


def prompt_field(record: dict) -> str | None:
    """The field of a JSONL record that holds its prompt; None when it has none."""
    return next((field for field in PROMPT_FIELDS if field in record), None)


def prompt_record_problem(record) -> str | None:
    """What keeps a JSONL record from being a prompt, worded to follow "line N of FILE"; None when
    it is one: a string, or an object whose prompt or text is a string, or whose messages are a
    non-empty list of objects with a string role and a string content."""
    if isinstance(record, str):
        return None
    if not isinstance(record, dict):
        return f"is JSON but neither an object nor a string: {short_json(record)}"
    field = prompt_field(record)
    if field is None:
        return "has no prompt, text or messages field"
    value = record[field]
    if field != "messages":
        return None if isinstance(value, str) else f"has a {field} that is not a string: {short_json(value)}"
    if not isinstance(value, list) or not value:
        return (
            'has messages that are not a non-empty list of {"role": ..., "content": ...} objects: '
            f"{short_json(value)}"
        )
    for index, message in enumerate(value, 1):
        if not isinstance(message, dict):
            return f"has message {index} that is not an object with a role and a content: {short_json(message)}"
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                return f"has message {index} without a string {key}: {short_json(message)}"
    return None


def short_json(value, max_chars: int = 60) -> str:
    """`value` as JSON, cut to `max_chars` for a one-sentence message."""
    text = json.dumps(value)
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


def format_prompt(tokenizer, prompt, chat_template: str) -> str:
    """grpo: the GRPO system prompt before the turns, unless they hold a system turn of their own
    (kept); native: the turns as given; in the tokenizer's template."""
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if chat_template == "grpo" and not any(m["role"] == "system" for m in messages):
        messages = [{"role": "system", "content": GRPO_SYSTEM_PROMPT}] + messages
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return "\n\n".join(m["content"] for m in messages) + "\n\n"


def make_sequences(prompts, tokenizer, chat_template: str, vocab_size: int, seed: int) -> list[Sequence]:
    if tokenizer is None:  # dummy weights without a tokenizer: fixed random 128-token prompts
        generator = random.Random(seed)
        return [Sequence(input_ids=[generator.randrange(3, vocab_size) for _ in range(128)]) for _ in prompts]
    sequences = []
    for prompt in prompts:
        text = format_prompt(tokenizer, prompt, chat_template)
        sequences.append(Sequence(text=text, input_ids=tokenize_prompt(tokenizer, text)))
    return sequences


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


if __name__ == "__main__":
    main()
