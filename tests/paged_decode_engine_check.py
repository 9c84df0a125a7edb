"""Run by tests/test_paged_decode_kernel.py in a subprocess with TRITON_INTERPRET=1: the engine's
eager decode with its decode attention switched to the Triton paged kernel (which the engine
takes only on CUDA; here triton's interpreter runs it on CPU tensors), against HF's greedy tokens
on tiny Qwen3 and Gemma-4 (KV-shared layers of both types, a 24-token window that prompts and
generations run past, so sliding pages are recycled; more prompts than batch slots).

    TRITON_INTERPRET=1 python -m tests.paged_decode_engine_check   # from the repo root

Prints one JSON list: per checkpoint and prompt, whether the tokens equal HF's, both, and how
many times the Triton kernel ran for that checkpoint.
"""

import json

import torch

import qwen3_flex_inference
from gemma4_flex_inference import FlexGemma4Inference
from qwen3_flex_inference import FlexInference, Sequence
from scripts.make_tiny_checkpoints import ensure_tiny_checkpoints
from tests.conftest import hf_argmax_rollout, load_hf, random_prompts
from tests.skinny_kernel_check import interpret_without_overflow_checks

MAX_NEW_TOKENS = 6  # past the window with the longer prompts; the interpreter runs every decode step slowly
PROMPT_LENGTHS = [5, 40, 17, 33, 3]


def main() -> None:
    # Two splits a row (the combine kernel runs too) instead of the 16 a GPU's SM count would give
    # these rows: the interpreter runs every program in turn.
    interpret_without_overflow_checks()
    qwen3_flex_inference.paged_decode_splits = lambda num_rows, num_kv_heads, device: 2
    kernel = qwen3_flex_inference.paged_decode_attention_triton
    num_calls = 0

    def counted_kernel(*args, **kwargs):
        nonlocal num_calls
        num_calls += 1
        return kernel(*args, **kwargs)

    qwen3_flex_inference.paged_decode_attention_triton = counted_kernel
    tiny_dir = ensure_tiny_checkpoints()
    results = []
    for name, engine_class in (("qwen3", FlexInference), ("gemma4_text", FlexGemma4Inference)):
        hf = load_hf(tiny_dir / name)
        engine = engine_class(
            load_hf(tiny_dir / name), None, max_batch_size=4, max_seq_length=128, n_pages=32, page_size=16,
            max_new_tokens=MAX_NEW_TOKENS,
        )  # fmt: skip
        engine.runner.decode_attention = "triton"  # the CUDA default's kernel, here in the interpreter
        prompts = random_prompts(PROMPT_LENGTHS, hf.config.vocab_size, seed=11)
        num_calls = 0
        want = hf_argmax_rollout(hf, prompts, MAX_NEW_TOKENS, engine.end_ids)
        with torch.no_grad():
            got = [seq.output_ids for seq in engine.generate([Sequence(input_ids=ids) for ids in prompts])]
        for i, (g, w) in enumerate(zip(got, want)):
            results.append(
                {"checkpoint": name, "prompt": i, "equal": g == w, "got": g, "want": w, "num_calls": num_calls}
            )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
