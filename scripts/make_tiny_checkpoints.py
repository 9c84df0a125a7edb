#!/usr/bin/env python
"""Build tiny, random, deterministic Hugging Face checkpoints for tests and the demo.

Usage::

    python scripts/make_tiny_checkpoints.py [--out DIR] [--force]

or, from Python (e.g. a pytest session fixture)::

    from scripts.make_tiny_checkpoints import ensure_tiny_checkpoints
    root = ensure_tiny_checkpoints()          # builds only if the DONE marker is missing/stale

Layout of ``DIR`` (default ``<repo>/checkpoints/tiny``)::

    DONE                 marker, written last; holds the build version string
    qwen3/               Qwen3ForCausalLM (+ ChatML tokenizer, generation_config) + lora/
    llama/               LlamaForCausalLM with llama3 RoPE scaling, tied embeddings + lora/
    gemma4/              Gemma4ForConditionalGeneration (tiny text + tiny vision + tiny audio) + lora/
    gemma4_text/         the same text weights as a plain Gemma4ForCausalLM + lora/
    gemma4_text_keqv/    Gemma4ForCausalLM with attention_k_eq_v=True (separate random weights) + lora/

Everything is float32, safetensors, built from fixed seeds; no network access is needed.

Notes on transformers 5.x Gemma-4 (checked against 5.17):

* ``Gemma4TextConfig`` turns ``global_head_dim`` / ``num_global_key_value_heads`` into a
  heterogeneous ``per_layer_config`` ({layer_idx: {"head_dim": ...}} for the full-attention
  layers) and ``save_pretrained`` writes that ``per_layer_config`` instead of ``global_head_dim``.
  Released Gemma-4 checkpoints on the hub carry ``global_head_dim`` (+ ``num_global_key_value_heads``)
  instead, so after saving we rewrite the text config to that hub form (``rewrite_gemma_config_json``);
  transformers rebuilds the identical ``per_layer_config`` when loading it (verified below).
  ``num_global_key_value_heads`` is only honoured when ``attention_k_eq_v`` is True.
* ``layer_scalar`` is a persistent buffer of every decoder layer: it is written to the safetensors
  (``...layers.N.layer_scalar``, shape [1]) and restored on load (verified below).
* The last ``num_kv_shared_layers`` layers have no k_proj/v_proj/k_norm/v_norm; they reuse the K/V of
  the last non-shared layer of the same type. With ``use_double_wide_mlp`` exactly those layers get an
  MLP of width 2 * intermediate_size.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import logging
import os
import random
import shutil
import sys
import time
import warnings
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "checkpoints" / "tiny"

# Bump when the produced checkpoints change in a way the content hash below would not notice.
BUILD_VERSION = "tiny-checkpoints-v1"
MARKER = "DONE"
RANDOM_WEIGHTS_MARKER = (
    "RANDOM_WEIGHTS"  # in each checkpoint folder; the CLIs read it (qwen3_flex_inference.RANDOM_WEIGHTS_MARKER)
)

SEED = 20240601
BPE_VOCAB_SIZE = 448  # total tokenizer size, special tokens included

# ----------------------------------------------------------------------------- special tokens
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
GEMMA_SPECIALS = [
    "<pad>",  # 0
    "<eos>",  # 1
    "<bos>",  # 2
    "<start_of_turn>",  # 3
    "<end_of_turn>",  # 4
    # Multimodal placeholders, only so the Gemma4Config token ids point inside the tiny vocab.
    "<image_soft_token>",  # 5  image_token_id
    "<start_of_image>",  # 6  boi_token_id
    "<end_of_image>",  # 7  eoi_token_id
    "<video_soft_token>",  # 8  video_token_id
    "<audio_soft_token>",  # 9  audio_token_id
    "<start_of_audio>",  # 10 boa_token_id
    "<end_of_audio>",  # 11 eoa_token_index
]

CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set content = message['content'] -%}"
    "{%- else -%}{%- set content = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') -%}{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- else -%}{%- set first_user_prefix = (messages[0]['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('')) + '\\n\\n' -%}{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{%- if message['content'] is string -%}{%- set content = message['content'] -%}"
    "{%- else -%}{%- set content = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') + content | trim"
    " + '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

# ----------------------------------------------------------------------------- model sizes
SMALL_LM = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
GEMMA_LAYER_TYPES = [
    "sliding_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",  # layer 5: last non-shared sliding layer -> stores K/V for 6, 8
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "full_attention",
]
GEMMA_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
}
GEMMA_GLOBAL_HEAD_DIM = 32

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_TARGETS_MM_REGEX = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"

CHECK_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Mia has 3 boxes with 12 pencils each. How many pencils does she have?"},
]


# ============================================================================= corpus / tokenizer
def _load_default_prompts() -> list[str]:
    """The CLI's demo prompts (scripts/demo_prompts.txt, one per line): the tokenizer's corpus."""
    text = (REPO_ROOT / "scripts" / "demo_prompts.txt").read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


def _build_corpus(prompts: list[str]) -> list[str]:
    """Deterministic training text: the prompts plus generated math-flavoured filler."""
    rng = random.Random(SEED)
    words = sorted({w.strip(".,?!:;()") for p in prompts for w in p.split()} - {""})
    extra = (
        "Solution Reasoning Answer Step First Then Next So Therefore Finally Check the answer is We Let "
        "each total left per minus plus times divided by equals half third quarter number numbers sum "
        "difference product You are a helpful assistant Please think step by carefully and show your work "
        "final result units hours minutes dollars metres kilometres litres pages days weeks years"
    ).split()
    vocab_words = words + extra
    lines: list[str] = []
    lines += prompts * 4
    lines += [f"Solution: {p}" for p in prompts]
    for n in range(0, 1001):
        lines.append(f"{n} {n + 1} {n * 2} {n}.{n % 10}{(n * 7) % 10}")
    for _ in range(600):
        a, b = rng.randint(0, 99), rng.randint(1, 99)
        op = rng.choice(["+", "-", "*", "/"])
        res = {"+": a + b, "-": a - b, "*": a * b, "/": round(a / b, 2)}[op]
        lines.append(f"Step {rng.randint(1, 9)}: {a} {op} {b} = {res}.")
    for _ in range(800):
        n = rng.randint(4, 14)
        sent = " ".join(rng.choice(vocab_words) for _ in range(n))
        lines.append(sent[0].upper() + sent[1:] + rng.choice([".", "?", "!", "."]))
    for _ in range(200):
        lines.append(
            f"Reasoning: {rng.choice(words)} {rng.choice(words)} {rng.randint(2, 60)}. "
            f"Therefore the answer is {rng.randint(0, 500)}.\nAnswer: {rng.randint(0, 500)}"
        )
    return lines


def train_bpe(corpus: list[str], specials: list[str], vocab_size: int):
    """A byte-level BPE trained on `corpus`, the `specials` taking ids 0, 1, ... in their order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=specials,  # get ids 0..len(specials)-1, in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    for i, s in enumerate(specials):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def _make_tokenizers(corpus: list[str]):
    from transformers import PreTrainedTokenizerFast

    chatml = PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(corpus, CHATML_SPECIALS, BPE_VOCAB_SIZE),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=["<|im_start|>", "<|im_end|>"],
        add_bos_token=False,
        add_eos_token=False,
        model_max_length=1024,
        chat_template=CHATML_TEMPLATE,
    )
    gemma = PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(corpus, GEMMA_SPECIALS, BPE_VOCAB_SIZE),
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        # like Gemma's own tokenizer: plain text gets <bos> in front; chat templates write it
        # themselves (and apply_chat_template encodes without special tokens)
        add_bos_token=True,
        add_eos_token=False,
        model_max_length=1024,
        chat_template=GEMMA_TEMPLATE,
        extra_special_tokens={
            "start_of_turn_token": "<start_of_turn>",
            "end_of_turn_token": "<end_of_turn>",
            "image_token": "<image_soft_token>",
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "audio_token": "<audio_soft_token>",
            "boa_token": "<start_of_audio>",
            "eoa_token": "<end_of_audio>",
        },
    )
    # Sanity: bos exactly once from the template, and in front of plain text.
    ids = gemma.apply_chat_template(CHECK_MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = _as_id_list(ids)
    bos = gemma.convert_tokens_to_ids("<bos>")
    assert ids[0] == bos and ids.count(bos) == 1, ids[:8]
    assert gemma("hello")["input_ids"][0] == bos and gemma("hello", add_special_tokens=False)["input_ids"][0] != bos
    assert _as_id_list(chatml.apply_chat_template(CHECK_MESSAGES, add_generation_prompt=True, tokenize=True))[0] == 1
    return chatml, gemma


def _as_id_list(x) -> list[int]:
    """apply_chat_template(tokenize=True) returns a list in some versions, a BatchEncoding in others."""
    if hasattr(x, "keys") and "input_ids" in x:
        x = x["input_ids"]
    if hasattr(x, "tolist"):
        x = x.tolist()
    if x and isinstance(x[0], list):
        x = x[0]
    return list(x)


# ============================================================================= weights
def _randomize_(model, seed: int, embed_std: float, gain: float = 1.0) -> None:
    """Deterministic, deliberately "loud" init so greedy decoding of a tiny model is not degenerate.

    * embeddings: N(0, embed_std); Gemma's scaled embeddings (forward multiplies by sqrt(dim)) get
      N(0, 1/sqrt(dim)) so that the scaled rows have unit std
    * matrices / convs: N(0, gain / sqrt(fan_in))
    * norm weights: 1 + 0.1 * N(0, 1) (Gemma-4 RMSNorm multiplies by the weight as-is, as Qwen3/Llama do)
    * Gemma-4 ``layer_scalar`` buffers: U[0.5, 1.5]
    """
    import torch
    from torch import nn

    g = torch.Generator().manual_seed(seed)

    def randn(shape):
        return torch.randn(shape, generator=g, dtype=torch.float32)

    seen: set[int] = set()
    modules = list(model.named_modules())
    # Embeddings first so tied lm_heads follow the embedding rule.
    ordered = [m for m in modules if isinstance(m[1], nn.Embedding)] + [
        m for m in modules if not isinstance(m[1], nn.Embedding)
    ]
    with torch.no_grad():
        for mname, mod in ordered:
            for pname, p in mod.named_parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                if isinstance(mod, nn.Embedding):
                    scale = getattr(mod, "scalar_embed_scale", None)
                    std = (1.0 / scale) if scale else embed_std
                    val = randn(p.shape) * std
                elif p.ndim >= 2:
                    fan_in = 1
                    for s in p.shape[1:]:
                        fan_in *= s
                    val = randn(p.shape) * (gain / fan_in**0.5)
                elif "norm" in mname.rsplit(".", 1)[-1] or "norm" in pname:
                    val = 1.0 + 0.1 * randn(p.shape)
                elif pname == "bias":
                    val = 0.02 * randn(p.shape)
                else:
                    val = 0.1 * randn(p.shape)
                p.copy_(val.to(p.dtype))
            if hasattr(mod, "layer_scalar") and isinstance(mod.layer_scalar, torch.Tensor):
                mod.layer_scalar.copy_(0.5 + torch.rand(mod.layer_scalar.shape, generator=g))


def _randomize_lora_(peft_model, seed: int, std: float = 0.1) -> int:
    import torch

    g = torch.Generator().manual_seed(seed)
    n = 0
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
                n += 1
    return n


# ============================================================================= configs
def _qwen3_config(tok):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=len(tok),
        **SMALL_LM,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        attention_bias=False,
        use_sliding_window=False,
        bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        dtype="float32",
    )


