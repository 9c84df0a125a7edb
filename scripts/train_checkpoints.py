"""Trained small checkpoints: Qwen3, Llama and Gemma-4 language models (and LoRA adapters) trained on
the Python standard library's own source, a corpus every machine with Python has offline.

    python -m scripts.train_checkpoints --size ci      # the CI size (CPU), into scripts/trained_checkpoints/
    python -m scripts.train_checkpoints --size gpu --out checkpoints/trained_gpu   # a scaled-down E2B (CUDA)

The recipe, deterministic from `--seed` on a given machine and Python:
1. Corpus: every `.py` file of the running interpreter's standard library and its tests, sorted by
   path, without installed packages, GUIs and codec tables (`corpus_files`); a file is held out when
   the hash of its path says so (1 in 20), so the split does not move when files come or go.
2. Documents: each training file as raw text, and chat examples made from its functions: the user
   turn is a function's header (signature and docstring), the assistant turn the whole function
   (`function_chats`). Chats teach the chat template and the turn's end; raw text is most tokens.
3. Tokenizers: one byte-level BPE trained on the training files, with each family's special tokens
   and chat template (Qwen3: ChatML; Llama: Llama 3's headers; Gemma: turns, `<bos>`).
4. Models: trained from scratch on windows of the packed token stream (AdamW, warm-up then cosine),
   float32 on the CPU, bf16 autocast on CUDA; then a LoRA adapter per model, trained on the chats
   alone. Gemma-4 is written in both layouts: multimodal (as E2B-it ships, with tiny towers) and
   text-only.
5. Report (`REPORT.json` in each model's folder; the tables in README.md, "Trained checkpoints",
   and scripts/benchmarks/README.md): held-out cross-entropy (nats per token) and perplexity, the
   model's own mean next-token entropy on held-out text, and greedy completions of held-out prompts.

The CI size is committed (scripts/trained_checkpoints/, 12 MB in bf16): training it takes about an
hour on two CPU cores, far beyond the test suite's budget, and a float32 training run is exact only
on the machine that ran it. `ensure_trained_checkpoints()` assembles it under checkpoints/trained/,
with the text-only Gemma-4 layout beside the multimodal one, the way the tests and `make run` use it.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import dataclasses
import hashlib
import importlib.util
import json
import math
import random
import shlex
import shutil
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

if __name__ == "__main__" and importlib.util.find_spec("qwen3_flex_inference") is None:
    # NOTE: run by path, the repository root (the engine modules, scripts.*) is not on sys.path
    sys.exit(
        f"run it from the repository root ({Path(__file__).resolve().parents[1]}) as: "
        + shlex.join(["python", "-m", "scripts.train_checkpoints", *sys.argv[1:]])
    )

REPO_ROOT = Path(__file__).resolve().parents[1]
COMMITTED_DIR = REPO_ROOT / "scripts" / "trained_checkpoints"
DEFAULT_OUT = REPO_ROOT / "checkpoints" / "trained"
MODEL_NAMES = ("qwen3", "llama", "gemma4")

# Standard-library folders left out: installed packages, GUIs, codec tables and packages other Pythons lack.
EXCLUDED_TOP = {
    "site-packages",
    "idlelib",
    "lib2to3",
    "tkinter",
    "turtledemo",
    "ensurepip",
    "pydoc_data",
    "encodings",
    "distutils",
    "__phello__",
}
HELD_OUT_ONE_IN = 20

# ----------------------------------------------------------------------------- special tokens, templates
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# Message contents are plain strings here; each template is its family's, less tools and dates.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif -%}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


@dataclasses.dataclass(frozen=True)
class Size:
    """One checkpoint size: the tokenizer, the models' shapes and the training budget."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int  # Qwen3 and Llama
    num_heads: int
    num_kv_heads: int
    head_dim: int
    gemma_layers: int
    gemma_head_dim: int
    gemma_global_head_dim: int
    gemma_kv_heads: int
    gemma_kv_shared_layers: int
    gemma_ple_dim: int
    sliding_window: int
    max_function_chars: int  # longest function made into a chat example
    seq_len: int  # training window
    batch_size: int
    steps: int
    lr: float
    lora_steps: int
    lora_rank: int


