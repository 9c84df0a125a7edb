"""4-bit weights (bitsandbytes NF4) on the CPU, float32 compute: the engine's greedy tokens equal
HF's own 4-bit model (the same quantised weights: transformers quantises them while loading), with
and without a LoRA adapter, for Qwen3, Llama and Gemma-4 in both checkpoint layouts.

A LoRA adapter on 4-bit weights is applied unmerged (a merge would quantise the delta away): the
reference is PEFT's own 4-bit LoRA layer on HF's model. The engine takes the adapter from that
reference model (as from a trainer's), so a change to it followed by `refresh_lora()` must show in
the engine's tokens, and the 4-bit base must never change.

NOTE: the file's name sorts after the engine tests: their compile-count checks count the compiled
variants they add themselves, and this file's compiled engines would add the decode epilogue they
expect to compile (it is the same for 4-bit weights: the final norm and the float lm_head).
"""

import json

import pytest
import torch
from conftest import FIRST_TEXT_ID, hf_argmax_rollout, random_prompts

import gemma4_flex_inference
import qwen3_flex_inference
from gemma4_flex_inference import FlexGemma4Inference, load_gemma4, load_gemma4_adapter
from qwen3_flex_inference import (
    FlexInference,
    FlexInferenceError,
    Sequence,
    load_peft_adapter,
    load_qwen3_llama,
    sha256_of,
)

pytest.importorskip("bitsandbytes", reason="4-bit weights need bitsandbytes")

MAX_NEW_TOKENS = 12
PROMPT_LENGTHS = [5, 40, 17]
CPU = torch.device("cpu")
MODELS = ["qwen3", "llama", "gemma4", "gemma4_text"]  # gemma4: the multimodal layout


def load_4bit(name: str, path):
    if name.startswith("gemma4"):
        return load_gemma4(str(path), torch.float32, CPU, load_in_4bit=True)
    return load_qwen3_llama(str(path), torch.float32, CPU, load_in_4bit=True)


def hf_4bit(name: str, path):
    """HF's own 4-bit model of the checkpoint (the multimodal class for the multimodal layout)."""
    from transformers import AutoModelForCausalLM, Gemma4ForConditionalGeneration

    model_class = Gemma4ForConditionalGeneration if name == "gemma4" else AutoModelForCausalLM
    model = model_class.from_pretrained(
        path,
        dtype=torch.float32,
        attn_implementation="eager",
        quantization_config=qwen3_flex_inference.nf4_config(torch.float32),
        device_map={"": "cpu"},
    )
    qwen3_flex_inference.fit_bnb_cpu_kernels(model)  # as the engine's loader: the same kernel per linear
    return model.eval()


def engine_class(name: str):
    return FlexGemma4Inference if name.startswith("gemma4") else FlexInference


def make_engine(name: str, model, **options):
    limits = dict(max_batch_size=4, max_seq_length=128, n_pages=64, page_size=16, max_new_tokens=MAX_NEW_TOKENS)
    return engine_class(name)(model, None, **limits, **options)


def engine_tokens(engine, prompts) -> list[list[int]]:
    return [seq.output_ids for seq in engine.generate([Sequence(input_ids=ids) for ids in prompts])]


def quantized_linears(model) -> int:
    from bitsandbytes.nn import Linear4bit

    return sum(isinstance(module, Linear4bit) for module in model.modules())


@pytest.fixture(scope="module", params=MODELS)
def case(request, tiny_dir):
    """HF's 4-bit model with PEFT's LoRA on it (the reference, and the adapter's owner), and an
    engine on a 4-bit copy taking that adapter unmerged; for one layout of each engine (qwen3,
    the multimodal gemma4) that engine runs the compiled decode step."""
    from peft import PeftModel

    name = request.param
    path = tiny_dir / name
    reference = PeftModel.from_pretrained(hf_4bit(name, path), path / "lora").eval()
    base_engine = make_engine(name, load_4bit(name, path))
    lora_engine = make_engine(
        name, load_4bit(name, path), peft_model=reference, compile_decode=name in ("qwen3", "gemma4")
    )
    prompts = random_prompts(PROMPT_LENGTHS, reference.config.get_text_config().vocab_size, seed=5, low=FIRST_TEXT_ID)
    return dict(name=name, path=path, reference=reference, base=base_engine, lora=lora_engine, prompts=prompts)


