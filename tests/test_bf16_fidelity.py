"""bf16 fidelity: against a float32 reference, the engine's logit error is no larger than
1.2x Hugging Face bf16's own error on the same inputs (CPU, teacher-forced)."""

import pytest
import torch
from conftest import load_hf, random_prompts

from gemma4_flex_inference import FlexGemma4Inference
from qwen3_flex_inference import FlexInference


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("name", ["qwen3", "gemma4_text"])
def test_bf16_logit_error_at_most_1_2x_hf_bf16(tiny_dir, name):
    path = tiny_dir / name
    reference = load_hf(path)
    hf_bf16 = load_hf(path, dtype=torch.bfloat16)
    engine_class = FlexGemma4Inference if name.startswith("gemma4") else FlexInference
    engine = engine_class(
        load_hf(path, dtype=torch.bfloat16), None, max_batch_size=4, max_seq_length=256, n_pages=64, page_size=16
    )
    prompts = random_prompts([30, 90, 120], reference.config.vocab_size, seed=12)
    engine_logits = engine.score(prompts)
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            want = reference(torch.tensor([ids])).logits[0]
            hf_err = relative_error(hf_bf16(torch.tensor([ids])).logits[0], want)
        engine_err = relative_error(engine_logits[i], want)
        assert engine_err <= 1.2 * hf_err, f"prompt {i}: {engine_err=:.3e} {hf_err=:.3e}"