def _llama_config(tok):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tok),
        **SMALL_LM,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_parameters=dict(LLAMA3_ROPE),
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        dtype="float32",
    )


def _gemma_text_config(tok, k_eq_v: bool = False):
    from transformers import Gemma4TextConfig

    kw = {}
    if k_eq_v:
        kw["num_global_key_value_heads"] = 1
    return Gemma4TextConfig(
        vocab_size=len(tok),
        vocab_size_per_layer_input=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=10,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=GEMMA_GLOBAL_HEAD_DIM,
        sliding_window=24,
        layer_types=list(GEMMA_LAYER_TYPES),
        num_kv_shared_layers=4,
        hidden_size_per_layer_input=8,
        use_double_wide_mlp=True,
        final_logit_softcapping=30.0,
        rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        max_position_embeddings=1024,
        rope_parameters=copy.deepcopy(GEMMA_ROPE),
        eos_token_id=[tok.convert_tokens_to_ids("<eos>"), tok.convert_tokens_to_ids("<end_of_turn>")],
        bos_token_id=tok.convert_tokens_to_ids("<bos>"),
        pad_token_id=tok.convert_tokens_to_ids("<pad>"),
        attention_k_eq_v=k_eq_v,
        dtype="float32",
        **kw,
    )


def gemma_mm_config(tok, text_config):
    from transformers import Gemma4AudioConfig, Gemma4Config, Gemma4VisionConfig

    vision = Gemma4VisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        patch_size=4,
        pooling_kernel_size=2,
        position_embedding_size=16,
        max_position_embeddings=1024,
    )
    audio = Gemma4AudioConfig(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        subsampling_conv_channels=[4, 4],
        conv_kernel_size=3,
        output_proj_dims=16,
    )
    ids = tok.convert_tokens_to_ids
    return Gemma4Config(
        text_config=text_config,
        vision_config=vision,
        audio_config=audio,
        image_token_id=ids("<image_soft_token>"),
        boi_token_id=ids("<start_of_image>"),
        eoi_token_id=ids("<end_of_image>"),
        video_token_id=ids("<video_soft_token>"),
        audio_token_id=ids("<audio_soft_token>"),
        boa_token_id=ids("<start_of_audio>"),
        eoa_token_index=ids("<end_of_audio>"),
        tie_word_embeddings=True,
        dtype="float32",
    )