SIZES = {
    "ci": Size(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=384,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        gemma_layers=10,
        gemma_head_dim=32,
        gemma_global_head_dim=64,
        gemma_kv_heads=2,
        gemma_kv_shared_layers=4,
        gemma_ple_dim=16,
        sliding_window=64,
        max_function_chars=600,
        seq_len=256,
        batch_size=16,
        steps=1500,
        lr=3e-3,
        lora_steps=200,
        lora_rank=8,
    ),
    # A scaled-down E2B (Gemma-4 only): E2B's head dims (256 sliding, 512 global), one KV head, PLE, KV sharing.
    "gpu": Size(
        vocab_size=8192,
        hidden_size=384,
        intermediate_size=1536,
        num_layers=6,
        num_heads=4,
        num_kv_heads=1,
        head_dim=96,
        gemma_layers=10,
        gemma_head_dim=256,
        gemma_global_head_dim=512,
        gemma_kv_heads=1,
        gemma_kv_shared_layers=4,
        gemma_ple_dim=32,
        sliding_window=256,
        max_function_chars=1500,
        seq_len=1024,
        batch_size=32,
        steps=1200,
        lr=1e-3,
        lora_steps=200,
        lora_rank=16,
    ),
}


# ============================================================================= corpus
def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relative_path: str) -> bool:
    return int(hashlib.sha256(relative_path.encode()).hexdigest(), 16) % HELD_OUT_ONE_IN == 0


def corpus_files(root: Path | None = None) -> dict[str, list[tuple[str, str]]]:
    """The standard library's source (its tests included) as {"train": [(path, text)], "held_out":
    [...]}, sorted by path; `root` None: the running interpreter's."""
    root = root or stdlib_root()
    split = {"train": [], "held_out": []}
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if relative.parts[0] in EXCLUDED_TOP:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        split["held_out" if is_held_out(relative.as_posix()) else "train"].append((relative.as_posix(), text))
    return split


def function_chats(text: str, max_chars: int) -> list[list[dict]]:
    """Chat examples from a file's functions: the user turn is the function's header (its source up
    to the first statement of the body, the docstring included), the assistant turn the function."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines(keepends=True)
    chats = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.decorator_list:
            continue
        source = textwrap.dedent("".join(lines[node.lineno - 1 : node.end_lineno])).strip()
        body = node.body[1:] if ast.get_docstring(node) is not None and len(node.body) > 1 else node.body
        header_lines = body[0].lineno - node.lineno
        header = "\n".join(source.splitlines()[:header_lines]).strip()
        if not header or len(source) > max_chars or not is_python(source):
            continue
        chats.append([{"role": "user", "content": header}, {"role": "assistant", "content": source}])
    return chats


def is_python(text: str) -> bool:
    """Whether `text` parses as Python source."""
    try:
        ast.parse(text)
        return True
    except (SyntaxError, ValueError):  # ValueError: null bytes
        return False


# ============================================================================= tokenizers
def make_tokenizer(family: str, texts: list[str], vocab_size: int):
    """The family's tokenizer (transformers' fast tokenizer) with its specials and chat template."""
    from transformers import PreTrainedTokenizerFast

    from scripts.make_tiny_checkpoints import CHATML_SPECIALS, GEMMA_SPECIALS, train_bpe

    if family == "qwen3":
        return PreTrainedTokenizerFast(
            tokenizer_object=train_bpe(texts, CHATML_SPECIALS, vocab_size),
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            extra_special_tokens=["<|im_start|>", "<|im_end|>"],
            model_max_length=4096,
            chat_template=CHATML_TEMPLATE,
        )
    if family == "llama":
        return PreTrainedTokenizerFast(
            tokenizer_object=train_bpe(texts, LLAMA3_SPECIALS, vocab_size),
            bos_token="<|begin_of_text|>",
            eos_token="<|eot_id|>",
            pad_token="<|end_of_text|>",
            extra_special_tokens=["<|start_header_id|>", "<|end_header_id|>"],
            add_bos_token=True,
            model_max_length=4096,
            chat_template=LLAMA3_TEMPLATE,
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(texts, GEMMA_SPECIALS, vocab_size),
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        add_bos_token=True,  # as Gemma's: plain text gets <bos>; the chat template writes its own
        model_max_length=4096,
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


def document_end_id(family: str, tokenizer) -> int:
    """The token that ends a raw-text document in training: each family's end of text."""
    name = {"qwen3": "<|endoftext|>", "llama": "<|end_of_text|>", "gemma4": "<eos>"}[family]
    return tokenizer.convert_tokens_to_ids(name)


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    return list(ids)