def reference_tokens(case) -> list[list[int]]:
    return hf_argmax_rollout(case["reference"], case["prompts"], MAX_NEW_TOKENS, case["lora"].end_ids)


def test_loading_in_4bit_quantises_every_decoder_linear_and_keeps_lm_head_and_embeddings(case):
    causal_lm = case["base"].causal_lm
    decoder_linears = [m for m in causal_lm.model.modules() if isinstance(m, torch.nn.Linear)]
    assert quantized_linears(causal_lm) == len(decoder_linears) > 0
    assert causal_lm.lm_head.weight.dtype == causal_lm.model.embed_tokens.weight.dtype == torch.float32
    if causal_lm.config.tie_word_embeddings:
        assert causal_lm.lm_head.weight is causal_lm.model.embed_tokens.weight


def test_greedy_tokens_equal_hf_4bit_without_lora(case):
    with case["reference"].disable_adapter():
        want = hf_argmax_rollout(case["reference"], case["prompts"], MAX_NEW_TOKENS, case["base"].end_ids)
    assert engine_tokens(case["base"], case["prompts"]) == want


def test_greedy_tokens_equal_hf_peft_4bit_with_lora_unmerged(case):
    engine = case["lora"]
    assert not engine.merge_lora and not engine.lora_targets
    want = reference_tokens(case)
    with case["reference"].disable_adapter():
        base = hf_argmax_rollout(case["reference"], case["prompts"], MAX_NEW_TOKENS, engine.end_ids)
    assert want != base, "the adapter changes no token: the test would prove nothing"
    assert engine_tokens(engine, case["prompts"]) == want


@torch.no_grad()
def test_refresh_follows_the_adapter_and_never_writes_the_4bit_base(case):
    engine, reference = case["lora"], case["reference"]
    base_weights = {
        name: module.weight for name, module in engine.causal_lm.named_modules() if hasattr(module, "quant_state")
    }
    base_before = sha256_of(base_weights)
    lora_B = [p for name, p in reference.named_parameters() if "lora_B" in name]
    saved = [p.clone() for p in lora_B]
    generator = torch.Generator().manual_seed(0)
    for p in lora_B:
        p.add_(torch.randn(p.shape, generator=generator) * 0.5)
    engine.refresh_lora()
    assert engine_tokens(engine, case["prompts"]) == reference_tokens(case)
    for p, value in zip(lora_B, saved):
        p.copy_(value)
    engine.refresh_lora()
    assert engine_tokens(engine, case["prompts"]) == reference_tokens(case)
    assert sha256_of(base_weights) == base_before


def test_drift_verification_covers_the_unmerged_path_and_passes(case):
    drift = case["lora"].verify_no_drift(iterations=3)
    assert drift["passed"], drift
    assert "unmerged" in drift["covers"] and "merged double-copy is not in use" in drift["covers"], drift


def test_a_peft_wrapped_4bit_model_serves_as_its_own_adapter(case):
    """The CLI's path: the inference model itself wrapped by PEFT; PEFT's own adapter path is
    replaced by the engine's, not run beside it."""
    if case["name"] not in ("qwen3", "gemma4"):
        pytest.skip("one layout of each engine")
    load_adapter = load_gemma4_adapter if case["name"].startswith("gemma4") else load_peft_adapter
    peft_model = load_adapter(load_4bit(case["name"], case["path"]), str(case["path"] / "lora"))
    engine = make_engine(case["name"], peft_model, peft_model=peft_model)
    assert engine_tokens(engine, case["prompts"]) == reference_tokens(case)


