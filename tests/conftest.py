"""Shared fixtures: the tiny checkpoints (built once per machine) and HF references."""

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts.make_tiny_checkpoints import ensure_tiny_checkpoints

ROOT = Path(__file__).resolve().parents[1]

# Each pytest-xdist worker takes its share of the cores, and so do the processes it starts: torch's
# default (every core in every worker) oversubscribes the cores `make test` runs on.
_THREADS = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
torch.set_num_threads(_THREADS)
os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))

# A CLI run that is over in seconds: one short round on the CPU, small limits, no progress output.
QUICK_CLI_ARGS = [
    "--device", "cpu",
    "--n_prompts", "1",
    "--n_rounds", "1",
    "--max_new_tokens", "4",
    "--max_batch_size", "2",
    "--max_seq_length", "256",
    "--page_size", "16",
    "--quiet",
]  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def unfrozen_heap():
    """A TRL rollout function freezes the heap after the trainer's first step (`gc.freeze()`): what a
    test module left frozen goes back to the garbage collector when it ends."""
    yield
    gc.unfreeze()


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return ensure_tiny_checkpoints()


def load_hf(path, model_class=None, dtype=torch.float32):
    """HF reference model: eager attention, float32 on CPU."""
    from transformers import AutoModelForCausalLM

    model_class = model_class or AutoModelForCausalLM
    return model_class.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()


def hf_greedy(model, prompts, max_new_tokens, end_ids):
    """HF generate, one prompt at a time (no padding), stopping on any of `end_ids`."""
    outputs = []
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=sorted(end_ids) or None,
                pad_token_id=0,
            )
        outputs.append(out[0, len(ids) :].tolist())
    return outputs


def hf_argmax_rollout(model, prompts, max_new_tokens, end_ids):
    """Greedy by hand: full forward each step, argmax of the last logits (no KV cache at all)."""
    outputs = []
    for ids in prompts:
        tokens = list(ids)
        for _ in range(max_new_tokens):
            with torch.no_grad():
                next_id = int(model(torch.tensor([tokens])).logits[0, -1].argmax())
            tokens.append(next_id)
            if next_id in end_ids:
                break
        outputs.append(tokens[len(ids) :])
    return outputs


# The tiny multimodal Gemma-4's ids 5-11 are image/audio/video placeholders, which its HF model
# (Gemma4ForConditionalGeneration) treats as media: prompts for it as a reference start above them.
FIRST_TEXT_ID = 12


def random_prompts(lengths, vocab_size, seed=0, low=3):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def compiled_variants(function) -> int:
    """How many torch.compile'd variants (dynamo cache entries) the function's code has."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(function.__code__))


def compiled_decode_regions() -> dict[str, int]:
    """How many compiled variants each region of the compiled decode step has."""
    from qwen3_flex_inference import ModelRunner, call_layer

    regions = {"prologue": ModelRunner._decode_prologue, "layer": call_layer, "epilogue": ModelRunner._decode_epilogue}
    return {region: compiled_variants(function) for region, function in regions.items()}


# Prefills of three packed lengths in a fresh process: compiled variants other tests left would hide a recompile.
PREFILL_COMPILES = """
import json, sys
import torch
from conftest import load_hf, random_prompts
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch.nn.attention.flex_attention import flex_attention
from qwen3_flex_inference import FlexInference, Sequence

path, device = sys.argv[1], torch.device(sys.argv[2])
hf = load_hf(path).to(device)
engine = FlexInference(load_hf(path).to(device), None, max_batch_size=4, max_seq_length=512, n_pages=64,
                       page_size=16, max_new_tokens=3)
report = []
for seed, lengths in enumerate([[100, 20], [150, 130], [300, 120]]):  # packed rows of 256, 384 and 512 tokens
    prompts = random_prompts(lengths, hf.config.vocab_size, seed=seed)
    got = [s.output_ids for s in engine.generate([Sequence(input_ids=ids) for ids in prompts])]
    want = [hf.generate(torch.tensor([ids], device=device), max_new_tokens=3, do_sample=False, pad_token_id=0,
                        eos_token_id=sorted(engine.end_ids) or None)[0, len(ids):].tolist() for ids in prompts]
    report.append(dict(variants=len(_debug_get_cache_entry_list(flex_attention.__code__)), equal=got == want))
print(json.dumps(report))
"""


def assert_prefill_attention_compiles_once(path, device: str) -> None:
    """Three prefills (packed rows of 256, 384 and 512 tokens) in a process of its own: greedy tokens
    equal HF's after each, and flex_attention has as many compiled variants after the first as after
    the last."""
    result = subprocess.run(
        [sys.executable, "-c", PREFILL_COMPILES, str(path), device],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])},
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert all(step["equal"] for step in report), f"tokens differ from HF: {report}"
    variants = [step["variants"] for step in report]
    assert variants[0] > 0 and len(set(variants)) == 1, f"flex_attention variants after each prefill: {variants}"


def gemm_ops(call) -> set[str]:
    """Which of aten::mm and aten::bmm call() runs (CPU profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        call()
    return {event.key for event in prof.key_averages()} & {"aten::mm", "aten::bmm"}


# The CLIs' bad input: one sentence and a non-zero exit (tests/test_cli.py, tests/test_bad_input.py).


def assert_one_sentence(message, *keywords) -> None:
    assert isinstance(message, str) and message.strip(), f"exit message is not a non-empty str: {message!r}"
    assert "\n" not in message.strip(), f"exit message spans several lines: {message!r}"
    assert "Traceback" not in message, f"exit message holds a traceback: {message!r}"
    for keyword in keywords:
        assert keyword in message, f"{keyword!r} not in exit message {message!r}"


def exit_message(module, argv) -> str:
    """Runs `module.main(argv)` in process; it must exit with a message (exit status 1)."""
    with pytest.raises(SystemExit) as info:
        module.main(argv)
    code = info.value.code
    # A str code makes Python print it to stderr and exit with status 1; None or 0 would be success.
    assert isinstance(code, str), f"main({argv}) exited with {code!r}, not with a message"
    return code


def run_triton_interpreter_check(module: str) -> list[dict]:
    """Runs `python -m module` from the repo root under triton's CPU interpreter (TRITON_INTERPRET=1
    must be set before triton is imported, hence a subprocess) and returns the JSON list it prints
    last (on a fresh clone, building the tiny checkpoints prints a line each before it)."""
    pytest.importorskip("triton", reason="triton is not installed: the kernel test needs its CPU interpreter")
    run = subprocess.run(
        [sys.executable, "-m", module],
        cwd=ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])