def token_stream(family: str, tokenizer, files: list[tuple[str, str]], max_chars: int, seed: int):
    """Every document of `files` (raw text, then the chats made from it), shuffled, as one id array."""
    import numpy as np

    end_id = document_end_id(family, tokenizer)
    raw = tokenizer([text for _, text in files], verbose=False)["input_ids"]  # batched: in parallel
    documents = []
    for (_, text), ids in zip(files, raw):
        documents.append(ids + [end_id])
        documents += [chat_ids(tokenizer, chat) for chat in function_chats(text, max_chars)]
    random.Random(seed).shuffle(documents)
    return np.fromiter((t for doc in documents for t in doc), dtype=np.int32)


# ============================================================================= models
def model_config(family: str, size: Size, tokenizer):
    """The family's HF config at `size`, its special ids from `tokenizer`."""
    ids = tokenizer.convert_tokens_to_ids
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size,
        max_position_embeddings=4096,
        dtype="float32",
    )
    if family == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(
            **common,
            num_hidden_layers=size.num_layers,
            num_attention_heads=size.num_heads,
            num_key_value_heads=size.num_kv_heads,
            head_dim=size.head_dim,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            bos_token_id=ids("<|endoftext|>"),
            eos_token_id=ids("<|im_end|>"),
            pad_token_id=ids("<|endoftext|>"),
        )
    if family == "llama":
        from transformers import LlamaConfig

        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        }
        return LlamaConfig(
            **common,
            num_hidden_layers=size.num_layers,
            num_attention_heads=size.num_heads,
            num_key_value_heads=size.num_kv_heads,
            head_dim=size.head_dim,
            tie_word_embeddings=True,
            rope_parameters=rope,
            bos_token_id=ids("<|begin_of_text|>"),
            eos_token_id=[ids("<|end_of_text|>"), ids("<|eot_id|>")],
            pad_token_id=ids("<|end_of_text|>"),
        )
    from transformers import Gemma4TextConfig

    # E2B's pattern: four sliding layers, then a full one; the last layers share their K/V
    layer_types = ["full_attention" if i % 5 == 4 else "sliding_attention" for i in range(size.gemma_layers)]
    layer_types[-1] = "full_attention"
    return Gemma4TextConfig(
        **common,
        vocab_size_per_layer_input=len(tokenizer),
        num_hidden_layers=size.gemma_layers,
        num_attention_heads=size.num_heads,
        num_key_value_heads=size.gemma_kv_heads,
        head_dim=size.gemma_head_dim,
        global_head_dim=size.gemma_global_head_dim,
        sliding_window=size.sliding_window,
        layer_types=layer_types,
        num_kv_shared_layers=size.gemma_kv_shared_layers,
        hidden_size_per_layer_input=size.gemma_ple_dim,
        use_double_wide_mlp=True,
        final_logit_softcapping=30.0,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
        },
        bos_token_id=ids("<bos>"),
        eos_token_id=[ids("<eos>"), ids("<end_of_turn>")],
        pad_token_id=ids("<pad>"),
    )


