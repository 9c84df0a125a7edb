"""LoRA double-copy on the base engine: merged from pristine weights, refreshed in place, no drift."""

import pytest
import torch
from conftest import hf_greedy, load_hf, random_prompts
from peft import PeftModel

from qwen3_flex_inference import (
    FlexInference,
    ModelPatches,
    Sequence,
    lora_layers,
    refresh_lora_merge_from_pristine,
    run_drift_verification,
    sha256_of,
)

MAX_NEW_TOKENS = 16


def make_engine(model, **overrides):
    limits = dict(max_batch_size=4, max_seq_length=256, n_pages=64, page_size=16, max_new_tokens=MAX_NEW_TOKENS)
    return FlexInference(model, None, **{**limits, **overrides})


@pytest.fixture(scope="module")
def setup(tiny_dir):
    path = tiny_dir / "qwen3"
    peft_model = PeftModel.from_pretrained(load_hf(path), path / "lora")
    engine = make_engine(peft_model, peft_model=peft_model)
    prompts = random_prompts([6, 40, 23], peft_model.config.vocab_size, seed=5)
    return dict(path=path, peft_model=peft_model, engine=engine, prompts=prompts)


def hf_peft_merged_tokens(setup, adapter_state=None):
    """Reference: a fresh HF model + the adapter (optionally with other LoRA weights), PEFT-merged."""
    reference = PeftModel.from_pretrained(load_hf(setup["path"]), setup["path"] / "lora")
    if adapter_state is not None:
        reference.load_state_dict(adapter_state, strict=False)
    merged = reference.merge_and_unload()
    return hf_greedy(merged, setup["prompts"], MAX_NEW_TOKENS, setup["engine"].end_ids)


def engine_tokens(setup):
    return [s.output_ids for s in setup["engine"].generate([Sequence(input_ids=ids) for ids in setup["prompts"]])]


def test_engine_with_adapter_equals_hf_peft_merged(setup):
    want = hf_peft_merged_tokens(setup)
    base = hf_greedy(load_hf(setup["path"]), setup["prompts"], MAX_NEW_TOKENS, setup["engine"].end_ids)
    assert want != base, "the adapter does not change the output: the test would prove nothing"
    assert engine_tokens(setup) == want


def test_refresh_after_adapter_change_follows_and_keeps_pristine_weights(setup):
    engine, peft_model = setup["engine"], setup["peft_model"]
    pristine_hash = sha256_of(engine.pristine_lora_weights)
    storage_before = {name: w.data_ptr() for name, w in engine.lora_targets.items()}
    original = {k: v.clone() for k, v in peft_model.state_dict().items() if "lora_" in k}
    try:
        with torch.no_grad():
            for layer in lora_layers(peft_model).values():
                layer.lora_B["default"].weight.mul_(-1.5)
        changed = {k: v.clone() for k, v in peft_model.state_dict().items() if "lora_" in k}
        engine.refresh_lora()
        want = hf_peft_merged_tokens(setup, changed)
        assert engine_tokens(setup) == want
    finally:
        peft_model.load_state_dict(original, strict=False)
        engine.refresh_lora()
    assert sha256_of(engine.pristine_lora_weights) == pristine_hash, "the pristine weights changed"
    assert {name: w.data_ptr() for name, w in engine.lora_targets.items()} == storage_before, (
        "refresh reallocated weights"
    )
    assert engine_tokens(setup) == hf_peft_merged_tokens(setup)


def test_pristine_copies_hold_only_the_lora_target_weights(setup):
    engine = setup["engine"]
    target_bytes = sum(w.numel() * w.element_size() for w in engine.lora_targets.values())
    pristine_bytes = sum(w.numel() * w.element_size() for w in engine.pristine_lora_weights.values())
    model_bytes = sum(p.numel() * p.element_size() for p in engine.causal_lm.parameters())
    assert pristine_bytes == target_bytes < model_bytes
    assert set(engine.pristine_lora_weights) == {
        n.removeprefix("base_model.model.") for n in lora_layers(setup["peft_model"])
    }


def test_drift_verification_passes(setup):
    engine = setup["engine"]
    result = engine.verify_no_drift(iterations=4)
    assert result["passed"] and "merged double-copy" in result["covers"], result
    assert result["iterations"] == 4 and len(set(result["merged_sha256_per_iteration"])) == 4
    assert engine_tokens(setup) == hf_peft_merged_tokens(setup)