def _hubify_gemma_text_config(d: dict, k_eq_v: bool) -> dict:
    """Replace transformers' serialised ``per_layer_config`` by the hub form (``global_head_dim``...)."""
    d = dict(d)
    per_layer = d.pop("per_layer_config", None) or {}
    global_head_dims = {layer["head_dim"] for layer in per_layer.values() if "head_dim" in layer}
    assert len(global_head_dims) == 1, f"one global head_dim expected, got {global_head_dims}"
    d["global_head_dim"] = global_head_dims.pop()
    d["num_global_key_value_heads"] = 1 if k_eq_v else None
    return dict(sorted(d.items()))


def rewrite_gemma_config_json(folder: Path, multimodal: bool, k_eq_v: bool) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    if multimodal:
        cfg["text_config"] = _hubify_gemma_text_config(cfg["text_config"], k_eq_v)
    else:
        cfg = _hubify_gemma_text_config(cfg, k_eq_v)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


# ============================================================================= build
def _save_model(model, folder: Path, tok, gen_eos: list[int], bos, pad) -> None:
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=gen_eos, pad_token_id=pad)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    # the CLIs say that such a checkpoint's completions are random text
    (folder / RANDOM_WEIGHTS_MARKER).write_text("Random weights (scripts/make_tiny_checkpoints.py): for tests.\n")