def test_a_prequantized_checkpoint_loads_as_is_with_its_lm_head_tied(tiny_dir, tmp_path):
    """A bitsandbytes 4-bit checkpoint (saved without lm_head: it is tied) loads without
    load_in_4bit, and generates what quantising while loading generates."""
    saved = tmp_path / "gemma4_bnb_4bit"
    hf_4bit("gemma4", tiny_dir / "gemma4").save_pretrained(saved)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        (saved / name).write_bytes((tiny_dir / "gemma4" / name).read_bytes())
    assert json.loads((saved / "config.json").read_text())["quantization_config"]["load_in_4bit"]
    model = load_gemma4(str(saved), torch.float32, CPU)
    assert quantized_linears(model) > 0 and model.lm_head.weight is model.model.embed_tokens.weight
    prompts = random_prompts(PROMPT_LENGTHS, model.config.vocab_size, seed=5)
    want = engine_tokens(make_engine("gemma4", load_4bit("gemma4", tiny_dir / "gemma4")), prompts)
    assert engine_tokens(make_engine("gemma4", model), prompts) == want


def test_fused_projections_and_merging_are_refused_on_4bit_weights_with_one_sentence(tiny_dir):
    from peft import PeftModel

    path = tiny_dir / "qwen3"
    with pytest.raises(FlexInferenceError, match="fuse_projections needs float weights"):
        make_engine("qwen3", load_4bit("qwen3", path), fuse_projections=True)
    peft_model = PeftModel.from_pretrained(hf_4bit("qwen3", path), path / "lora")
    with pytest.raises(FlexInferenceError, match="cannot be merged into 4-bit weights"):
        make_engine("qwen3", load_4bit("qwen3", path), peft_model=peft_model, merge_lora=True)


@pytest.mark.parametrize("module", [qwen3_flex_inference, gemma4_flex_inference], ids=["qwen3", "gemma4"])
def test_cli_load_in_4bit_with_an_adapter_runs_unmerged_and_its_drift_check_says_so(module, tiny_dir, tmp_path):
    model_dir = tiny_dir / ("qwen3" if module is qwen3_flex_inference else "gemma4")
    stats_path = tmp_path / "stats.json"
    module.main(
        [
            "--model_name", str(model_dir), "--device", "cpu", "--load_in_4bit", "--lora_adapter",
            str(model_dir / "lora"), "--verify_no_drift", "--verify_iterations", "2", "--n_prompts", "2",
            "--max_new_tokens", "4", "--max_batch_size", "2", "--max_seq_length", "256", "--n_pages", "64",
            "--page_size", "16", "--quiet", "--stats_path", str(stats_path),
        ]
    )  # fmt: skip
    drift = json.loads(stats_path.read_text())["drift_verification"]
    assert drift["passed"] and "unmerged" in drift["covers"], drift


def test_load_weights_into_a_4bit_weight_is_refused_with_one_sentence(case):
    name, weight = next((n, p) for n, p in case["base"].causal_lm.named_parameters() if not p.is_floating_point())
    with pytest.raises(FlexInferenceError, match=f"^{name} is a 4-bit weight, packed: it takes no new values"):
        case["base"].load_weights({name: torch.zeros(weight.shape)})


def test_a_bitsandbytes_without_kernels_for_the_device_is_one_sentence(tiny_dir, monkeypatch):
    import bitsandbytes.functional

    def no_kernel(*args, **kwargs):
        raise NotImplementedError("no kernel for this backend")

    monkeypatch.setattr(bitsandbytes.functional, "quantize_4bit", no_kernel)
    with pytest.raises(
        FlexInferenceError, match="^4-bit weights need bitsandbytes with 4-bit kernels for cpu: no kernel"
    ):
        load_4bit("qwen3", tiny_dir / "qwen3")