def test_drift_verification_fails_when_a_refresh_touches_the_pristine_weights(setup):
    engine = setup["engine"]
    pristine = {name: w.clone() for name, w in engine.pristine_lora_weights.items()}
    name = next(iter(pristine))

    def drifting_refresh():
        refresh_lora_merge_from_pristine(engine.lora_targets, pristine, setup["peft_model"])
        pristine[name].add_(1e-3)  # what an unmerge-based refresh does to the base, in effect

    result = run_drift_verification(engine.lora_targets, pristine, setup["peft_model"], drifting_refresh, iterations=2)
    engine.refresh_lora()
    assert not result["passed"] and not result["pristine_unchanged"], result


def test_peft_merge_unmerge_cycle_drifts_in_bf16(tiny_dir):
    """The failure the double-copy avoids: PEFT's merge/unmerge in bf16 does not return the base."""
    path = tiny_dir / "qwen3"
    peft_model = PeftModel.from_pretrained(load_hf(path, dtype=torch.bfloat16), path / "lora")
    base = {n: layer.base_layer.weight for n, layer in lora_layers(peft_model).items()}
    before = sha256_of(base)
    for _ in range(5):
        peft_model.merge_adapter()
        peft_model.unmerge_adapter()
    assert sha256_of(base) != before, "PEFT's bf16 merge/unmerge cycle did not drift"


def test_unmerged_peft_wrapper_matches_merged_engine(setup, tiny_dir):
    path = setup["path"]
    unmerged = PeftModel.from_pretrained(load_hf(path), path / "lora")
    engine = make_engine(unmerged)
    got = [s.output_ids for s in engine.generate([Sequence(input_ids=ids) for ids in setup["prompts"]])]
    assert not any(layer.merged for layer in lora_layers(unmerged).values())
    assert got == hf_peft_merged_tokens(setup)


@pytest.mark.parametrize("merge_lora", [None, False], ids=["merged", "unmerged"])
def test_fused_projections_keep_the_lora_refresh_in_place(setup, merge_lora):
    """With q/k/v and gate/up fused, the refresh writes through the views into the fused weights; an
    unmerged adapter's copies of A and B ride in the fused GEMMs and take the refresh the same way."""
    path = setup["path"]
    peft_model = PeftModel.from_pretrained(load_hf(path), path / "lora")
    engine = make_engine(peft_model, peft_model=peft_model, fuse_projections=True, merge_lora=merge_lora)
    assert engine.merge_lora == (merge_lora is None)
    assert bool(engine.runner.fused_lora_weights) == (merge_lora is False), (
        "the unmerged adapter is not in the fused GEMMs"
    )
    tokens = [s.output_ids for s in engine.generate([Sequence(input_ids=ids) for ids in setup["prompts"]])]
    assert tokens == hf_peft_merged_tokens(setup)
    with torch.no_grad():
        for layer in lora_layers(peft_model).values():
            layer.lora_B["default"].weight.mul_(-1.5)
    changed = {k: v.clone() for k, v in peft_model.state_dict().items() if "lora_" in k}
    engine.refresh_lora()
    tokens = [s.output_ids for s in engine.generate([Sequence(input_ids=ids) for ids in setup["prompts"]])]
    assert tokens == hf_peft_merged_tokens(setup, changed)


def test_a_patched_forwards_attributes_exist_only_while_installed_and_survive_a_wrapping_patch():
    """The unmerged adapter's forward reads its weights from `flex_*` attributes of its module: they
    are set with the forward, removed with it, and kept when a later patch wraps that forward."""
    linear = torch.nn.Linear(4, 3, bias=False)
    patches = ModelPatches()

    def scaled(module, x):
        return module.flex_test_base(x) * module.flex_test_scale

    patches.replace_forward(
        linear, scaled.__get__(linear), flex_test_base=patches.forward_of(linear), flex_test_scale=2.0
    )
    inner = patches.forward_of(linear)

    def negated(module, x):
        return -inner(x)

    patches.replace_forward(linear, negated.__get__(linear))
    x = torch.randn(2, 4)
    want = torch.nn.functional.linear(x, linear.weight)
    with patches.installed():
        got = linear(x)
    assert torch.equal(got, -2.0 * want), f"{got=} {want=}"
    assert torch.equal(linear(x), want)
    left = [key for key in linear.__dict__ if key == "forward" or key.startswith("flex_")]
    assert not left, f"patch state left on the module: {left}"