def _save_lora(model, folder: Path, targets, seed: int) -> int:
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, cfg)  # NB: injects LoRA layers into `model` in place
    n = _randomize_lora_(peft_model, seed)
    peft_model.peft_config["default"].base_model_name_or_path = None
    peft_model.save_pretrained(folder / "lora", safe_serialization=True)
    # peft stores a list of targets as a set -> the saved order depends on PYTHONHASHSEED; sort it.
    path = folder / "lora" / "adapter_config.json"
    acfg = json.loads(path.read_text())
    if isinstance(acfg.get("target_modules"), list):
        acfg["target_modules"] = sorted(acfg["target_modules"])
    path.write_text(json.dumps(acfg, indent=2, sort_keys=True) + "\n")
    return n


def _state_dict_copy(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _build_all(out: Path) -> list[dict]:
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4ForConditionalGeneration, LlamaForCausalLM, Qwen3ForCausalLM

    torch.manual_seed(SEED)  # construction uses the global RNG; everything is overwritten below anyway
    prompts = _load_default_prompts()
    chatml, gemma_tok = _make_tokenizers(_build_corpus(prompts))
    out.mkdir(parents=True, exist_ok=True)
    built = []

    def ids(tok, *names):
        return [tok.convert_tokens_to_ids(n) for n in names]

    # ---- qwen3
    im_end, eot = ids(chatml, "<|im_end|>", "<|endoftext|>")
    model = Qwen3ForCausalLM(_qwen3_config(chatml)).float().eval()
    _randomize_(model, SEED + 1, embed_std=1.0)
    _save_model(model, out / "qwen3", chatml, [im_end, eot], bos=eot, pad=eot)
    sd = _state_dict_copy(model)
    n_lora = _save_lora(model, out / "qwen3", LORA_TARGETS, SEED + 101)
    built.append(dict(name="qwen3", auto="causal", sd=sd, n_lora=n_lora, tok=chatml))

    # ---- llama (llama3 rope scaling, tied embeddings)
    model = LlamaForCausalLM(_llama_config(chatml)).float().eval()
    # Tied embeddings + gain 1.0 collapse greedy decoding to one repeated token; gain 1.5 does not.
    _randomize_(model, SEED + 2, embed_std=0.125, gain=1.5)
    _save_model(model, out / "llama", chatml, [im_end, eot], bos=eot, pad=eot)
    sd = _state_dict_copy(model)
    n_lora = _save_lora(model, out / "llama", LORA_TARGETS, SEED + 102)
    built.append(dict(name="llama", auto="causal", sd=sd, n_lora=n_lora, tok=chatml))

    # ---- gemma4 multimodal + gemma4_text with the very same text weights
    g_eos, g_eot, g_bos, g_pad = ids(gemma_tok, "<eos>", "<end_of_turn>", "<bos>", "<pad>")
    text_cfg = _gemma_text_config(gemma_tok)
    mm = Gemma4ForConditionalGeneration(gemma_mm_config(gemma_tok, copy.deepcopy(text_cfg))).float().eval()
    _randomize_(mm, SEED + 3, embed_std=0.125)
    text = Gemma4ForCausalLM(copy.deepcopy(text_cfg)).float().eval()
    prefix = "model.language_model."
    text_sd = {"model." + k[len(prefix) :]: v for k, v in mm.state_dict().items() if k.startswith(prefix)}
    text_sd["lm_head.weight"] = mm.lm_head.weight.detach()
    missing, unexpected = text.load_state_dict(text_sd, strict=True)
    assert not missing and not unexpected
    text.tie_weights()
    got = text.state_dict()
    assert got.keys() == text_sd.keys(), set(got) ^ set(text_sd)
    assert all(torch.equal(got[k], text_sd[k]) for k in got), "gemma4_text state dict differs from gemma4"
    assert text.lm_head.weight.data_ptr() == text.model.embed_tokens.weight.data_ptr()

    _save_model(mm, out / "gemma4", gemma_tok, [g_eos, g_eot], bos=g_bos, pad=g_pad)
    rewrite_gemma_config_json(out / "gemma4", multimodal=True, k_eq_v=False)
    _save_model(text, out / "gemma4_text", gemma_tok, [g_eos, g_eot], bos=g_bos, pad=g_pad)
    rewrite_gemma_config_json(out / "gemma4_text", multimodal=False, k_eq_v=False)
    sd_mm, sd_text = _state_dict_copy(mm), _state_dict_copy(text)
    n_lora = _save_lora(mm, out / "gemma4", LORA_TARGETS_MM_REGEX, SEED + 103)
    built.append(dict(name="gemma4", auto="mm", sd=sd_mm, n_lora=n_lora, tok=gemma_tok, cfg=text_cfg))
    n_lora = _save_lora(text, out / "gemma4_text", LORA_TARGETS, SEED + 104)
    built.append(dict(name="gemma4_text", auto="causal", sd=sd_text, n_lora=n_lora, tok=gemma_tok, cfg=text_cfg))

    # ---- gemma4_text_keqv: attention_k_eq_v=True, one KV head on full-attention layers (which then
    # have no v_proj: values = k_proj output, v_norm'ed). Own random weights.
    keqv_cfg = _gemma_text_config(gemma_tok, k_eq_v=True)
    model = Gemma4ForCausalLM(copy.deepcopy(keqv_cfg)).float().eval()
    assert model.model.layers[2].self_attn.v_proj is None
    _randomize_(model, SEED + 5, embed_std=0.125)
    _save_model(model, out / "gemma4_text_keqv", gemma_tok, [g_eos, g_eot], bos=g_bos, pad=g_pad)
    rewrite_gemma_config_json(out / "gemma4_text_keqv", multimodal=False, k_eq_v=True)
    sd = _state_dict_copy(model)
    n_lora = _save_lora(model, out / "gemma4_text_keqv", LORA_TARGETS, SEED + 105)
    built.append(dict(name="gemma4_text_keqv", auto="causal", sd=sd, n_lora=n_lora, tok=gemma_tok, cfg=keqv_cfg))
    return built


def _verify(out: Path, built: list[dict]) -> list[str]:
    """Reload every checkpoint from disk, compare with what was built, run greedy generation, apply LoRA."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    lines = []
    logits_by_name = {}
    for b in built:
        folder = out / b["name"]
        tok = AutoTokenizer.from_pretrained(folder)
        cls = AutoModelForImageTextToText if b["auto"] == "mm" else AutoModelForCausalLM
        model, info = cls.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
        model.eval()
        bad = {k: v for k, v in info.items() if v}  # missing / unexpected / mismatched keys, error messages
        assert not bad, f"{b['name']}: loading info {bad}"
        sd = model.state_dict()
        assert sd.keys() == b["sd"].keys(), f"{b['name']}: keys differ {set(sd) ^ set(b['sd'])}"
        for k, v in sd.items():
            assert torch.equal(v, b["sd"][k]), f"{b['name']}: {k} differs after reload"
        if "cfg" in b:  # per-layer attention geometry survives the hub-form config.json
            want = b["cfg"]
            got = model.config.get_text_config()
            for i in range(want.num_hidden_layers):
                for attr in ("head_dim", "num_key_value_heads"):
                    assert getattr(got.per_layer_config[i], attr) == getattr(want.per_layer_config[i], attr)
            scalars = [float(layer.layer_scalar) for layer in model.get_decoder().layers]
            assert all(0.5 <= s <= 1.5 for s in scalars) and len(set(scalars)) == len(scalars)

        ids = tok.apply_chat_template(CHECK_MESSAGES, add_generation_prompt=True, tokenize=True)
        input_ids = torch.tensor([_as_id_list(ids)])
        eos = model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos)
        with torch.no_grad():
            # One greedy run of 30 tokens with eos suppressed (min_new_tokens); the raw (unprocessed) logits
            # tell where an unforced run would have stopped: the first step whose argmax is an eos id.
            gen = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=30,
                min_new_tokens=30,
                do_sample=False,
                return_dict_in_generate=True,
                output_logits=True,
            )
        forced = gen.sequences[0, input_ids.shape[1] :].tolist()
        raw = torch.stack(gen.logits)[:, 0]  # [30, vocab]
        logits = raw[0]  # next-token logits of the prompt
        logits_by_name[b["name"]] = (logits, forced)
        distinct = len(set(forced))
        assert distinct >= 4, f"{b['name']}: degenerate greedy output {forced}"
        top = raw.argmax(-1).tolist()
        stop = next((f"{i} (id {t})" for i, t in enumerate(top) if t in eos), "-")

        peft_model = PeftModel.from_pretrained(model, folder / "lora")
        lora = {n: p for n, p in peft_model.named_parameters() if "lora_" in n}
        assert len(lora) == b["n_lora"] and all(p.abs().sum() > 0 for p in lora.values()), b["name"]
        assert not any(("vision" in n or "audio" in n) for n in lora), "LoRA leaked into a tower"
        with torch.no_grad():
            lora_logits = peft_model(input_ids=input_ids).logits[0, -1]
        assert not torch.allclose(lora_logits, logits, atol=1e-3), f"{b['name']}: LoRA has no effect"
        n_params = sum(v.numel() for k, v in b["sd"].items() if not k.endswith("layer_scalar"))
        lines.append(
            f"[tiny-ckpt] {b['name']:<17} {type(model).__name__:<31} vocab={len(tok)} params={n_params} "
            f"eos={eos} greedy30: {distinct} distinct, first eos at {stop}; "
            f"lora tensors={len(lora)}"
        )
    (mm_logits, mm_tokens), (txt_logits, txt_tokens) = logits_by_name["gemma4"], logits_by_name["gemma4_text"]
    diff = (mm_logits - txt_logits).abs().max().item()
    assert diff < 1e-5 and mm_tokens == txt_tokens, f"gemma4 vs gemma4_text differ (max |dlogit| {diff})"
    return lines


# ============================================================================= entry points
def _content_hash() -> str:
    h = hashlib.sha256()
    h.update(Path(__file__).read_bytes())
    h.update("\n".join(_load_default_prompts()).encode())
    return h.hexdigest()[:16]


def _version_string() -> str:
    # importlib.metadata instead of importing the libraries: the up-to-date check must stay instant.
    from importlib.metadata import PackageNotFoundError, version

    def v(pkg: str) -> str:
        try:
            return version(pkg)
        except PackageNotFoundError:  # pragma: no cover
            return "?"

    libs = " ".join(f"{pkg}={v(pkg)}" for pkg in ("torch", "transformers", "tokenizers", "peft", "safetensors"))
    return f"{BUILD_VERSION} content={_content_hash()} {libs}"


@contextlib.contextmanager
def _quiet():
    """Silence transformers/peft/hub logging, progress bars and warnings; restore afterwards."""
    import transformers.utils.logging as tlog

    old_verbosity = tlog.get_verbosity()
    old_bars = tlog.is_progress_bar_enabled()
    bnb = logging.getLogger("bitsandbytes")
    old_bnb = bnb.level
    bnb.setLevel(logging.ERROR)  # bitsandbytes (pulled in by peft) warns about a missing 'kernels' package
    tlog.set_verbosity_error()
    tlog.disable_progress_bar()
    try:
        from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

        old_hub = are_progress_bars_disabled()
        disable_progress_bars()
    except Exception:  # pragma: no cover
        old_hub = None
    import torch

    # The models are tiny: intra-op threading only adds overhead (and OpenMP spin-waits badly when the
    # cores are shared with other processes), so build single-threaded.
    old_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        torch.set_num_threads(old_threads)
        tlog.set_verbosity(old_verbosity)
        if old_bars:
            tlog.enable_progress_bar()
        if old_hub is False:
            enable_progress_bars()
        bnb.setLevel(old_bnb)


def _marker_ok(root: Path, version: str) -> bool:
    try:
        return (root / MARKER).read_text().strip() == version
    except OSError:
        return False


_KNOWN_ENTRIES = {MARKER, "qwen3", "llama", "gemma4", "gemma4_text", "gemma4_text_keqv"}


def ensure_tiny_checkpoints(out_dir=None, force: bool = False, verbose: bool = True) -> Path:
    """Return the root dir of the tiny checkpoints, building them first if missing or stale.

    The root holds a ``DONE`` marker with a version string (build version + hash of this script and of
    the demo prompts + library versions); a mismatch triggers a full rebuild (a few seconds). Building
    happens in a temporary sibling folder which replaces ``out_dir`` at the end, under a file lock, so
    concurrent callers (e.g. pytest-xdist workers) are safe. Prints one line per checkpoint when it
    builds (``verbose``), nothing otherwise.
    """
    import fcntl

    root = Path(out_dir).expanduser().resolve() if out_dir is not None else DEFAULT_OUT
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # before peft/bitsandbytes get imported
    version = _version_string()
    if not force and _marker_ok(root, version):
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    lock_path = root.parent / f".{root.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and _marker_ok(root, version):  # built by someone else while we waited
            return root
        if root.exists():
            foreign = sorted(p.name for p in root.iterdir() if p.name not in _KNOWN_ENTRIES)
            if foreign or not root.is_dir():
                raise RuntimeError(
                    f"refusing to replace {root}: it holds entries this script did not write ({foreign[:5]})"
                )
        # Leftovers of builds that were killed (we hold the lock, so nobody else is building).
        for stale in root.parent.glob(f".{root.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        for stale in root.parent.glob(f".{root.name}.old-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = root.parent / f".{root.name}.tmp-{os.getpid()}"
        old = root.parent / f".{root.name}.old-{os.getpid()}"
        try:
            with _quiet():
                built = _build_all(tmp)
                lines = _verify(tmp, built)
            (tmp / MARKER).write_text(version + "\n")
            if root.exists():
                root.rename(old)
            tmp.rename(root)
            shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if verbose:
            for line in lines:
                print(line, flush=True)
    return root


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help=f"output root (default: {DEFAULT_OUT})")
    ap.add_argument("--force", action="store_true", help="rebuild even if the DONE marker is current")
    args = ap.parse_args(argv)
    root = Path(args.out).expanduser().resolve() if args.out is not None else DEFAULT_OUT
    t0 = time.perf_counter()
    up_to_date = not args.force and _marker_ok(root, _version_string())
    ensure_tiny_checkpoints(root, force=args.force)
    state = "up to date (use --force to rebuild)" if up_to_date else f"built in {time.perf_counter() - t0:.1f}s"
    print(f"[tiny-ckpt] {root}: {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
