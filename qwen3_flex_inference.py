"""Fast, exact rollouts for Qwen3 and Llama-3.2 on flex_attention with a paged KV cache.

One token's path through this file, top to bottom:
page table and KV cache -> block masks -> flex attention -> skinny decode GEMMs -> patched
attention -> layer walker -> engine (scheduler, packed prefill, decode, CUDA graphs) -> LoRA
double-copy and drift check -> data parallel (one engine per torchrun rank) -> CLI.

Ideas taken from: PagedAttention (vLLM) for the paged KV cache; nano-vllm and flex-nano-vllm for
the scheduler, the page table and turning a logical block mask into a physical one; attention-gym's
paged-attention example; gpt-fast for CUDA-graph decode; for the few-row GEMMs, split-K work
decomposition (Hoque et al., "Accelerating a Triton Fused Kernel for W4A16 Quantized Inference
with SplitK", 2024; here without atomics) and putting the weight on the MMA's wide side ("swap
AB", as vLLM's small-batch CUTLASS GEMMs do). The reference for every number this engine produces
is Hugging Face transformers on the same weights.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import random
import statistics
import sys
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch._dynamo
import torch.distributed as dist
import torch.fx.experimental._config as fx_config
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton: skinny_linear is then plain F.linear
    triton = None

# Built-in prompts: math word problems written for this project, so the demo needs no network.
DEFAULT_PROMPTS = [
    "A baker makes 14 loaves of bread each morning and sells 9 of them before noon. How many loaves are left at noon after 5 mornings if nothing is carried over?",
    "Mia has 3 boxes with 12 pencils each. She gives 7 pencils to her brother. How many pencils does she have now?",
    "A train travels 180 kilometres in 2 hours. At the same speed, how far does it travel in 5 hours?",
    "Tom reads 15 pages a day. His book has 240 pages. How many days does he need to finish it?",
    "A garden is 8 metres long and 5 metres wide. A path 1 metre wide runs around the outside. What is the area of the path?",
    "Lena buys 4 notebooks at 2.50 dollars each and a pen for 1.75 dollars. She pays with a 20 dollar bill. How much change does she get?",
    "The sum of three consecutive integers is 72. What is the largest of them?",
    "A tank holds 500 litres. It is filled at 20 litres per minute and drains at 5 litres per minute. How long does it take to fill the empty tank?",
    "Sam is twice as old as his sister. In 6 years the sum of their ages will be 42. How old is Sam now?",
    "A shop sells apples at 3 for 1 dollar. How much do 27 apples cost?",
    "A rectangle has a perimeter of 36 centimetres and its length is twice its width. What is its area?",
    "Five workers build a wall in 12 days. How many days would 6 workers need at the same rate?",
    "A class has 28 students. Three sevenths of them walk to school and the rest take the bus. How many take the bus?",
    "A cyclist rides at 18 kilometres per hour for 40 minutes. How far does she ride?",
    "The price of a jacket is 80 dollars. It is reduced by 25 percent, then the new price is raised by 10 percent. What is the final price?",
    "A farmer has chickens and cows, 30 animals in all with 74 legs. How many cows does he have?",
    "What is the smallest positive integer that leaves a remainder of 1 when divided by 2, 3, 4, 5 and 6?",
    "A recipe needs 250 grams of flour for 10 cookies. How much flour is needed for 36 cookies?",
    "Two numbers add up to 50 and differ by 12. What is their product?",
    "A water bottle is one third full. After adding 200 millilitres it is three quarters full. What is its capacity?",
    "Jon saves 15 dollars every week. He already has 45 dollars. After how many weeks will he have 300 dollars?",
    "A square and an equilateral triangle have the same perimeter. The square has side 9. What is the side of the triangle?",
    "A bus leaves every 12 minutes starting at 7:00. How many buses have left by 9:30, counting the one at 7:00?",
    "The average of four numbers is 15. Three of them are 10, 12 and 20. What is the fourth?",
]

GRPO_SYSTEM_PROMPT = (
    "You are given a problem. Think about the problem and provide your working out. "
    "Place it between <start_working_out> and <end_working_out>. "
    "Then, provide your solution between <SOLUTION></SOLUTION>."
)

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

# NOTE: every distinct prefill length, head_dim and decode batch bucket is its own compiled
# specialisation; the default limit of 8 would silently fall back to eager flex attention.
torch._dynamo.config.recompile_limit = 256
torch._dynamo.config.accumulated_recompile_limit = 4096


# ---------------------------------------------------------------------------------------------
# Page table and paged KV cache
# ---------------------------------------------------------------------------------------------


class PageTable:
    """Maps each batch slot's logical KV blocks to physical pages of the shared KV pool.

    Batch slot 0 and physical page 0 are reserved: padding rows of a decode batch point at slot 0,
    whose every logical block maps to page 0, so their K/V writes land somewhere harmless.
    Blocks a sliding window has left behind are trimmed: their pages go back to the pool and the
    block maps to page 0, which the slot does not own (so its mask_mod rejects it).
    All bookkeeping (free pages, free slots, each slot's capacity) lives on the CPU so that
    scheduling never waits on the GPU; `flush()` mirrors the changes to the device in one copy.
    """

    def __init__(self, page_size: int, n_pages: int, max_batch_size: int, max_seq_length: int, device):
        self.page_size = page_size
        self.n_pages = n_pages
        self.max_batch_size = max_batch_size  # batch slots including the reserved slot 0
        self.max_logical_blocks = max_seq_length // page_size
        self.device = torch.device(device)
        # page_table[batch_idx, logical_block_idx] -> physical_page_idx
        self.page_table_cpu = torch.zeros(max_batch_size, self.max_logical_blocks, dtype=torch.int32)
        # physical_to_logical[batch_idx, physical_page_idx] -> logical_block_idx, or -1 if not owned
        self.physical_to_logical_cpu = torch.full((max_batch_size, n_pages), -1, dtype=torch.int32)
        self.physical_to_logical_cpu[0, 0] = 0
        self.page_table = self.page_table_cpu.to(self.device)
        self.physical_to_logical = self.physical_to_logical_cpu.to(self.device)
        mark_all_static(self.page_table, self.physical_to_logical)
        self.free_pages = deque(range(1, n_pages))
        self.free_batch_idx = deque(range(1, max_batch_size))
        # physical page of each logical block, in logical order; None once trimmed
        self.pages_of: list[list[int | None]] = [[] for _ in range(max_batch_size)]
        self.is_dirty = False

    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages)

    @property
    def num_used_pages(self) -> int:
        return sum(page is not None for pages in self.pages_of for page in pages)

    @property
    def capacity(self) -> list[int]:
        """Tokens each slot's logical blocks cover (trimmed blocks included)."""
        return [len(pages) * self.page_size for pages in self.pages_of]

    def num_pages_of(self, batch_idx: int) -> int:
        return sum(page is not None for page in self.pages_of[batch_idx])

    def can_allocate(self) -> bool:
        return len(self.free_batch_idx) > 0

    def allocate(self) -> int:
        """Takes a free batch slot (never slot 0); it owns no pages yet."""
        return self.free_batch_idx.popleft()

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
            recyclable = sum(page is not None for page in self.pages_of[batch_idx][: first_needed_pos // self.page_size])
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
            physical_page_idx = self.free_pages.popleft()
            self.page_table_cpu[batch_idx, logical_block_idx] = physical_page_idx
            self.physical_to_logical_cpu[batch_idx, physical_page_idx] = logical_block_idx
            pages.append(physical_page_idx)
            self.is_dirty = True

    def trim(self, batch_idx: int, first_needed_pos: int) -> None:
        """Recycles the pages of slot `batch_idx`'s blocks that end before `first_needed_pos`."""
        pages = self.pages_of[batch_idx]
        for logical_block_idx in range(min(first_needed_pos // self.page_size, len(pages))):
            physical_page_idx = pages[logical_block_idx]
            if physical_page_idx is not None:
                self.physical_to_logical_cpu[batch_idx, physical_page_idx] = -1
                self.page_table_cpu[batch_idx, logical_block_idx] = 0
                self.free_pages.append(physical_page_idx)
                pages[logical_block_idx] = None
                self.is_dirty = True

    def erase(self, batch_idx: int, release_slot: bool = True) -> None:
        """Returns all of slot `batch_idx`'s pages (and, unless told otherwise, the slot) to the pools."""
        self.trim(batch_idx, len(self.pages_of[batch_idx]) * self.page_size)
        self.pages_of[batch_idx] = []
        if release_slot:
            self.free_batch_idx.append(batch_idx)

    def flush(self) -> None:
        """Copies the CPU bookkeeping to the device tables (in place: captured graphs read them)."""
        if self.is_dirty:
            self.page_table.copy_(self.page_table_cpu, non_blocking=True)
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

    def decode_blocks(self, input_pos_B: torch.Tensor, batch_idx_B: torch.Tensor, sliding_window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each decode row's visible logical blocks (`visible_logical_blocks`) mapped to physical
        pages: (kv_num_blocks [B, 1, 1], kv_indices [B, 1, 1, n_pages]; only the first
        kv_num_blocks of each row are read), the block tensors of a PagedDecodeMask."""
        kv_num_blocks, logical_indices = visible_logical_blocks(input_pos_B, self.page_size, sliding_window, self.max_logical_blocks)
        B = input_pos_B.shape[0]
        page_table_BL = self.page_table[batch_idx_B]
        physical_BL = torch.gather(page_table_BL, 1, logical_indices.view(B, -1).long())
        # NOTE: the kernel checks kv_indices covers the whole KV length (n_pages blocks).
        physical_BP = nn.functional.pad(physical_BL, (0, self.n_pages - physical_BL.shape[1]))
        return kv_num_blocks, physical_BP.view(B, 1, 1, self.n_pages)


class PagedKVCache:
    """One attention layer's K/V pool, shared by all sequences through the page table."""

    def __init__(self, n_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype, device):
        shape = (1, num_kv_heads, n_pages * page_size, head_dim)
        # k_cache, v_cache: [1, H_kv, n_pages * page_size, D]; row = physical_page * page_size + offset
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        mark_all_static(self.k_cache, self.v_cache)

    @property
    def bytes_per_token(self) -> int:
        _, num_kv_heads, _, head_dim = self.k_cache.shape
        return 2 * num_kv_heads * head_dim * self.k_cache.element_size()

    def write(self, k: torch.Tensor, v: torch.Tensor, physical_slots: torch.Tensor) -> None:
        """k, v: [B, H_kv, S, D] with B * S == len(physical_slots) (packed prefill: B = 1; decode: S = 1)."""
        B, H, S, D = k.shape
        # NOTE: an index_put_ on the whole cache; inductor turns index_copy_ on the [0] view
        # into a copy of the entire cache per write.
        self.k_cache[:, :, physical_slots] = k.transpose(0, 1).reshape(1, H, B * S, D)
        self.v_cache[:, :, physical_slots] = v.transpose(0, 1).reshape(1, H, B * S, D)


# ---------------------------------------------------------------------------------------------
# Block masks
# ---------------------------------------------------------------------------------------------


def causal_mask_mod(sliding_window: int | None = None):
    """Logical causal mask (optionally windowed exactly as HF: kv > q - window)."""

    def mask_mod(b, h, q_idx, kv_idx):
        is_visible = q_idx >= kv_idx
        if sliding_window is not None:
            is_visible = is_visible & (q_idx - kv_idx < sliding_window)
        return is_visible

    return mask_mod


def document_causal_mask_mod(document_id_T: torch.Tensor, sliding_window: int | None = None):
    """Packed prefill: every prompt sees only itself, causally (windowed if asked)."""
    causal = causal_mask_mod(sliding_window)

    def mask_mod(b, h, q_idx, kv_idx):
        return (document_id_T[q_idx] == document_id_T[kv_idx]) & causal(b, h, q_idx, kv_idx)

    return mask_mod


def gathered_rows_mask_mod(mask_mod, row_idx_N: torch.Tensor):
    """A mask over only some query rows of another: query n is row row_idx_N[n] of `mask_mod`."""

    def gathered(b, h, q_idx, kv_idx):
        return mask_mod(b, h, row_idx_N[q_idx], kv_idx)

    return gathered


def offset_mask_mod(mask_mod, input_pos_B: torch.Tensor):
    """Decode: the single query token sits at logical position input_pos_B[b], not at q_idx = 0."""

    def offset(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_idx + input_pos_B[b], kv_idx)

    return offset


def visible_logical_blocks(input_pos_B: torch.Tensor, page_size: int, sliding_window: int | None, max_logical_blocks: int) -> tuple:
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


def physical_mask_mod(logical_mask_mod, physical_to_logical: torch.Tensor, batch_idx_B: torch.Tensor, page_size: int):
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
    sliding_window: int  # 0: full causal

    def block_mask(self) -> BlockMask:
        """One query row per sequence over the whole pool. seq_lengths must equal the real q/kv
        lengths (torch >= 2.9 checks); no q blocks are needed without a backward pass."""
        logical_mask_mod = offset_mask_mod(causal_mask_mod(self.sliding_window or None), self.input_pos_B)
        full_blocks = (None, None)
        if self.kv_indices.device.type == "cpu":
            # NOTE: torch's C++ flex kernel does not compile without full blocks: give it none.
            full_blocks = (torch.zeros_like(self.kv_num_blocks), torch.zeros_like(self.kv_indices))
        return BlockMask.from_kv_blocks(
            self.kv_num_blocks,
            self.kv_indices,
            *full_blocks,
            BLOCK_SIZE=self.page_size,
            mask_mod=physical_mask_mod(logical_mask_mod, self.physical_to_logical, self.batch_idx_B, self.page_size),
            seq_lengths=(1, self.physical_to_logical.shape[1] * self.page_size),
            compute_q_blocks=False,
        )


# ---------------------------------------------------------------------------------------------
# flex_attention, kernel options, rotary
# ---------------------------------------------------------------------------------------------

# NOTE: compiled once for the whole process. FLEX_COMPILE_MODE picks another torch.compile mode
# (e.g. "max-autotune-no-cudagraphs"); prefill lengths become dynamic after the second one seen.
flex_attention_compiled = torch.compile(flex_attention, fullgraph=True, mode=os.environ.get("FLEX_COMPILE_MODE") or None)


def default_kernel_options(is_prefill: bool, head_dim: int, device: torch.device) -> dict:
    """Kernel options measured on an H200 (torch 2.11, bf16, E2B heads: 8 query, 1 KV) per head_dim.

    NOTE: at head_dim 512 the default prefill tiles need 256 KB of shared memory (the limit is
    227 KB); 32x32 tiles fit and are the fastest that do. Decode over a 1024-page pool, 3 pages a
    row, partial blocks (as the engine runs it): head_dim 256 is fastest with BLOCK_N 32 and one
    stage (14 us at batch 64, against 19 by default); at head_dim 512 that choice took 60-201 us at
    batch 1-64, and BLOCK_N 16 with one stage 14-27 us. scripts/benchmarks/flex_kernel_options.py
    measures them all; paged_decode_attention adds the batch-dependent SPLIT_KV.
    """
    if device.type != "cuda" or head_dim <= 128:
        return {}
    if is_prefill:
        return {"BLOCK_M": 32, "BLOCK_N": 32} if head_dim > 256 else {"BLOCK_M": 64, "BLOCK_N": 64}
    return {"BLOCK_N": 16 if head_dim > 256 else 32, "num_stages": 1}


def mark_all_static(*tensors) -> None:
    """Keeps torch.compile from treating any dimension of these tensors as dynamic (a no-op while
    tracing: marks count only on the inputs of a compiled call)."""
    if torch.compiler.is_compiling():
        return
    for t in tensors:
        if t is not None:
            for dim in range(t.dim()):
                torch._dynamo.mark_static(t, dim)


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
    sliding_window: int,
    scale: float,
    kernel_options: str,
) -> torch.Tensor:
    """Decode attention over the paged cache: q [B, H, 1, D], caches [1, H_kv, rows, D] -> [B, H, 1, D].

    An opaque op, so a compiled decode step with a symbolic batch size still calls flex_attention's
    decode kernel compiled for the concrete batch bucket: traced into the symbolic-batch graph,
    that kernel ran ~4x slower on an H200 (2.57 vs 0.64 ms a step at batch 64).
    """
    block_mask = PagedDecodeMask(
        kv_num_blocks, kv_indices, input_pos_B, batch_idx_B, physical_to_logical, page_size, sliding_window
    ).block_mask()
    # NOTE: automatic dynamic shapes would make a dimension symbolic once a second value is seen;
    # decode wants everything static (the CPU kernel indexes out of bounds with a symbolic KV
    # length). The caches and page tables are marked static when they are made.
    mark_all_static(q, *block_mask.as_tuple()[2:6])
    options = json.loads(kernel_options)
    if q.is_cuda and q.shape[0] <= 8 and q.shape[-1] == 256:
        # NOTE: flex's default SPLIT_KV is 2 x SMs / rows (264 at batch 1), and only the splits that
        # a row's few pages reach do work; 16 splits took 7 us at batch 1 against 12 (H200, sweep).
        options.setdefault("SPLIT_KV", 16)
    out = flex_attention_compiled(
        q, k_cache, v_cache, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k_cache.shape[1], kernel_options=options
    )
    return out.contiguous()


@paged_decode_attention.register_fake
def _paged_decode_attention_shape(q, *args):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half RoPE. x: [B, H, S, D]; cos, sin: [B, S, D] from the model's own rotary module."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def flash_prefill_supported(head_dim: int, device: torch.device) -> bool:
    """Whether flex_attention's FLASH backend (flash-attn-4, CuTe DSL) can run this prefill."""
    if device.type != "cuda" or importlib.util.find_spec("flash_attn") is None:
        return False
    major, _ = torch.cuda.get_device_capability(device)
    # NOTE: FLASH cannot do head_dim 512 on Hopper.
    return major in (9, 10) and head_dim <= 256


@dataclass
class FlexStep:
    """Everything one forward pass through the layers needs from the engine.

    Prefill packs all admitted prompts in one row ([1, H, T, D]) and attends over their fresh K/V;
    decode has one token per row ([B, H, 1, D]) and attends over the paged cache.
    """

    is_prefill: bool
    block_masks: dict  # attention regime -> BlockMask (prefill) or PagedDecodeMask (decode)
    physical_slots: dict  # attention regime -> [B * S] cache row of every token in that regime's pool
    kv_caches: list  # PagedKVCache per layer; None for layers that own no cache
    kernel_options: dict  # head_dim -> kernel options (decode: as JSON)
    packed_kv: dict = field(default_factory=dict)  # prefill: PagedKVCache -> the fresh (k, v) written to it
    document_id_T: torch.Tensor | None = None  # prefill: which sequence each packed token belongs to

    def for_layer(self, cache_layer_idx: int, regime: str = FULL_ATTENTION) -> LayerStep:
        """The step as one layer sees it: the cache it writes or reads and its regime's mask and slots.

        NOTE: picked here, outside the layer, so a compiled layer reads no layer index: dynamo
        specialises on every int it reads, and would compile each layer on its own.
        """
        return LayerStep(self, self.kv_caches[cache_layer_idx], self.block_masks[regime], self.physical_slots[regime])


@dataclass
class LayerStep:
    """One layer's view of a FlexStep; the patched attention calls `attend`."""

    step: FlexStep
    cache: PagedKVCache
    block_mask: BlockMask | PagedDecodeMask
    physical_slots: torch.Tensor  # [B * S] cache row of every token

    def attend(self, module, q, k, v) -> torch.Tensor:
        """Writes k/v (None: a KV-shared layer, reusing its store layer's cache), then flex-attends.

        q: [B, H, S, D]; k, v: [B, H_kv, S, D]; returns [B, H, S, D].
        """
        step = self.step
        if k is not None:
            self.cache.write(k, v, self.physical_slots)
            if step.is_prefill:
                step.packed_kv[self.cache] = (k, v)
        kernel_options = step.kernel_options[q.shape[-1]]
        if not step.is_prefill:
            mask = self.block_mask
            return paged_decode_attention(
                q, self.cache.k_cache, self.cache.v_cache, mask.kv_num_blocks, mask.kv_indices, mask.input_pos_B, mask.batch_idx_B,
                mask.physical_to_logical, mask.page_size, mask.sliding_window, float(module.scaling), kernel_options,
            )
        k, v = step.packed_kv[self.cache]
        # NOTE: automatic dynamic shapes would make a dimension symbolic once a second value is
        # seen; prefill keeps only the packed length dynamic.
        if not torch.compiler.is_compiling():
            for t in (q, k, v):
                for dim in (0, 1, 3):
                    torch._dynamo.mark_static(t, dim)
        return flex_attention_compiled(
            q, k, v, block_mask=self.block_mask, scale=module.scaling, enable_gqa=q.shape[1] != k.shape[1], kernel_options=kernel_options
        )


# ---------------------------------------------------------------------------------------------
# Skinny decode GEMMs: a Triton GEMV for few rows, raced against cuBLAS per weight shape
# ---------------------------------------------------------------------------------------------

# A decode GEMM at small batch reads every weight byte once and does 2 * M FLOPs per weight
# element: its time is the weight's bytes over the bandwidth reached. cuBLAS's skinny kernels reach
# 1.6-3.3 TB/s on E2B's decode weights on an H200 (copies reach 4.2) at batch 1, 2.3-3.7 TB/s at
# batch 64 (a step's GEMMs: ~2.0 ms against 1.1 ms for its 4.56 GB), and a 0.79 MB PLE projection
# takes ~4.6 us. The kernel below streams the weight; skinny_linear races it against cuBLAS per
# (shape, dtype, row bucket) on the GPU it runs on and keeps the faster one.
#
# Kernel design (out[M, N] = x[M, K] @ w[N, K]^T, M <= SKINNY_MAX_ROWS):
# - Program (n, s) owns BLOCK_N output features and the s-th of SPLIT_K runs of K; it walks its K
#   run in [BLOCK_N, BLOCK_K] tiles of w and multiplies each tile with all M rows of x, so every
#   weight byte is read once whatever M is.
# - The product is a tl.dot with w as the wide left operand and x^T padded to BLOCK_M = 16 columns
#   (masked rows load nothing). The w tile is K-contiguous and 16-byte aligned (K a multiple of 16, which
#   Triton specialises on), so it is fetched with 16-byte vector loads (cp.async into shared memory
#   when num_stages > 1), and the software pipeline keeps num_stages - 1 tiles per program in flight:
#   8-96 KB per program with the configs below, several programs per SM. The padding wastes tensor-
#   core FLOPs, which are not the limit: 16 columns at 4.8 TB/s need ~80 of the H200's ~990 bf16
#   TFLOP/s. Broadcast-multiply + tl.sum would put the products on the CUDA cores instead: at 16 rows
#   that is 3.8e13 fp32 FMAs/s at full bandwidth, more than the H200's ~3.4e13, plus a cross-thread
#   reduction per row and tile (or M * BLOCK_N * BLOCK_K fp32 accumulators in registers).
# - Split-K, because E2B's o, down and PLE projections have N = 1536 or 256 (2-96 row blocks, too
#   few programs to keep 132 SMs' worth of bytes in flight) and a smaller BLOCK_N alone cannot fix that
#   (the MMA wants BLOCK_N >= 16: still 96 programs, each a long serial K loop). It is
#   deterministic: no atomics; each split writes fp32 partials [SPLIT_K, M, N] and a second small
#   kernel sums them in a fixed order and casts. That second launch costs time, so the race picks a
#   split-K config only where it still wins.

# NOTE: measured on an H200 (scripts/benchmarks/bench_gemv.py): the kernel beats cuBLAS by 5-23% on
# most E2B shapes at 1-8 rows; at 64 rows it wins only on the widest (lm_head, 8%) and loses up to
# 22% elsewhere, so racing buckets above 16 costs start-up time (a BLOCK_M variant of every config
# to compile) for ~20 us a step.
SKINNY_MAX_ROWS = 16  # rows (decode batch) up to which skinny_linear races the Triton kernel against cuBLAS
SKINNY_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SKINNY_REDUCE_BLOCK = 1024  # elements per program of the split-K reduction


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
    SkinnyConfig(16, 256, 1, 4, 6),  # tiny weights (PLE gate 256 x 1536, projection 1536 x 256): up to 6 K chunks in flight
)

if triton is not None:

    # NOTE: M and the strides that change with M are not specialised on: Triton would otherwise
    # compile another variant for M == 1 or M == 16, and compiling while a CUDA graph is captured
    # is not allowed. One variant per config and dtype, compiled by skinny_linear's race.
    @triton.jit(do_not_specialize=["M", "stride_split"])
    def _skinny_matmul_kernel(
        x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om, stride_split,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    ):  # fmt: skip
        """out[s, M, N] = x[M, K] @ w[N, K]^T over split s's run of K chunks; fp32 accumulation."""
        pid_n = tl.program_id(0)
        pid_split = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        chunks_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
        k_start = pid_split * chunks_per_split * BLOCK_K
        k_end = tl.minimum(k_start + chunks_per_split * BLOCK_K, K)  # the last splits may be empty
        acc_NM = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            w_NK = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=(offs_n[:, None] < N) & (offs_k[None, :] < K), other=0.0)
            x_MK = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
            acc_NM = tl.dot(w_NK, tl.trans(x_MK), acc_NM, input_precision=INPUT_PRECISION)
        out_ptrs = out_ptr + pid_split * stride_split + offs_m[None, :] * stride_om + offs_n[:, None]
        tl.store(out_ptrs, acc_NM.to(out_ptr.dtype.element_ty), mask=(offs_m[None, :] < M) & (offs_n[:, None] < N))

    @triton.jit(do_not_specialize=["numel"])
    def _skinny_split_k_reduce_kernel(partials_ptr, out_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
        """out[i] = sum over s of partials[s, i], always in the order s = 0, 1, ...: bitwise reproducible."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for split in tl.static_range(SPLIT_K):
            acc += tl.load(partials_ptr + split * numel + offs, mask=mask, other=0.0)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def skinny_matmul_triton(x2d_MK: torch.Tensor, w_NK: torch.Tensor, config: SkinnyConfig) -> torch.Tensor:
    """out_MN = x2d_MK @ w_NK^T through the Triton kernel(s) of one config.

    M <= SKINNY_MAX_ROWS; x and w of one dtype in SKINNY_DTYPES, K contiguous in both; fp32
    accumulation, out_MN in x's dtype. Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1.
    """
    M, K = x2d_MK.shape
    N = w_NK.shape[0]
    if not (0 < M <= SKINNY_MAX_ROWS and w_NK.shape[1] == K and x2d_MK.stride(1) == 1 and w_NK.stride(1) == 1):
        raise ValueError(f"skinny_matmul_triton needs 1..{SKINNY_MAX_ROWS} rows and K contiguous: x {tuple(x2d_MK.shape)}, w {tuple(w_NK.shape)}")
    if x2d_MK.dtype != w_NK.dtype or x2d_MK.dtype not in SKINNY_DTYPES:
        raise ValueError(f"skinny_matmul_triton needs x and w of one dtype in {SKINNY_DTYPES}: x {x2d_MK.dtype}, w {w_NK.dtype}")
    # NOTE: the kernel's offsets are int32, so w must have fewer than 2**31 elements.
    if w_NK.numel() >= 2**31:
        raise ValueError(f"skinny_matmul_triton needs a weight of fewer than 2**31 elements: {tuple(w_NK.shape)}")
    out_MN = torch.empty(M, N, dtype=x2d_MK.dtype, device=x2d_MK.device)
    # partials_SMN: [split_k, M, N] fp32, or out_MN itself without split-K
    partials_SMN = out_MN if config.split_k == 1 else torch.empty(config.split_k, M, N, dtype=torch.float32, device=x2d_MK.device)
    _skinny_matmul_kernel[(triton.cdiv(N, config.block_n), config.split_k)](
        x2d_MK, w_NK, partials_SMN, M, N, K, x2d_MK.stride(0), w_NK.stride(0), N, M * N if config.split_k > 1 else 0,
        BLOCK_M=SKINNY_MAX_ROWS, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=config.split_k,
        # NOTE: float32 operands would go through TF32 by default (~1e-3 relative error); "ieee" keeps fp32.
        INPUT_PRECISION="ieee" if x2d_MK.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if config.split_k > 1:
        _skinny_split_k_reduce_kernel[(triton.cdiv(M * N, SKINNY_REDUCE_BLOCK),)](
            partials_SMN, out_MN, M * N, SPLIT_K=config.split_k, BLOCK=SKINNY_REDUCE_BLOCK
        )
    return out_MN


# (N, K, dtype name, row bucket) -> {"winner": "cublas" or an index into SKINNY_CONFIGS,
# "us": backend -> median GPU us per call, "failed": config index -> why it was dropped}
SKINNY_CHOICES: dict = {}
SKINNY_TUNE_WARMUP_CALLS = 3
SKINNY_TUNE_TIMED_CALLS = 15
# GPU clock cycles of torch.cuda._sleep before the timed calls (~5 ms at 2 GHz): the CPU queues all
# of them meanwhile, so that Python and launch overhead (absent in a CUDA graph) stay out of the times.
SKINNY_TUNE_QUEUE_AHEAD_CYCLES = 10_000_000


def skinny_rows_bucket(num_rows: int) -> int:
    """The power of two >= num_rows: decode batches that share one entry of SKINNY_CHOICES."""
    return 1 << (num_rows - 1).bit_length()


def skinny_tolerance(dtype: torch.dtype) -> float:
    """Largest ||out - ref|| / ||ref|| accepted from a Triton config against F.linear: loose enough
    for two summation orders over K = 12288, far below the O(1) error of a broken config."""
    if dtype != torch.float32:
        return 1e-2
    # NOTE: with TF32 allowed, cuBLAS's float32 result is itself only ~1e-3 accurate.
    return 5e-3 if torch.backends.cuda.matmul.allow_tf32 else 1e-4


def _gpu_us_per_call(fn, flush_L2: torch.Tensor) -> float:
    """Median GPU time in us of one call of fn(), with L2 flushed before each timed call."""
    for _ in range(SKINNY_TUNE_WARMUP_CALLS):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(SKINNY_TUNE_TIMED_CALLS)]
    torch.cuda._sleep(SKINNY_TUNE_QUEUE_AHEAD_CYCLES)
    for start, end in events:
        flush_L2.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) * 1e3 for start, end in events)


def race_skinny_backends(x2d_MK: torch.Tensor, w_NK: torch.Tensor) -> dict:
    """Times F.linear and every config of SKINNY_CONFIGS on this input; returns an entry of SKINNY_CHOICES.

    A config is first checked against F.linear on a fresh random x (seeded, its own generator, so
    the caller's RNG stream is untouched; the caller's x may be all zeros in a warm-up) with the
    real weight; one that raises (e.g. out of shared memory) or misses skinny_tolerance is dropped.

    NOTE: times are taken on the real weight, since that is what runs, with L2 flushed before each
    call: back to back, calls on one weight below ~50 MB (the H200's L2) would be served from L2, a
    case a decode step never has (every other weight streams through between two uses of one).
    The flush is a proxy; the real check is a whole decode step on the GPU with and without
    skinny_linear (scripts/benchmarks/profile_decode.py), and scripts/benchmarks/bench_gemv.py
    times each shape over rotated weight copies inside a CUDA graph.
    """
    generator = torch.Generator(device=x2d_MK.device).manual_seed(0)
    x_check_MK = torch.randn(x2d_MK.shape, generator=generator, device=x2d_MK.device).to(x2d_MK.dtype)
    ref_MN = nn.functional.linear(x_check_MK, w_NK).float()
    candidates = {"cublas": lambda: nn.functional.linear(x2d_MK, w_NK)}
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
        candidates[idx] = lambda config=config: skinny_matmul_triton(x2d_MK, w_NK, config)
    flush_L2 = torch.empty(2 * torch.cuda.get_device_properties(x2d_MK.device).L2_cache_size, dtype=torch.int8, device=x2d_MK.device)
    us = {name: _gpu_us_per_call(fn, flush_L2) for name, fn in candidates.items()}
    return {"winner": min(us, key=us.get), "us": us, "failed": failed}


@torch.library.custom_op("flex_inference::skinny_linear", mutates_args=())
def skinny_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) without bias (x [..., K], weight [N, K] -> [..., N]), through the Triton
    GEMV where it beat cuBLAS for this (N, K, dtype, row bucket) on this GPU.

    Plain F.linear on CPU, without triton, above SKINNY_MAX_ROWS rows, or for dtypes/layouts the
    kernel does not take. The first call of a new key outside CUDA-graph capture races the backends
    (race_skinny_backends) and stores the outcome in SKINNY_CHOICES; a new key met during capture
    gets F.linear (never time inside a capture), so warm every decode bucket up eagerly first.
    Deterministic: once chosen, a key always runs the same kernels, none of them with atomics.
    NOTE: another process may pick another backend where two are within timing noise, so results
    are bitwise reproducible within a process, and equal only to rounding across processes.
    An opaque op, so it sits in a torch.compile(fullgraph=True) graph with a symbolic batch.
    NOTE: the race compares GPU time only, which is what a CUDA graph replays; called eagerly, a
    Triton launch from Python costs tens of us of CPU time, more than it saves at these sizes.
    """
    N, K = weight.shape
    num_rows = x.numel() // K
    is_skinny = 0 < num_rows <= SKINNY_MAX_ROWS and x.dtype == weight.dtype and x.dtype in SKINNY_DTYPES
    is_k_contiguous = x.stride(-1) == 1 and weight.stride(1) == 1
    if triton is None or x.device.type != "cuda" or not is_skinny or not is_k_contiguous or weight.numel() >= 2**31:
        return nn.functional.linear(x, weight)
    x2d_MK = x.reshape(num_rows, K)
    key = (N, K, str(x.dtype).removeprefix("torch."), skinny_rows_bucket(num_rows))
    choice = SKINNY_CHOICES.get(key)
    if choice is None:
        if torch.cuda.is_current_stream_capturing():
            return nn.functional.linear(x, weight)
        with torch.cuda.device(x.device):  # the race's sleep, events and syncs act on the current device
            choice = SKINNY_CHOICES[key] = race_skinny_backends(x2d_MK, weight)
    if choice["winner"] == "cublas":
        return nn.functional.linear(x, weight)
    return skinny_matmul_triton(x2d_MK, weight, SKINNY_CONFIGS[choice["winner"]]).reshape(*x.shape[:-1], N)


@skinny_linear.register_fake
def _skinny_linear_shape(x, weight):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# ---------------------------------------------------------------------------------------------
# Patched attention and layer walker (Qwen3, Llama)
# ---------------------------------------------------------------------------------------------


def qkv_projections(attn) -> list[nn.Module]:
    """The q/k/v projections an attention layer has (KV-shared Gemma-4 layers: only q)."""
    return [proj for proj in (getattr(attn, name, None) for name in ("q_proj", "k_proj", "v_proj")) if proj is not None]


def fuse_linears(owner: nn.Module, linears: list[nn.Module], name: str) -> None:
    """Concatenates the weights of linears that read the same input into `owner.<name>`
    ([sum of outputs, in]) and makes each linear's weight a view of its rows: one GEMM computes
    them all, and in-place writes to a linear's weight (the LoRA refresh) land in the fused one."""
    bases = [getattr(linear, "base_layer", linear) for linear in linears]
    fused = torch.cat([base.weight.detach() for base in bases])
    start = 0
    for base in bases:
        rows = base.weight.shape[0]
        base.weight = nn.Parameter(fused[start : start + rows], requires_grad=False)
        start += rows
    setattr(owner, name, fused)
    setattr(owner, name + "_sizes", [base.weight.shape[0] for base in bases])


def project(owner: nn.Module, linears: list[nn.Module], fused_name: str, x: torch.Tensor) -> list[torch.Tensor]:
    """Each linear's output: one GEMM over the fused weight when there is one."""
    fused = getattr(owner, fused_name, None)
    if fused is None:
        return [linear(x) for linear in linears]
    linear = skinny_linear if getattr(owner, "is_skinny", False) else nn.functional.linear
    return list(linear(x, fused).split(getattr(owner, fused_name + "_sizes"), dim=-1))


def skinny_linear_forward(self, x):
    """Replaces a bias-free nn.Linear's forward: the same product through skinny_linear."""
    return skinny_linear(x, self.weight)


def fused_mlp_forward(self, x):
    """Replaces the gated MLP's forward when gate/up are fused: down(act(gate) * up)."""
    gate, up = project(self, [self.gate_proj, self.up_proj], "fused_gate_up_weight", x)
    return self.down_proj(self.act_fn(gate) * up)


def qwen3_llama_attention_forward(self, hidden_states, position_embeddings, attention_mask=None, layer_step=None, **kwargs):
    """Replaces Qwen3Attention/LlamaAttention.forward: project, norm (Qwen3), RoPE, paged flex attention."""
    input_shape = hidden_states.shape[:-1]  # [B, S]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q, k, v = (t.view(hidden_shape) for t in project(self, qkv_projections(self), "fused_qkv_weight", hidden_states))
    if hasattr(self, "q_norm"):  # Qwen3 normalises each head; Llama does not
        q, k = self.q_norm(q), self.k_norm(k)
    cos, sin = position_embeddings
    q = _apply_rotary(q.transpose(1, 2), cos, sin)  # [B, H, S, D]
    k = _apply_rotary(k.transpose(1, 2), cos, sin)  # [B, H_kv, S, D]
    attn_output = layer_step.attend(self, q, k, v.transpose(1, 2))
    attn_output = attn_output.transpose(1, 2).reshape(*input_shape, -1)
    return self.o_proj(attn_output), None


def call_layer(layer: nn.Module, hidden_states: torch.Tensor, **layer_kwargs) -> torch.Tensor:
    """One decoder layer (HF's own forward). With compile_decode the engine compiles this once:
    layers of one kind (same shapes and attention regime) then share one compiled graph."""
    return layer(hidden_states, **layer_kwargs)


def unwrap_causal_lm(model: nn.Module) -> nn.Module:
    """The HF *ForCausalLM inside a PEFT wrapper (or the model itself)."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


# ---------------------------------------------------------------------------------------------
# Engine
# ---------------------------------------------------------------------------------------------


@dataclass
class Sequence:
    """One prompt and its completion. `input_ids`, when given, is used as is (no tokenizer needed)."""

    text: str | None = None
    input_ids: list[int] | None = None
    max_new_tokens: int | None = None
    output_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # "stop" (an end id) or "length"
    record_logits: bool = False  # keep each generated token's logits (tests, analysis)
    output_logits: list = field(default_factory=list)
    batch_idx: int = -1  # slot in the page table while running, -1 otherwise
    num_preemptions: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)


def greedy_tokens(logits_BV: torch.Tensor) -> torch.Tensor:
    """logits_BV.argmax(-1), the first index of each row's maximum, in two stages: the maximum of
    each of C chunks of the vocabulary, then of the chunks.

    NOTE: one reduction over a 262,144-entry row runs as one program per row: 80 us a step at
    batch 1 on an H200. C chunks per row give the compiled step C times the programs.
    """
    B, V = logits_BV.shape
    num_chunks = min(V & -V, 256)  # the largest power of two up to 256 that divides V
    chunk_max_BC, chunk_argmax_BC = logits_BV.view(B, num_chunks, V // num_chunks).max(-1)
    best_chunk_B = chunk_max_BC.argmax(-1)  # the first chunk holding the row's maximum
    return best_chunk_B * (V // num_chunks) + chunk_argmax_BC.gather(1, best_chunk_B[:, None]).squeeze(1)


@dataclass
class DecodeLaunch:
    """A decode step queued on the device; `read()` waits for its sampled tokens."""

    rows: list[Sequence]
    next_ids: torch.Tensor  # [bucket] on the device
    host_ids: torch.Tensor  # [max_batch_size] host buffer (pinned on CUDA) the tokens are copied into
    is_done: torch.cuda.Event | None  # None on the CPU, where every copy is synchronous
    logits_BV: torch.Tensor | None  # kept only when a row records its logits

    def read(self) -> list[int]:
        if self.is_done is not None:
            self.is_done.synchronize()  # the one device->host sync per decode step
        return self.host_ids[: len(self.rows)].tolist()


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


class FlexInference:
    """Continuous-batching greedy generation with a paged KV cache and flex attention.

    `model` is a Hugging Face Qwen3/Llama causal LM (optionally inside a PEFT wrapper) on CUDA or CPU.
    With `peft_model`, the adapter's LoRA deltas are merged into `model`'s target weights from a
    pristine copy (`refresh_lora()` after every optimizer step); `base_model`, if given, holds those
    pristine weights already (e.g. a trainer's frozen base) so nothing is copied.
    """

    max_prefill_tokens = 8192  # tokens packed into one prefill row (at least max_seq_length)

    def __init__(
        self,
        model: nn.Module,
        tokenizer=None,
        max_batch_size: int = 32,
        max_seq_length: int = 2048,
        n_pages: int = 2048,
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
    ):
        check_engine_limits(max_batch_size, max_seq_length, n_pages, page_size, max_new_tokens)
        self.model = model
        self.causal_lm = unwrap_causal_lm(model)
        self.decoder = self.causal_lm.model
        self.config = self.causal_lm.config
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_seq_length = max_seq_length
        self.page_size = page_size
        self.max_new_tokens = max_new_tokens
        self.max_prefill_tokens = max(self.max_prefill_tokens, max_seq_length)
        first_param = next(self.causal_lm.parameters())
        self.device = first_param.device
        self.dtype = self.decoder.embed_tokens.weight.dtype
        self.user_kernel_options = {True: prefill_kernel_options or {}, False: decode_kernel_options or {}}
        self.end_ids = end_token_ids(self.causal_lm, tokenizer)

        self.attention_regimes = self._attention_regimes()
        # One page table per attention regime: a sliding window's pool recycles the pages that fall
        # out of the window, so it needs only window + 2 pages per sequence.
        self.page_tables = {
            regime: PageTable(page_size, self._num_pool_pages(window, n_pages), max_batch_size + 1, max_seq_length, self.device)
            for regime, window in self.attention_regimes.items()
        }
        # Batch slots are handed out by the full-attention table; the others follow its numbering.
        self.page_table = self.page_tables.get(FULL_ATTENTION) or next(iter(self.page_tables.values()))
        self.kv_caches = self._build_kv_caches()
        self.fa4_prefill = self._resolve_fa4_prefill(fa4_prefill)
        head_dims = sorted({attn.head_dim for attn in self._attention_layers()})
        # head_dim -> kernel options; decode's cross into the decode attention op as JSON
        self.step_kernel_options = {
            True: {D: self.kernel_options(True, D) for D in head_dims},
            False: {D: json.dumps(self.kernel_options(False, D)) for D in head_dims},
        }
        self._patch_model()
        # Static decode inputs (CUDA graphs read them in place): rows 0..B-1 of each.
        self.static_step_inputs = torch.zeros(3, max_batch_size, dtype=torch.long, device=self.device)
        # Two host buffers for sampled tokens: one being read while the next step fills the other.
        self.host_next_ids = torch.zeros(2, max_batch_size, dtype=torch.long, pin_memory=self.device.type == "cuda")
        self.num_decode_launches = 0
        # compile_decode: the decode step is compiled by regions, each with a symbolic batch size so
        # one compile serves every bucket: the prologue (masks, cache slots, embeddings), one
        # decoder layer, the epilogue (final norm, logits, greedy tokens). Norms, RoPE, residuals
        # and PLE fuse inside a layer, and layers of one kind share a compiled graph (E2B has 4
        # kinds in 35 layers): compiling the whole 35-layer step as one graph took 77 s on an H200.
        # CUDA graphs then capture the step per bucket.
        # NOTE: torch.compile specializes a size of 1, so the compiled step's buckets start at 2 (a
        # single sequence decodes beside one padding row): one compile instead of two.
        self.compile_decode = compile_decode
        compile_region = (lambda fn: torch.compile(fn, fullgraph=True, dynamic=False)) if compile_decode else (lambda fn: fn)
        self.decode_prologue = compile_region(self._decode_prologue)
        self.decode_layer = compile_region(call_layer)
        self.decode_epilogue = compile_region(self._decode_epilogue)
        self.buckets = batch_buckets(max_batch_size, smallest=2 if compile_decode else 1)
        self.cuda_graphs: dict[int, tuple] = {}
        # holds_until[batch_idx]: the first query position at which that slot's pages no longer fit
        # (a new page is needed, or a windowed page can be recycled)
        self.holds_until = [0] * (max_batch_size + 1)
        self.graph_pool = None
        self.timings: dict[str, float] = {}

        if fuse_projections:
            self._fuse_projections(peft_model is not None)
        if skinny_gemms:
            self._route_linears_through_skinny()
        self.peft_model = peft_model
        self.lora_targets: dict[str, torch.Tensor] = {}
        self.pristine_lora_weights: dict[str, torch.Tensor] = {}
        if peft_model is not None:
            self.lora_targets = lora_target_weights(self.causal_lm, peft_model)
            self.pristine_lora_weights = snapshot_pristine_lora_weights(self.lora_targets, base_model)
            self.refresh_lora()

    # --- model-specific hooks (gemma4_flex_inference.py overrides these) -------------------

    def _attention_layers(self):
        return [layer.self_attn for layer in self.decoder.layers]

    def _attention_regimes(self) -> dict[str, int | None]:
        """Attention regime -> sliding window (None: full causal)."""
        window = getattr(self.config, "sliding_window", None)
        layer_types = getattr(self.config, "layer_types", None) or [FULL_ATTENTION]
        return {t: (window if t == SLIDING_ATTENTION else None) for t in set(layer_types)}

    def _num_pool_pages(self, sliding_window: int | None, n_pages: int) -> int:
        if sliding_window is None:
            return n_pages
        pages_per_sequence = -(-sliding_window // self.page_size) + 2  # window, the page being written, slack
        return min(n_pages, self.max_batch_size * pages_per_sequence + 1)

    def _first_needed_pos(self, regime: str, query_pos: int) -> int:
        """The first position a query at `query_pos` sees in `regime` (HF: kv > q - window)."""
        window = self.attention_regimes[regime]
        return 0 if window is None else max(0, query_pos - window + 1)

    def _build_kv_caches(self) -> list[PagedKVCache | None]:
        n_kv_heads = self.config.num_key_value_heads
        return [
            PagedKVCache(self.page_table.n_pages, self.page_size, n_kv_heads, attn.head_dim, self.dtype, self.device)
            for attn in self._attention_layers()
        ]

    def _patch_model(self) -> None:
        if any(t != FULL_ATTENTION for t in self.attention_regimes):
            raise SystemExit("this checkpoint has sliding-window layers, which the Qwen3/Llama walker does not run")
        for attn in self._attention_layers():
            attn.forward = qwen3_llama_attention_forward.__get__(attn)

    def _fuse_projections(self, is_lora_merged: bool) -> None:
        """q/k/v and gate/up each become one GEMM (fewer, larger GEMMs read weights faster)."""
        for layer in self.decoder.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = qkv_projections(attn)
            linears = qkv + [mlp.gate_proj, mlp.up_proj]
            if any(hasattr(linear, "lora_A") for linear in linears) and not is_lora_merged:
                raise ValueError("fuse_projections needs merged LoRA weights: drop --no_merge_lora or the fusion")
            if any(getattr(linear, "base_layer", linear).bias is not None for linear in linears):
                raise ValueError("fuse_projections supports bias-free projections only")
            if len(qkv) > 1:
                fuse_linears(attn, qkv, "fused_qkv_weight")
            fuse_linears(mlp, [mlp.gate_proj, mlp.up_proj], "fused_gate_up_weight")
            mlp.forward = fused_mlp_forward.__get__(mlp)

    def _route_linears_through_skinny(self) -> None:
        """Every bias-free nn.Linear of the decoder, the lm_head and the fused projections go
        through skinny_linear: decode's few-row GEMMs take the Triton kernel wherever it beat
        cuBLAS on this GPU (prefill's many rows, and every GEMM on the CPU, stay F.linear)."""
        for module in [*self.decoder.modules(), self.causal_lm.lm_head]:
            # NOTE: exact type: quantized linears (bitsandbytes' Linear4bit) subclass nn.Linear.
            if type(module) is nn.Linear and module.bias is None:
                module.forward = skinny_linear_forward.__get__(module)
            if hasattr(module, "fused_qkv_weight") or hasattr(module, "fused_gate_up_weight"):
                module.is_skinny = True

    def restore_model(self) -> None:
        """Gives the model back its own forwards (HF generate works again); the engine is
        unusable afterwards."""
        for module in [*self.decoder.modules(), self.causal_lm.lm_head]:
            module.__dict__.pop("forward", None)
            module.__dict__.pop("is_skinny", None)

    def _embed(self, input_ids_BS: torch.Tensor, position_ids_BS: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The token embeddings [B, S, hidden] and what the layers read besides (RoPE cos/sin)."""
        hidden_BSE = self.decoder.embed_tokens(input_ids_BS)
        return hidden_BSE, {"position_embeddings": self.decoder.rotary_emb(hidden_BSE, position_ids_BS)}

    def _layer_kwargs(self, layer_idx: int, layer_inputs: dict, step: FlexStep) -> dict:
        """Decoder layer `layer_idx`'s keyword arguments besides its hidden states."""
        return dict(position_embeddings=layer_inputs["position_embeddings"], attention_mask=None, layer_step=step.for_layer(layer_idx))

    def _run_layers(self, hidden_BSE, layer_inputs: dict, step: FlexStep, layer_indices: range, run_layer=call_layer) -> torch.Tensor:
        """Runs decoder layers `layer_indices` in order through `run_layer`; returns their output."""
        for layer_idx in layer_indices:
            hidden_BSE = run_layer(self.decoder.layers[layer_idx], hidden_BSE, **self._layer_kwargs(layer_idx, layer_inputs, step))
        return hidden_BSE

    def _forward_hidden(self, input_ids_BS: torch.Tensor, position_ids_BS: torch.Tensor, step: FlexStep) -> torch.Tensor:
        """Walks the decoder layers. Returns the final-normed hidden states [B, S, hidden]."""
        hidden_BSE, layer_inputs = self._embed(input_ids_BS, position_ids_BS)
        hidden_BSE = self._run_layers(hidden_BSE, layer_inputs, step, range(len(self.decoder.layers)))
        return self.decoder.norm(hidden_BSE)

    def _logits(self, hidden_NE: torch.Tensor) -> torch.Tensor:
        return self.causal_lm.lm_head(hidden_NE).float()

    # --- kernel options --------------------------------------------------------------------

    def _resolve_fa4_prefill(self, fa4_prefill: bool | None) -> bool:
        head_dims = {cache.k_cache.shape[-1] for cache in self.kv_caches if cache is not None}
        is_supported = all(flash_prefill_supported(d, self.device) for d in head_dims)
        if fa4_prefill and not is_supported:
            warnings.warn("--fa4_prefill asked for, but flex_attention's FLASH backend cannot run here; using Triton")
        return bool(is_supported if fa4_prefill is None else fa4_prefill and is_supported)

    def kernel_options(self, is_prefill: bool, head_dim: int) -> dict:
        options = default_kernel_options(is_prefill, head_dim, self.device)
        if is_prefill and self.fa4_prefill:
            options = {"BACKEND": "FLASH"}
        return {**options, **self.user_kernel_options[is_prefill]}

    @property
    def kv_bytes_per_token(self) -> int:
        return sum(cache.bytes_per_token for cache in self.kv_caches if cache is not None)

    # --- prefill ----------------------------------------------------------------------------

    def _pack(self, sequences: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, FlexStep]:
        """Packs all `sequences` (already holding pages) into one prefill row.

        Returns input_ids [1, T], position_ids [1, T] and the FlexStep; T is padded to a multiple
        of 128 so lengths reuse compiled kernels. Padding is a document of its own and writes into
        the reserved page 0.
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
        num_padding = -len(token_ids) % 128
        token_ids += [0] * num_padding
        position_ids += [0] * num_padding
        document_ids += [len(sequences)] * num_padding
        T = len(token_ids)
        # One host->device copy for all step inputs.
        rows = [token_ids, position_ids, document_ids] + [physical_slots[r] + [0] * num_padding for r in regimes]
        inputs_RT = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
        document_id_T = inputs_RT[2]
        block_masks = {
            regime: create_block_mask(document_causal_mask_mod(document_id_T, window), None, None, T, T, device=self.device)
            for regime, window in self.attention_regimes.items()
        }
        self._flush_page_tables()
        slots = {regime: inputs_RT[3 + i] for i, regime in enumerate(regimes)}
        step = FlexStep(True, block_masks, slots, self.kv_caches, self.step_kernel_options[True], document_id_T=document_id_T)
        return inputs_RT[0:1], inputs_RT[1:2], step

    def _prefill(self, sequences: list[Sequence]) -> tuple[list[int], torch.Tensor]:
        """Runs the admitted `sequences` in one packed row; returns each one's next token and the
        logits at its last position [N, V]."""
        input_ids_1T, position_ids_1T, step = self._pack(sequences)
        last_positions = torch.tensor(sequences_last_positions(sequences), device=self.device)
        hidden_1NE = self._prefill_hidden(input_ids_1T, position_ids_1T, step, last_positions)
        logits_NV = self._logits(hidden_1NE[0])
        return logits_NV.argmax(-1).tolist(), logits_NV  # the one device->host sync of this prefill

    def _prefill_hidden(self, input_ids_1T, position_ids_1T, step: FlexStep, last_positions_N) -> torch.Tensor:
        """Hidden states [1, N, hidden] at each sequence's last position."""
        return self._forward_hidden(input_ids_1T, position_ids_1T, step)[:, last_positions_N]

    @torch.inference_mode()
    def score(self, token_ids: list[list[int]]) -> list[torch.Tensor]:
        """Teacher-forced logits [len, V] (float32, CPU) for each token list, through packed
        prefills of as many lists as the free slots and pages hold."""
        waiting = deque(Sequence(input_ids=list(ids)) for ids in token_ids)
        logits = []
        while waiting:
            batch = []
            while waiting and self.page_table.can_allocate() and self._can_hold(waiting[0]):
                batch.append(waiting.popleft())
                self._admit(batch[-1])
            if not batch:
                raise ValueError(f"a sequence of {waiting[0].seq_len} tokens does not fit the page pool")
            try:
                logits_TV = self._logits(self._forward_hidden(*self._pack(batch))[0]).cpu()
            finally:
                for seq in batch:
                    self._release(seq)
            starts = [0] + [p + 1 for p in sequences_last_positions(batch)]
            logits += [logits_TV[start : start + seq.seq_len] for start, seq in zip(starts, batch)]
        return logits

    # --- decode -----------------------------------------------------------------------------

    def _decode_prologue(self, input_ids_B, input_pos_B, batch_idx_B) -> tuple[dict, torch.Tensor, dict]:
        """The decode step before the layers. Returns, per regime, the rows' visible pages
        (kv_num_blocks, kv_indices) and cache slots; the embeddings [B, 1, hidden]; the layer inputs."""
        regime_tensors = {}
        for regime, table in self.page_tables.items():
            kv_num_blocks, kv_indices = table.decode_blocks(input_pos_B, batch_idx_B, self.attention_regimes[regime])
            # page_table[batch_idx, logical_block] -> physical_page; cache row = page * page_size + offset
            page_B = table.page_table[batch_idx_B, input_pos_B // self.page_size].long()
            regime_tensors[regime] = (kv_num_blocks, kv_indices, page_B * self.page_size + input_pos_B % self.page_size)
        hidden_B1E, layer_inputs = self._embed(input_ids_B[:, None], input_pos_B[:, None])
        return regime_tensors, hidden_B1E, layer_inputs

    def _decode_epilogue(self, hidden_B1E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Final norm, logits [B, V] and greedy tokens [B]."""
        logits_BV = self._logits(self.decoder.norm(hidden_B1E)[:, -1])
        return greedy_tokens(logits_BV), logits_BV

    def _mark_rows_dynamic(self, *tensors) -> None:
        """compile_decode: lets torch.compile treat dim 0 (the decode batch) of these inputs of a
        compiled region as symbolic, so one compile serves every batch bucket. Weak marks: a graph
        that needs a fixed size (a bucket of 1, flex's kernel inside the attention op) specialises it."""
        if self.compile_decode:
            for t in tensors:
                torch._dynamo.maybe_mark_dynamic(t, 0)

    def _run_decode_layer(self, layer: nn.Module, hidden_B1E: torch.Tensor, **layer_kwargs) -> torch.Tensor:
        """One decoder layer of the decode step (compiled: its batch-sized inputs marked symbolic)."""
        self._mark_rows_dynamic(hidden_B1E, *(t for t in torch.utils._pytree.tree_leaves(layer_kwargs) if isinstance(t, torch.Tensor)))
        return self.decode_layer(layer, hidden_B1E, **layer_kwargs)

    def _decode_step(self, input_ids_B, input_pos_B, batch_idx_B) -> tuple[torch.Tensor, torch.Tensor]:
        """One token for every row: tensor ops only (no host sync), so it can be graph-captured.

        Returns (next_ids [B], logits [B, V]).
        """
        # NOTE: no duck sizing while the regions compile: it makes one symbol of every two sizes
        # that happen to be equal (a PLE slice's storage offset and a batch slot row's, say), and
        # the next layer or bucket then fails the guard and compiles again.
        with fx_config.patch(use_duck_shape=False) if self.compile_decode else contextlib.nullcontext():
            mark_all_static(input_pos_B, batch_idx_B)
            regime_tensors, hidden_B1E, layer_inputs = self.decode_prologue(input_ids_B, input_pos_B, batch_idx_B)
            block_masks, physical_slots = {}, {}
            for regime, (kv_num_blocks, kv_indices, slots_B) in regime_tensors.items():
                # NOTE: marked static from the start, as the decode attention op marks its mask
                # tensors (a compiled layer's guards would see the marks appear after its first call).
                mark_all_static(kv_num_blocks, kv_indices)
                self._mark_rows_dynamic(kv_num_blocks, kv_indices, slots_B)
                table, window = self.page_tables[regime], self.attention_regimes[regime]
                block_masks[regime] = PagedDecodeMask(
                    kv_num_blocks, kv_indices, input_pos_B, batch_idx_B, table.physical_to_logical, self.page_size, window or 0
                )
                physical_slots[regime] = slots_B
            step = FlexStep(False, block_masks, physical_slots, self.kv_caches, self.step_kernel_options[False])
            hidden_B1E = self._run_layers(hidden_B1E, layer_inputs, step, range(len(self.decoder.layers)), self._run_decode_layer)
            self._mark_rows_dynamic(hidden_B1E)
            return self.decode_epilogue(hidden_B1E)

    def _launch_decode(self, rows: list[Sequence], use_graph: bool, previous: DecodeLaunch | None = None) -> DecodeLaunch:
        """Queues one decode step for `rows` and returns without waiting for it.

        Fresh steps take their inputs from the host bookkeeping. A chained step (`previous`, the
        step just queued for the same rows) takes the tokens `previous` sampled, on the device, one
        position further: the GPU runs it while the host reads and books `previous`'s tokens.
        """
        B = len(rows)
        # Eager decode pads to the same buckets as the graphs: one compiled kernel per bucket.
        bucket = next(b for b in self.buckets if b >= B)
        if previous is None:
            # Rows: last token, its position, batch slot; padding rows aim at the reserved slot 0.
            padding = [0] * (bucket - B)
            step_inputs = torch.tensor([
                [seq.output_ids[-1] for seq in rows] + padding,  # a running sequence has output
                [seq.seq_len - 1 for seq in rows] + padding,
                [seq.batch_idx for seq in rows] + padding,
            ])  # fmt: skip
            self._flush_page_tables()
            self.static_step_inputs[:, :bucket].copy_(step_inputs, non_blocking=True)
        else:
            self.static_step_inputs[0, :B].copy_(previous.next_ids[:B])
            self.static_step_inputs[1, :B] += 1
        if use_graph:
            graph, next_ids, logits = self.cuda_graphs[bucket]
            graph.replay()
        else:
            next_ids, logits = self._decode_step(*self._static_step_inputs(bucket))
        # The tokens go to a host buffer of their own: a chained step overwrites a graph's outputs.
        host_ids = self.host_next_ids[self.num_decode_launches % 2]
        self.num_decode_launches += 1
        host_ids[:B].copy_(next_ids[:B], non_blocking=True)
        is_done = None
        if self.device.type == "cuda":
            is_done = torch.cuda.Event()
            is_done.record()
        logits_BV = logits[:B].clone() if any(seq.record_logits for seq in rows) else None
        return DecodeLaunch(rows, next_ids, host_ids, is_done, logits_BV)

    def _can_chain(self, launch: DecodeLaunch, waiting: deque) -> bool:
        """Whether the next step can be queued before `launch`'s tokens are read: the same rows
        go on, as no row has finished, none reaches its length limit with `launch`'s token, every
        row's next position fits its pages, and no waiting sequence could be admitted instead."""
        for seq in launch.rows:
            if seq.finished or len(seq.output_ids) + 1 >= seq.max_new_tokens or seq.seq_len + 1 >= self.max_seq_length:
                return False
            # the chained step writes the K/V of the token `launch` samples, at position seq_len
            if not self._pages_fit(seq, seq.seq_len):
                return False
        return not (waiting and self.page_table.can_allocate() and self._can_hold(waiting[0]))

    def _static_step_inputs(self, bucket: int) -> list[torch.Tensor]:
        """Rows 0..bucket-1 of the static input ids, positions and batch slots; the compiled step
        sees their batch size as symbolic."""
        inputs = list(self.static_step_inputs[:, :bucket])
        self._mark_rows_dynamic(*inputs)
        return inputs

    @torch.inference_mode()
    def capture_cuda_graphs(self, buckets: list[int] | None = None) -> None:
        """One graph per batch bucket (default: all), largest first, all in one memory pool."""
        if self.device.type != "cuda":
            raise SystemExit("--capture_cudagraph needs a CUDA device")
        buckets = [b for b in (buckets or self.buckets) if b not in self.cuda_graphs]
        if not buckets:
            return
        start = time.perf_counter()
        self._flush_page_tables()
        bucket_s = {}
        for bucket in sorted(buckets, reverse=True):
            bucket_start = time.perf_counter()
            self.static_step_inputs[:, :bucket].zero_()  # every row a padding row: slot 0, page 0
            step_inputs = self._static_step_inputs(bucket)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # eager warm-up compiles this bucket's kernels
                self._decode_step(*step_inputs)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graph_pool):
                next_ids, logits = self._decode_step(*step_inputs)
            self.graph_pool = graph.pool()
            self.cuda_graphs[bucket] = (graph, next_ids, logits)
            bucket_s[bucket] = time.perf_counter() - bucket_start
        torch.cuda.synchronize()
        self.timings["capture_s"] = time.perf_counter() - start
        self.timings["capture_s_per_bucket"] = bucket_s

    # --- scheduler --------------------------------------------------------------------------

    def _flush_page_tables(self) -> None:
        for table in self.page_tables.values():
            table.flush()

    def _can_hold(self, seq: Sequence, query_pos: int | None = None) -> bool:
        """Whether every pool has room for `seq`'s tokens, given the next query position
        (default: the one after its last token, as after a prefill)."""
        query_pos = seq.seq_len if query_pos is None else query_pos
        batch_idx = seq.batch_idx if seq.batch_idx >= 0 else None
        return all(
            table.can_reserve(seq.seq_len, batch_idx, self._first_needed_pos(regime, query_pos))
            for regime, table in self.page_tables.items()
        )

    def _hold(self, seq: Sequence, query_pos: int) -> None:
        """Pages for `seq`'s tokens in every pool; windowed pools first recycle what the query at
        `query_pos` no longer sees."""
        holds_until = self.max_seq_length
        for regime, table in self.page_tables.items():
            first_needed_pos = self._first_needed_pos(regime, query_pos)
            table.trim(seq.batch_idx, first_needed_pos)
            table.reserve(seq.batch_idx, seq.seq_len, first_needed_pos)
            holds_until = min(holds_until, len(table.pages_of[seq.batch_idx]) * self.page_size)
            window = self.attention_regimes[regime]
            if window is not None:  # the next page to fall out of the window
                holds_until = min(holds_until, (first_needed_pos // self.page_size + 1) * self.page_size + window - 1)
        self.holds_until[seq.batch_idx] = holds_until

    def _pages_fit(self, seq: Sequence, query_pos: int) -> bool:
        """Whether the pages `seq` holds already serve a query at `query_pos` (no page to add or recycle)."""
        return query_pos < self.holds_until[seq.batch_idx]

    def _admit(self, seq: Sequence) -> None:
        seq.batch_idx = self.page_table.allocate()
        self._hold(seq, seq.seq_len)

    def _release(self, seq: Sequence) -> None:
        for table in self.page_tables.values():
            table.erase(seq.batch_idx, release_slot=table is self.page_table)
        seq.batch_idx = -1

    def _append(self, seq: Sequence, token: int, logits_V: torch.Tensor | None) -> None:
        seq.output_ids.append(token)
        if seq.record_logits:
            seq.output_logits.append(logits_V.detach().float().cpu())
        if token in self.end_ids:
            seq.finished, seq.finish_reason = True, "stop"
        elif len(seq.output_ids) >= seq.max_new_tokens or seq.seq_len >= self.max_seq_length:
            seq.finished, seq.finish_reason = True, "length"

    def _prepare(self, sequences: list[Sequence]) -> None:
        for seq in sequences:
            if seq.input_ids is None:
                if seq.text is None:
                    raise ValueError("a Sequence needs text or input_ids")
                if self.tokenizer is None:
                    raise ValueError("a Sequence without input_ids needs a tokenizer")
                seq.input_ids = self.tokenizer(seq.text, add_special_tokens=False)["input_ids"]
            seq.input_ids = list(seq.input_ids)
            if not seq.input_ids:
                raise ValueError("a prompt has no tokens")
            if len(seq.input_ids) >= self.max_seq_length:
                raise ValueError(
                    f"a prompt has {len(seq.input_ids)} tokens, max_seq_length is {self.max_seq_length}: "
                    "shorten it or raise --max_seq_length"
                )
            if seq.max_new_tokens is None:
                seq.max_new_tokens = self.max_new_tokens
            if seq.max_new_tokens < 1:
                raise ValueError(f"max_new_tokens must be at least 1, got {seq.max_new_tokens}")
            seq.output_ids, seq.output_logits, seq.finished, seq.finish_reason = [], [], False, None

    @torch.inference_mode()
    def generate(self, sequences: list[Sequence], capture_cudagraph: bool = False, progress: bool = False) -> list[Sequence]:
        """Greedy-decodes every sequence to an end id or its max_new_tokens; returns them in input order."""
        self._prepare(sequences)
        if capture_cudagraph:
            self.capture_cuda_graphs()
        try:
            return self._generate(sequences, capture_cudagraph, progress)
        finally:  # an error (or an interrupt) mid-way leaves no slot or page held
            for seq in sequences:
                if seq.batch_idx >= 0:
                    self._release(seq)

    def _generate(self, sequences: list[Sequence], capture_cudagraph: bool, progress: bool) -> list[Sequence]:
        """The scheduler loop: admit and prefill, decode steps for all running, retire.

        While the running set stays the same, each decode step is queued before the previous
        one's tokens are read, so the host's bookkeeping overlaps the GPU's work.
        """
        waiting: deque[Sequence] = deque(sequences)
        running: list[Sequence] = []  # in admission order: the last one is preempted first
        launch: DecodeLaunch | None = None  # a decode step queued but not read yet
        bar = _progress_bar(sum(s.max_new_tokens for s in sequences), progress)
        num_prefill_tokens = num_decode_tokens = 0
        prefill_s = decode_s = 0.0
        while waiting or running:
            if launch is None:
                admitted, admitted_tokens = [], 0
                while (
                    waiting
                    and self.page_table.can_allocate()
                    and self._can_hold(waiting[0])
                    and admitted_tokens + waiting[0].seq_len <= self.max_prefill_tokens
                ):
                    seq = waiting.popleft()
                    self._admit(seq)
                    admitted.append(seq)
                    admitted_tokens += seq.seq_len
                if admitted:
                    start = time.perf_counter()
                    next_ids, logits = self._prefill(admitted)
                    prefill_s += time.perf_counter() - start
                    num_prefill_tokens += admitted_tokens
                    for i, seq in enumerate(admitted):
                        self._append(seq, next_ids[i], logits[i])
                    running += admitted
                    bar.update(len(admitted))
                running = self._retire(running)
                if not running:
                    continue
                running = self._reserve_or_preempt(running, waiting)
                if not running:  # the only sequence gave its pages back: admit again
                    continue
                start = time.perf_counter()
                launch = self._launch_decode(running, capture_cudagraph)
            else:
                start = time.perf_counter()
            next_launch = self._launch_decode(running, capture_cudagraph, launch) if self._can_chain(launch, waiting) else None
            next_ids = launch.read()
            decode_s += time.perf_counter() - start
            num_appended = 0
            for i, seq in enumerate(launch.rows):
                if not seq.finished:  # a row that finished a step earlier rode along in a chained step
                    self._append(seq, next_ids[i], None if launch.logits_BV is None else launch.logits_BV[i])
                    num_appended += 1
            num_decode_tokens += num_appended
            bar.update(num_appended)
            launch = next_launch
            if launch is None:
                running = self._retire(running)
            bar.set_postfix_str(
                f"prefill {num_prefill_tokens / max(prefill_s, 1e-9):.0f} tok/s, "
                f"decode {num_decode_tokens / max(decode_s, 1e-9):.0f} tok/s"
            )
        bar.close()
        self.timings.update(prefill_s=prefill_s, decode_s=decode_s, num_prefill_tokens=num_prefill_tokens, num_decode_tokens=num_decode_tokens)
        return sequences

    def _retire(self, running: list[Sequence]) -> list[Sequence]:
        still_running = []
        for seq in running:
            if seq.finished:
                self._release(seq)
            else:
                still_running.append(seq)
        return still_running

    def _reserve_or_preempt(self, running: list[Sequence], waiting: deque) -> list[Sequence]:
        """Gives every running sequence room for its next token; when the pool runs dry, the newest
        sequence is preempted (its pages freed) and recomputed from its tokens later."""
        i = 0
        while i < len(running):
            seq = running[i]
            # The next step writes the K/V of the last token, at position seq_len - 1; most steps
            # cross no page boundary, so the pages held already fit.
            if self._pages_fit(seq, seq.seq_len - 1):
                i += 1
                continue
            if self._can_hold(seq, seq.seq_len - 1):
                self._hold(seq, seq.seq_len - 1)
                i += 1
                continue
            victim = running.pop()
            self._release(victim)
            victim.num_preemptions += 1
            waiting.appendleft(victim)
        return running

    # --- LoRA -------------------------------------------------------------------------------

    def refresh_lora(self) -> None:
        """Re-merges the PEFT model's current adapter into the inference weights (in place)."""
        refresh_lora_merge_from_pristine(self.lora_targets, self.pristine_lora_weights, self.peft_model)


def _progress_bar(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, unit="tok", dynamic_ncols=True, leave=False)


def end_token_ids(causal_lm: nn.Module, tokenizer) -> set[int]:
    """Every end id the model uses: generation config, model config and tokenizer."""
    end_ids: set[int] = set()
    for source in (getattr(causal_lm, "generation_config", None), causal_lm.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is not None:
            end_ids |= set(value) if isinstance(value, (list, tuple)) else {value}
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        end_ids.add(tokenizer.eos_token_id)
    return end_ids


def check_engine_limits(max_batch_size, max_seq_length, n_pages, page_size, max_new_tokens) -> None:
    """Bad sizes fail here with one sentence, before anything is allocated."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
    if page_size < 16 or page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two of at least 16, got {page_size}")
    if max_seq_length % page_size:
        raise ValueError(f"max_seq_length ({max_seq_length}) must be a multiple of page_size ({page_size})")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if (n_pages - 1) * page_size < max_seq_length:
        raise ValueError(
            f"the page pool ({n_pages} pages of {page_size}, one reserved) cannot hold even one sequence of "
            f"max_seq_length {max_seq_length}: raise --n_pages to at least {max_seq_length // page_size + 1}"
        )


# ---------------------------------------------------------------------------------------------
# LoRA double-copy and drift verification
# ---------------------------------------------------------------------------------------------
# The inference weights of every LoRA target are always rebuilt as pristine + delta from a
# pristine copy kept beside them, never by PEFT's merge/unmerge: in bf16, W + d - d != W, so a
# merge/unmerge cycle per training step drifts the base weights further every step.


def lora_layers(peft_model: nn.Module) -> dict[str, nn.Module]:
    """PEFT LoRA layers by the name of the module they adapt (PEFT's prefixes stripped)."""
    layers = {}
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and hasattr(module, "base_layer") and len(module.lora_A) > 0:
            if getattr(module, "use_dora", {}) and any(module.use_dora.values()):
                raise SystemExit("DoRA adapters are not supported by the LoRA double-copy")
            layers[name.removeprefix("base_model.model.")] = module
    return layers


def lora_target_weights(causal_lm: nn.Module, peft_model: nn.Module) -> dict[str, torch.Tensor]:
    """The inference model's weight tensor for every module the adapter targets."""
    modules = dict(causal_lm.named_modules())
    targets = {}
    for name in lora_layers(peft_model):
        module = modules.get(name)
        if module is None:
            raise SystemExit(f"the adapter targets {name}, which the inference model does not have")
        targets[name] = getattr(module, "base_layer", module).weight
    return targets


def snapshot_pristine_lora_weights(targets: dict[str, torch.Tensor], base_model: nn.Module | None = None) -> dict:
    """Pristine copies of the LoRA-target weights only (views of `base_model`'s when it is given)."""
    if base_model is None:
        return {name: weight.detach().clone() for name, weight in targets.items()}
    modules = dict(unwrap_causal_lm(base_model).named_modules())
    pristine = {}
    for name in targets:
        module = modules[name]
        pristine[name] = getattr(module, "base_layer", module).weight.detach()
    return pristine


@torch.no_grad()
def refresh_lora_merge_from_pristine(targets: dict, pristine: dict, peft_model: nn.Module, adapter_name: str | None = None) -> None:
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


def sha256_of(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@torch.no_grad()
def run_drift_verification(targets: dict, pristine: dict, peft_model: nn.Module, iterations: int = 5, seed: int = 0) -> dict:
    """Perturbs the LoRA weights `iterations` times, refreshing each time; then restores the first
    adapter. Passes when the pristine weights never changed and the restored merge is bit-equal
    to the first one."""
    generator = torch.Generator().manual_seed(seed)
    layers = lora_layers(peft_model)
    lora_params = {
        f"{name}.{part}": getattr(layer, part)[layer.active_adapters[0]].weight
        for name, layer in layers.items()
        for part in ("lora_A", "lora_B")
    }
    first_adapter = {name: p.detach().clone() for name, p in lora_params.items()}
    pristine_before = sha256_of(pristine)
    refresh_lora_merge_from_pristine(targets, pristine, peft_model)
    merged_first = sha256_of(targets)
    merged_per_iteration = []
    for _ in range(iterations):
        for p in lora_params.values():
            noise = torch.randn(p.shape, generator=generator) * (p.float().std().item() + 1e-3)
            p.add_(noise.to(device=p.device, dtype=p.dtype))
        refresh_lora_merge_from_pristine(targets, pristine, peft_model)
        merged_per_iteration.append(sha256_of(targets))
    for name, p in lora_params.items():
        p.copy_(first_adapter[name])
    refresh_lora_merge_from_pristine(targets, pristine, peft_model)
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
    result["passed"] = result["pristine_unchanged"] and result["restored_matches_first"] and result["adapter_changed_merge"]
    return result


# ---------------------------------------------------------------------------------------------
# Data parallel: one engine per rank (torchrun)
# ---------------------------------------------------------------------------------------------

# What generate() fills in, sent from the rank that generated a sequence to every rank (input_ids
# and max_new_tokens are set on every rank already: generate_shard prepares every sequence).
GATHERED_FIELDS = ("output_ids", "finished", "finish_reason", "num_preemptions")


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
    for name, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(name, value)
    if device.type == "cuda":
        num_local_ranks, num_gpus = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count()
        if num_local_ranks > num_gpus:
            raise SystemExit(f"torchrun started {num_local_ranks} processes on a host with {num_gpus} GPUs: pass --nproc_per_node {num_gpus} or fewer")
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)  # object collectives over nccl run on the current device
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None)
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
    without a process group). Every rank of `group` (None: the default group) passes the same list;
    each checks and tokenizes all of it, then generates its own block."""
    if not is_data_parallel():
        return engine.generate(sequences, **generate_kwargs)
    # NOTE: every rank checks every sequence, so bad input fails on all ranks alike instead of on
    # one, which would leave the others waiting in the gather until the process group times out.
    engine._prepare(sequences)
    shard = sequences[shard_slice(len(sequences), dist.get_rank(group), dist.get_world_size(group))]
    return engine.generate(shard, **generate_kwargs)


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
        raise ValueError(f"the ranks passed {num_sequences} sequences: every rank must pass the same list")
    results = [values for _, block in gathered for values in block]  # blocks in rank order = input order
    for seq, values in zip(sequences, results):
        for name, value in zip(GATHERED_FIELDS, values):
            setattr(seq, name, value)
    return sequences


def generate_sharded(engine: FlexInference, sequences: list[Sequence], group=None, **generate_kwargs) -> list[Sequence]:
    """Data-parallel `engine.generate`: every rank of `group` (None: the default group) passes the
    same `sequences` and its own engine, generates a contiguous block of them, and gets all of them
    back filled in, in input order. `generate_kwargs` go to `engine.generate`. Without a process
    group this is `engine.generate(sequences)`."""
    generate_shard(engine, sequences, group, **generate_kwargs)
    return gather_outputs(sequences, group)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------

PRESETS_DIR = Path(__file__).resolve().parent / "scripts" / "presets"


def build_arg_parser(default_model_name: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model_name", default=default_model_name, help="Hugging Face hub id or local checkpoint folder")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="where to run (auto: CUDA if available)")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto", help="weight and activation dtype (auto: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--n_prompts", type=int, default=8, help="number of prompts per round (cycles through the prompt list)")
    p.add_argument("--n_rounds", type=int, default=2, help="generation rounds; the first includes compilation")
    p.add_argument("--max_new_tokens", type=int, default=256, help="new tokens per prompt at most")
    p.add_argument("--max_batch_size", type=int, default=32, help="sequences decoded together at most")
    p.add_argument("--max_seq_length", type=int, default=2048, help="prompt + completion tokens per sequence at most (a multiple of page_size)")
    p.add_argument("--n_pages", type=int, default=2048, help="pages in the KV pool (page 0 is reserved)")
    p.add_argument("--page_size", type=int, default=128, help="tokens per KV page")
    p.add_argument("--capture_cudagraph", action="store_true", help="decode through CUDA graphs, one per batch bucket")
    p.add_argument("--compile_decode", action="store_true", help="torch.compile the decode step by regions (prologue, one graph per kind of decoder layer, epilogue), once for all batch buckets (fuses norms, RoPE, residuals)")
    p.add_argument("--fuse_projections", action="store_true", help="one GEMM for q/k/v and one for gate/up per layer (weights become views of the fused ones)")
    p.add_argument(
        "--no_skinny_gemms", dest="skinny_gemms", action="store_false",
        help="cuBLAS for every GEMM; by default decode's few-row GEMMs race a Triton kernel against cuBLAS per weight shape on the GPU and keep the faster",
    )  # fmt: skip
    p.add_argument("--lora_adapter", default=None, help="PEFT LoRA adapter folder, merged with the double-copy refresh")
    p.add_argument("--no_merge_lora", action="store_true", help="keep the PEFT wrapper unmerged (adapter computed every forward)")
    p.add_argument("--load_in_4bit", action="store_true", help="quantise to bitsandbytes NF4 while loading (CUDA only)")
    p.add_argument("--verify_no_drift", action="store_true", help="run the LoRA drift verification before generating")
    p.add_argument("--verify_iterations", type=int, default=5, help="adapter perturbations in the drift verification")
    p.add_argument("--stats_path", default=None, help="write run statistics as JSON here")
    p.add_argument("--chat_template", choices=["auto", "grpo", "native"], default="auto", help="grpo: system prompt asking for reasoning then a marked solution; native: the tokenizer's own template")
    p.add_argument("--fa4_prefill", action=argparse.BooleanOptionalAction, default=None, help="prefill with flex_attention's FLASH backend (default: only where it is supported)")
    p.add_argument("--decode_kernel_options", default=None, help="JSON dict of flex_attention kernel options for decode, overriding the defaults")
    p.add_argument("--prefill_kernel_options", default=None, help="JSON dict of flex_attention kernel options for prefill, overriding the defaults")
    p.add_argument("--prompts_file", default=None, help="prompts as JSONL (prompt/text/messages per line) or one prompt per line")
    p.add_argument("--load_format", choices=["auto", "dummy"], default="auto", help="dummy: random weights built from the config alone (benchmarks)")
    p.add_argument("--seed", type=int, default=0, help="random seed (dummy weights, drift perturbations)")
    p.add_argument("--trust_remote_code", action="store_true", help="allow code shipped inside the checkpoint to run")
    p.add_argument("--allow_pickle_weights", action="store_true", help="allow pickled .bin weights (can run code); safetensors otherwise")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def parse_json_dict(text: str | None, flag: str) -> dict | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise SystemExit(f"{flag} is not valid JSON ({error.msg}): pass a JSON object such as '{{\"BLOCK_N\": 32}}'")
    if not isinstance(value, dict):
        raise SystemExit(f"{flag} must be a JSON object such as '{{\"BLOCK_N\": 32}}'")
    return value


def resolve_device_and_dtype(args) -> tuple[torch.device, torch.dtype]:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked for, but no CUDA device is available")
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else args.device if args.device != "auto" else "cpu")
    dtype_name = args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    return device, getattr(torch, dtype_name)


def check_model_path(model_name: str) -> None:
    """A local-looking path that does not exist fails here rather than as a hub lookup."""
    looks_local = model_name.startswith((".", "/", "~")) or model_name.count("/") != 1
    if looks_local and not os.path.exists(os.path.expanduser(model_name)):
        raise SystemExit(f"model path {model_name} does not exist: pass a checkpoint folder or a hub id")


def preset_config_path(model_name: str) -> Path | None:
    path = PRESETS_DIR / (model_name.replace("/", "__") + ".json")
    return path if path.exists() else None


def load_config(model_name: str, trust_remote_code: bool):
    from transformers import AutoConfig

    preset = preset_config_path(model_name)
    if preset is not None and not os.path.isdir(model_name):  # shipped preset: no download needed
        return AutoConfig.for_model(**json.loads(preset.read_text()))
    try:
        return AutoConfig.from_pretrained(model_name, trust_remote_code=trust_remote_code)
    except OSError as error:
        raise SystemExit(f"could not read the config of {model_name}: {str(error).splitlines()[0]}")


def load_tokenizer(model_name: str, trust_remote_code: bool, required: bool):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        if required:
            raise SystemExit(f"could not load the tokenizer of {model_name}: {str(error).splitlines()[0]}")
        return None


def load_causal_lm(args, device, dtype, model_class=None, config_hook=None):
    """Loads (or, with --load_format dummy, builds with random weights) a causal LM on `device`."""
    from transformers import AutoModelForCausalLM

    model_class = model_class or AutoModelForCausalLM
    if args.load_format == "dummy":
        config = load_config(args.model_name, args.trust_remote_code)
        if config_hook is not None:
            config = config_hook(config)
        if args.load_in_4bit:
            raise SystemExit("--load_in_4bit quantises real weights while loading; it cannot be combined with --load_format dummy")
        torch.manual_seed(args.seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
        return model.eval()
    check_model_path(args.model_name)
    kwargs = dict(dtype=dtype, attn_implementation="eager", trust_remote_code=args.trust_remote_code)
    kwargs["use_safetensors"] = None if args.allow_pickle_weights else True
    if args.load_in_4bit:
        if device.type != "cuda":
            raise SystemExit("--load_in_4bit needs a CUDA GPU (bitsandbytes NF4)")
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
        kwargs["device_map"] = {"": device.index or 0}
    try:
        model = model_class.from_pretrained(args.model_name, **kwargs)
    except (OSError, ValueError) as error:
        first_line = str(error).strip().splitlines()[0]
        if "safetensors" in first_line or ".bin" in first_line or "pytorch_model" in first_line:
            raise SystemExit(f"{args.model_name} has no safetensors weights; pass --allow_pickle_weights to load pickled ones")
        raise SystemExit(f"could not load {args.model_name}: {first_line}")
    if not args.load_in_4bit:
        model = model.to(device)
    return model.eval()


def load_peft_adapter(model, adapter_path: str):
    from peft import PeftModel

    return PeftModel.from_pretrained(model, adapter_path, is_trainable=False)


def attach_lora(model, args, load_adapter=None):
    """Wraps `model` with the adapter at --lora_adapter. Returns (model to run, peft model or None)."""
    if args.lora_adapter is None:
        if args.verify_no_drift:
            raise SystemExit("--verify_no_drift checks a LoRA refresh: pass --lora_adapter too")
        return model, None
    if not os.path.isdir(args.lora_adapter):
        raise SystemExit(f"LoRA adapter folder {args.lora_adapter} does not exist")
    if args.load_in_4bit and not args.no_merge_lora:
        raise SystemExit("a LoRA adapter cannot be merged into 4-bit weights: add --no_merge_lora")
    if args.verify_no_drift and args.no_merge_lora:
        raise SystemExit("--verify_no_drift checks the merged double-copy; drop --no_merge_lora")
    try:
        peft_model = (load_adapter or load_peft_adapter)(model, args.lora_adapter)
    except (ValueError, KeyError, RuntimeError) as error:
        raise SystemExit(f"the adapter at {args.lora_adapter} does not fit this model: {str(error).strip().splitlines()[0]}")
    peft_model.eval()
    return peft_model, (None if args.no_merge_lora else peft_model)


def read_prompts(args) -> list:
    """Prompts as strings or chat message lists, cycled to --n_prompts."""
    if args.n_prompts < 1:
        raise SystemExit(f"--n_prompts must be at least 1, got {args.n_prompts}")
    prompts: list = DEFAULT_PROMPTS
    if args.prompts_file is not None:
        if not os.path.isfile(args.prompts_file):
            raise SystemExit(f"prompts file {args.prompts_file} does not exist")
        lines = [line for line in Path(args.prompts_file).read_text().splitlines() if line.strip()]
        is_jsonl = args.prompts_file.endswith(".jsonl") or (lines and lines[0].lstrip().startswith("{"))
        prompts = []
        for number, line in enumerate(lines, 1):
            if not is_jsonl:
                prompts.append(line)
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise SystemExit(f"line {number} of {args.prompts_file} is not valid JSON")
            value = record if isinstance(record, str) else next((record[k] for k in ("messages", "prompt", "text") if k in record), None)
            if value is None:
                raise SystemExit(f"line {number} of {args.prompts_file} has no prompt, text or messages field")
            prompts.append(value)
        if not prompts:
            raise SystemExit(f"prompts file {args.prompts_file} holds no prompts")
    return [prompts[i % len(prompts)] for i in range(args.n_prompts)]


def format_prompt(tokenizer, prompt, chat_template: str) -> str:
    """grpo: system prompt + user turn; native: the user's turn(s) as given; in the tokenizer's template."""
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if chat_template == "grpo":
        messages = [{"role": "system", "content": GRPO_SYSTEM_PROMPT}] + [m for m in messages if m["role"] != "system"]
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
        sequences.append(Sequence(text=text, input_ids=tokenizer(text, add_special_tokens=False)["input_ids"]))
    return sequences


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


def run_cli(args, engine_class=None, load_model=None, default_chat_template: str = "grpo", load_adapter=None) -> dict:
    """Loads the model, builds the engine, generates --n_rounds times, prints one summary line.

    Under torchrun each rank runs one engine on its contiguous block of the prompts; rank 0 gathers
    the completions in input order, prints and writes the stats (totals and one entry per rank).
    """
    engine_class = engine_class or FlexInference
    load_model = load_model or load_causal_lm
    for flag in ("max_new_tokens", "n_rounds", "verify_iterations"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    decode_options = parse_json_dict(args.decode_kernel_options, "--decode_kernel_options")
    prefill_options = parse_json_dict(args.prefill_kernel_options, "--prefill_kernel_options")
    try:
        check_engine_limits(args.max_batch_size, args.max_seq_length, args.n_pages, args.page_size, args.max_new_tokens)
    except ValueError as error:
        raise SystemExit(str(error))
    prompts = read_prompts(args)
    torch.manual_seed(args.seed)
    device, dtype = resolve_device_and_dtype(args)
    if args.capture_cudagraph and device.type != "cuda":
        raise SystemExit("--capture_cudagraph needs a CUDA device")
    owns_process_group = is_torchrun() and not is_data_parallel()
    device = init_data_parallel(device)
    is_distributed = is_data_parallel()
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if is_distributed else (0, 1)
    if rank != 0:  # only rank 0 prints
        from transformers.utils import logging as transformers_logging

        args.quiet = True
        transformers_logging.disable_progress_bar()

    start = time.perf_counter()
    model = load_model(args, device, dtype)
    # Dummy weights take a tokenizer only from a local folder: a preset needs no network.
    is_dummy = args.load_format == "dummy"
    tokenizer = None if is_dummy and not os.path.isdir(args.model_name) else load_tokenizer(args.model_name, args.trust_remote_code, required=not is_dummy)
    model, peft_model = attach_lora(model, args, load_adapter)
    load_s = time.perf_counter() - start
    _say(args, f"loaded {args.model_name} in {load_s:.1f} s")

    engine = engine_class(
        model,
        tokenizer,
        max_batch_size=args.max_batch_size,
        max_seq_length=args.max_seq_length,
        n_pages=args.n_pages,
        page_size=args.page_size,
        max_new_tokens=args.max_new_tokens,
        decode_kernel_options=decode_options,
        prefill_kernel_options=prefill_options,
        fa4_prefill=args.fa4_prefill,
        peft_model=peft_model,
        compile_decode=args.compile_decode,
        fuse_projections=args.fuse_projections,
        skinny_gemms=args.skinny_gemms,
    )
    drift = None
    if args.verify_no_drift:
        drift = run_drift_verification(engine.lora_targets, engine.pristine_lora_weights, peft_model, args.verify_iterations, args.seed)
        _say(args, f"drift verification: {'passed' if drift['passed'] else 'FAILED'} over {drift['iterations']} refreshes")

    chat_template = default_chat_template if args.chat_template == "auto" else args.chat_template
    wall_times, rank_wall_times, n_decoded = [], [], 0
    sequences: list[Sequence] = []
    shard: list[Sequence] = []  # this rank's block of sequences (all of them in a plain run)
    for _ in range(args.n_rounds):
        try:
            sequences = make_sequences(prompts, tokenizer, chat_template, engine.config.vocab_size, args.seed)
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            shard = generate_shard(engine, sequences, capture_cudagraph=args.capture_cudagraph, progress=not args.quiet)
        except ValueError as error:
            raise SystemExit(str(error))
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

    decode_tps = [n_decoded / t for t in wall_times]
    stats = {
        "backend": "flex_attention" + ("+compiled_step" if args.compile_decode else "") + ("+cudagraph" if args.capture_cudagraph else ""),
        "model_name": args.model_name,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "capture_cudagraph": args.capture_cudagraph,
        "lora_adapter": args.lora_adapter,
        "lora_merged": peft_model is not None,
        "n_prompts": len(sequences),
        "n_decoded_tokens": n_decoded,
        "wall_times_s": wall_times,
        "median_wall_s": statistics.median(wall_times),
        "best_wall_s": min(wall_times),
        "decode_tps_median": statistics.median(decode_tps),
        "decode_tps_best": max(decode_tps),
        "max_new_tokens": args.max_new_tokens,
        "peak_memory_gb": max(r["peak_memory_gb"] for r in ranks),
        "kv_bytes_per_token": engine.kv_bytes_per_token,
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
        Path(args.stats_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.stats_path).write_text(json.dumps(stats, indent=2))
    if rank == 0:
        on_ranks = f" on {world_size} ranks" if is_distributed else ""
        print(
            f"{stats['backend']}: {stats['n_prompts']} prompts{on_ranks}, {n_decoded} tokens, median {stats['median_wall_s']:.2f} s, "
            f"{stats['decode_tps_median']:.0f} tok/s (best {stats['decode_tps_best']:.0f}), peak {stats['peak_memory_gb']:.2f} GB"
        )
    if drift is not None and not drift["passed"]:
        raise SystemExit("drift verification failed: the pristine or restored weights changed")
    return stats


def _say(args, line: str) -> None:
    if not args.quiet:
        print(line, file=sys.stderr)


def main(argv=None) -> None:
    args = build_arg_parser("unsloth/Qwen3-4B-Base", "Greedy rollouts for Qwen3 / Llama-3.2 on flex_attention.").parse_args(argv)
    run_cli(args)


if __name__ == "__main__":
    main()