def build_model(family: str, config, seed: int, device):
    """A freshly initialised model (HF's own init) on `device`. NOTE: on the CPU, Gemma-4's sliding-window
    masks make SDPA many times slower than eager attention, so the CPU trains it on eager."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    attention = "eager" if family == "gemma4" and device.type == "cpu" else "sdpa"
    return AutoModelForCausalLM.from_config(config, attn_implementation=attention).float().to(device)


# ============================================================================= training
def windows(stream, seq_len: int, batch_size: int, generator):
    """A batch of `batch_size` random windows of `seq_len` + 1 tokens of the stream."""
    import torch

    starts = torch.randint(0, len(stream) - seq_len - 1, (batch_size,), generator=generator)
    return torch.stack([torch.from_numpy(stream[s : s + seq_len + 1].astype("int64")) for s in starts.tolist()])


def train(model, stream, size: Size, steps: int, lr: float, seed: int, device, log_every: int = 100, label=""):
    """AdamW on random windows of `stream`: linear warm-up over 5% of the steps, cosine to 10% of `lr`."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95)
    )
    warmup = max(1, steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    generator = torch.Generator().manual_seed(seed)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    model.train()
    start, losses = time.perf_counter(), []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        batch = windows(stream, size.seq_len, size.batch_size, generator).to(device)
        with autocast:
            logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % log_every == 0 or step + 1 == steps:
            recent = sum(losses[-log_every:]) / len(losses[-log_every:])
            print(
                f"{label} step {step + 1}/{steps}: loss {recent:.3f} ({time.perf_counter() - start:.0f} s)", flush=True
            )
    model.eval()
    return losses


def held_out_report(model, stream, seq_len: int, device, max_windows: int = 64) -> dict:
    """Cross-entropy (nats per token), perplexity and the model's mean next-token entropy on held-out
    windows (non-overlapping, from the start of the held-out stream)."""
    import torch

    num_windows = min(max_windows, (len(stream) - 1) // seq_len)
    total_ce = total_entropy = 0.0
    count = 0
    with torch.no_grad():
        for i in range(num_windows):
            window = torch.from_numpy(stream[i * seq_len : (i + 1) * seq_len + 1].astype("int64"))[None].to(device)
            logits = model(input_ids=window[:, :-1]).logits.float()
            logp = logits.log_softmax(-1)
            total_ce += torch.nn.functional.cross_entropy(logits[0], window[0, 1:], reduction="sum").item()
            total_entropy -= (logp.exp() * logp).sum().item()
            count += seq_len
    ce = total_ce / count
    return dict(cross_entropy=ce, perplexity=math.exp(ce), next_token_entropy=total_entropy / count, tokens=count)


def round_to_bfloat16_(model) -> None:
    """Rounds every float weight to bf16 values (kept in float32): the checkpoint is saved in bf16,
    so what is measured and fine-tuned after this is what loads."""
    import torch

    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            if tensor.is_floating_point():
                tensor.copy_(tensor.to(torch.bfloat16).float())


def train_lora(model, chat_stream, size: Size, seed: int, device, label: str):
    """A LoRA adapter on every projection, trained on the chats alone; returns the PEFT model."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=size.lora_rank,
        lora_alpha=2 * size.lora_rank,
        target_modules=list(LORA_TARGETS),
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    train(peft_model, chat_stream, size, size.lora_steps, size.lr / 3, seed, device, log_every=50, label=label)
    return peft_model


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ============================================================================= samples and report
def sample_prompts(tokenizer, held_out: list[tuple[str, str]], max_chars: int) -> list[dict]:
    """Three held-out prompts: the start of two files as raw text, and one function header as a chat."""
    raw = [text.split("\n\n\n")[0][:300] for _, text in held_out[:2]]
    chats = [chat for _, text in held_out for chat in function_chats(text, max_chars)]
    header = chats[len(chats) // 2][0]
    chat_text = tokenizer.apply_chat_template([header], add_generation_prompt=True, tokenize=False)
    return [dict(kind="raw", prompt=p, ids=tokenizer(p)["input_ids"]) for p in raw] + [
        dict(kind="chat", prompt=header["content"], ids=tokenizer(chat_text, add_special_tokens=False)["input_ids"])
    ]


def greedy_samples(model, tokenizer, prompts: list[dict], max_new_tokens: int, device) -> list[dict]:
    import torch

    samples = []
    for prompt in prompts:
        ids = torch.tensor([prompt["ids"]], device=device)
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
            )
        completion = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        samples.append(dict(kind=prompt["kind"], prompt=prompt["prompt"], greedy_completion=completion))
    return samples


def write_demo_prompts(held_out: list[tuple[str, str]], max_chars: int, path: Path, count: int = 16) -> None:
    """The CLI's prompts for the trained checkpoints (`make run`): held-out function headers as chats."""
    chats = [chat for _, text in held_out for chat in function_chats(text, max_chars)]
    headers = [chat[0] for chat in chats if len(chat[0]["content"]) <= 160]
    picked = random.Random(0).sample(headers, count)
    path.write_text("".join(json.dumps({"messages": [header]}) + "\n" for header in picked))


# ============================================================================= saving
def save_checkpoint(model, tokenizer, folder: Path, family: str) -> None:
    """The model in bf16 with its tokenizer and generation config (the family's end ids)."""
    import torch
    from transformers import GenerationConfig

    config = model.config.get_text_config()
    end_ids = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    if family == "qwen3":
        end_ids = [config.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=end_ids, pad_token_id=config.pad_token_id
    )
    model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    model.float()
    tokenizer.save_pretrained(folder)


def save_adapter(peft_model, folder: Path) -> None:
    peft_model.peft_config["default"].base_model_name_or_path = None
    peft_model.save_pretrained(folder, safe_serialization=True)
    (folder / "README.md").unlink(missing_ok=True)  # peft's model-card template
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    if isinstance(config.get("target_modules"), list):  # peft keeps a set: its order depends on the hash seed
        config["target_modules"] = sorted(config["target_modules"])
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def multimodal_gemma4(text_model, tokenizer, seed: int):
    """The trained text model inside Gemma-4's multimodal layout (E2B-it's), with tiny random towers."""
    import torch
    from transformers import Gemma4ForConditionalGeneration

    from scripts.make_tiny_checkpoints import gemma_mm_config

    torch.manual_seed(seed)
    config = gemma_mm_config(tokenizer, copy.deepcopy(text_model.config))
    model = Gemma4ForConditionalGeneration(config).float().eval()
    text_state = {k[len("model.") :]: v for k, v in text_model.state_dict().items() if k.startswith("model.")}
    missing, unexpected = model.model.language_model.load_state_dict(text_state, strict=True)
    assert not missing and not unexpected, (missing, unexpected)
    model.tie_weights()
    return model


def text_only_gemma4(folder: Path, out: Path) -> None:
    """Writes the text-only layout (`Gemma4ForCausalLM`, and its adapter's names) of a multimodal
    Gemma-4 checkpoint folder, the same weights."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer, Gemma4ForCausalLM, Gemma4ForConditionalGeneration

    from scripts.make_tiny_checkpoints import rewrite_gemma_config_json

    mm = Gemma4ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    text = Gemma4ForCausalLM(mm.config.get_text_config()).float().eval()
    prefix = "model.language_model."
    state = {"model." + k[len(prefix) :]: v for k, v in mm.state_dict().items() if k.startswith(prefix)}
    missing, unexpected = text.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    text.tie_weights()
    text.generation_config = mm.generation_config
    text.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    rewrite_gemma_config_json(out, multimodal=False, k_eq_v=False)
    AutoTokenizer.from_pretrained(folder).save_pretrained(out)
    (out / "lora").mkdir(exist_ok=True)
    adapter = load_file(folder / "lora" / "adapter_model.safetensors")
    save_file(
        {k.replace(".language_model.", "."): v for k, v in adapter.items()}, out / "lora" / "adapter_model.safetensors"
    )
    config = json.loads((folder / "lora" / "adapter_config.json").read_text())
    config["target_modules"] = sorted(LORA_TARGETS)
    (out / "lora" / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    shutil.copy(folder / "REPORT.json", out / "REPORT.json")


def multimodal_adapter(text_folder: Path, out: Path) -> None:
    """The adapter of `text_folder` (trained on the text model) renamed onto the multimodal layout."""
    from safetensors.torch import load_file, save_file

    from scripts.make_tiny_checkpoints import LORA_TARGETS_MM_REGEX

    out.mkdir(parents=True, exist_ok=True)
    adapter = load_file(text_folder / "adapter_model.safetensors")
    prefix, mm_prefix = "base_model.model.model.", "base_model.model.model.language_model."
    save_file({mm_prefix + k[len(prefix) :]: v for k, v in adapter.items()}, out / "adapter_model.safetensors")
    config = json.loads((text_folder / "adapter_config.json").read_text())
    config["target_modules"] = LORA_TARGETS_MM_REGEX
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


# ============================================================================= the recipe
def build_family(family: str, size_name: str, size: Size, split: dict, out: Path, seed: int, device) -> dict:
    """Trains one family's tokenizer, model and adapter, and writes its checkpoint folder with REPORT.json."""
    import numpy as np

    start = time.perf_counter()
    train_texts = [text for _, text in split["train"]]
    tokenizer = make_tokenizer(family, train_texts, size.vocab_size)
    train_stream = token_stream(family, tokenizer, split["train"], size.max_function_chars, seed)
    held_out_stream = token_stream(family, tokenizer, split["held_out"], size.max_function_chars, seed)
    chats = [chat for _, text in split["train"] for chat in function_chats(text, size.max_function_chars)]
    chat_stream = np.fromiter((t for chat in chats for t in chat_ids(tokenizer, chat)), dtype=np.int32)
    model = build_model(family, model_config(family, size, tokenizer), seed, device)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"{family}: {num_params / 1e6:.2f}M parameters, {len(train_stream) / 1e6:.2f}M training tokens", flush=True)
    losses = train(model, train_stream, size, size.steps, size.lr, seed, device, label=family)
    round_to_bfloat16_(model)
    report = dict(
        family=family,
        size=size_name,
        seed=seed,
        num_parameters=num_params,
        corpus=dict(
            python=sys.version.split()[0],
            train_files=len(split["train"]),
            held_out_files=len(split["held_out"]),
            train_chars=sum(len(t) for t in train_texts),
            train_tokens=len(train_stream),
            held_out_tokens=len(held_out_stream),
            chat_examples=len(chats),
        ),
        training=dict(
            dataclasses.asdict(size), device=device.type, final_train_loss=sum(losses[-50:]) / len(losses[-50:])
        ),
        held_out=held_out_report(model, held_out_stream, size.seq_len, device),
    )
    prompts = sample_prompts(tokenizer, split["held_out"], size.max_function_chars)
    report["samples"] = greedy_samples(model, tokenizer, prompts, 64, device)
    folder = out / family
    shutil.rmtree(folder, ignore_errors=True)
    text_folder = folder / "text_adapter"
    peft_model = train_lora(model, chat_stream, size, seed + 1, device, label=f"{family} lora")
    save_adapter(peft_model, text_folder)
    base = peft_model.unload()
    if family == "gemma4":
        from scripts.make_tiny_checkpoints import rewrite_gemma_config_json

        save_checkpoint(multimodal_gemma4(base, tokenizer, seed + 2), tokenizer, folder, family)
        rewrite_gemma_config_json(folder, multimodal=True, k_eq_v=False)
        multimodal_adapter(text_folder, folder / "lora")
        shutil.rmtree(text_folder)
    else:
        save_checkpoint(base, tokenizer, folder, family)
        text_folder.rename(folder / "lora")
    report["seconds"] = time.perf_counter() - start
    (folder / "REPORT.json").write_text(json.dumps(report, indent=1) + "\n")
    held = report["held_out"]
    print(
        f"{family}: held-out cross-entropy {held['cross_entropy']:.3f} nats/token "
        f"(perplexity {held['perplexity']:.1f}), next-token entropy {held['next_token_entropy']:.3f}, "
        f"in {report['seconds']:.0f} s",
        flush=True,
    )
    return report


def committed_version() -> str:
    """A hash of the committed checkpoints and of this script: the assembled folder's marker."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    for path in sorted(COMMITTED_DIR.rglob("*")):
        if path.is_file():
            digest.update(path.relative_to(COMMITTED_DIR).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def ensure_trained_checkpoints(out: Path | None = None) -> Path:
    """The CI-size trained checkpoints, assembled under `out` (default checkpoints/trained/) on first
    use: the committed qwen3, llama and gemma4 (multimodal) folders and prompts.jsonl (the CLI's
    prompts), and gemma4_text, the text-only layout of the same Gemma-4 weights. Returns `out`."""
    import fcntl

    out = Path(out or DEFAULT_OUT)
    version = committed_version()
    marker = out / "DONE"
    if marker.is_file() and marker.read_text().strip() == version:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.is_file() and marker.read_text().strip() == version:
            return out
        tmp = out.parent / f".{out.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        for family in MODEL_NAMES:
            shutil.copytree(COMMITTED_DIR / family, tmp / family)
        shutil.copy(COMMITTED_DIR / "prompts.jsonl", tmp / "prompts.jsonl")
        with quiet_transformers():
            text_only_gemma4(tmp / "gemma4", tmp / "gemma4_text")
        (tmp / "DONE").write_text(version + "\n")
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return out


@contextlib.contextmanager
def quiet_transformers():
    """Transformers' warnings and progress bars off (loading and saving the assembled checkpoints)."""
    import transformers.utils.logging as transformers_logging

    verbosity, has_bars = transformers_logging.get_verbosity(), transformers_logging.is_progress_bar_enabled()
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(verbosity)
        if has_bars:
            transformers_logging.enable_progress_bar()


def main(argv=None) -> None:
    import torch

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--size", choices=sorted(SIZES), default="ci", help="ci: CPU, committed; gpu: a scaled-down E2B"
    )
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: ci: the committed folder)")
    parser.add_argument(
        "--families", nargs="+", choices=MODEL_NAMES, default=None, help="default: ci: all three; gpu: gemma4"
    )
    parser.add_argument("--seed", type=int, default=0, help="the seed of the split's shuffles, inits and batches")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: ci: cpu; gpu: cuda")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (a float32 run is exact per count)")
    parser.add_argument("--stdlib", type=Path, default=None, help="the corpus's root (default: this Python's stdlib)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the size's; LoRA: a tenth)")
    args = parser.parse_args(argv)
    out = args.out or (COMMITTED_DIR if args.size == "ci" else DEFAULT_OUT.parent / "trained_gpu")
    families = args.families or (list(MODEL_NAMES) if args.size == "ci" else ["gemma4"])
    device = torch.device(args.device or ("cpu" if args.size == "ci" else "cuda"))
    torch.set_num_threads(args.threads)
    split = corpus_files(args.stdlib)
    print(f"corpus: {len(split['train'])} training files, {len(split['held_out'])} held out")
    out.mkdir(parents=True, exist_ok=True)
    size = SIZES[args.size]
    if args.steps is not None:
        size = dataclasses.replace(size, steps=args.steps, lora_steps=max(1, args.steps // 10))
    for family in families:
        build_family(family, args.size, size, split, out, args.seed, device)
    write_demo_prompts(split["held_out"], size.max_function_chars, out / "prompts.jsonl")


if __name__ == "__main__":
    main()
