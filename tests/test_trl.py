"""TRL's GRPOTrainer with its rollouts on the engine (`make_trl_rollout_func`): real TRL, two GRPO
steps with a LoRA adapter on the trained CI-size Qwen3 and multimodal Gemma-4 (as `load_gemma4`
loads it; scripts/train_checkpoints.py: realistic, low-entropy distributions, prompts from the
Python task), float32 on the CPU; QLoRA, full fine-tuning and refusals on the tiny random Qwen3.

NOTE: TRL 1.16 logs `sampling/sampling_logp_difference/mean` only on its vLLM path
(`use_vllm=True`), which needs vLLM and a GPU. The test computes that metric as TRL does, on the
same tokens: the trainer's own per-token log-probs (`_get_per_token_logps_and_entropies`, the call
TRL makes for it) against the engine's, mean |difference| over the completion tokens.
"""

import gc
import math

import pytest
import torch
from conftest import hf_greedy
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from gemma4_flex_inference import FlexGemma4Inference, load_gemma4
from qwen3_flex_inference import (
    FlexInference,
    FlexInferenceError,
    SamplingParams,
    lora_layers,
    make_trl_rollout_func,
    sha256_of,
)
from scripts.grpo_trl import python_prompts, sampling_logp_difference
from scripts.train_checkpoints import ensure_trained_checkpoints

pytest.importorskip("trl", reason="requirements.txt installs trl on Python >= 3.11 only")
pytestmark = pytest.mark.filterwarnings("ignore:You are using 'rollout_func'")

NUM_GENERATIONS = 2
MAX_COMPLETION_LENGTH = 12
GREEDY_TOKENS = 16
QUESTIONS = ["What is 6 times 7?", "Name a prime number.", "Count to five.", "Say hello twice."]


def load_model(name: str, path):
    if name == "gemma4":
        return load_gemma4(str(path), torch.float32, torch.device("cpu"))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")


def distinct_characters(completions, **kwargs) -> list[float]:
    """A toy reward that differs between completions."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(len(set(text))) for text in texts]


class RecordingRollout:
    """The engine's rollout_func as TRL calls it, recording what the tests check at each call: TRL's
    own prompt ids, TRL's log-probs of the returned tokens, and after the second weight sync the
    greedy tokens of the engine, of HF + PEFT with the trainer's adapter, and of the bare base."""

    def __init__(self, engine):
        self.engine = engine
        self.rollout_func = make_trl_rollout_func(engine)
        self.calls = []

    def __call__(self, prompts, trainer):
        output = self.rollout_func(prompts, trainer)
        call = dict(
            step=trainer.state.global_step,
            frozen_objects=gc.get_freeze_count(),
            prompts=prompts,
            output=output,
            trl_prompt_ids=trainer._tokenize_prompts(prompts)[0],
            logprob_differences=sampling_logp_difference(
                trainer, output["prompt_ids"], output["completion_ids"], output["logprobs"]
            ),
        )
        if len(self.calls) == 1:  # the second sync: the engine holds the adapter after one optimizer step
            unique_ids = [list(ids) for ids in dict.fromkeys(tuple(ids) for ids in output["prompt_ids"])]
            greedy = SamplingParams(temperature=0.0, max_new_tokens=GREEDY_TOKENS)
            call["engine_greedy"] = [group[0].output_ids for group in self.engine.rollouts(unique_ids, greedy)]
            call["hf_peft_greedy"] = hf_greedy(trainer.model, unique_ids, GREEDY_TOKENS, self.engine.end_ids)
            with trainer.model.disable_adapter():
                call["base_greedy"] = hf_greedy(trainer.model, unique_ids, GREEDY_TOKENS, self.engine.end_ids)
            call["adapter_logit_change"] = adapter_logit_change(trainer.model, unique_ids[0])
        self.calls.append(call)
        return output


def adapter_logit_change(peft_model, input_ids: list[int]) -> float:
    """The largest change the adapter makes to the model's logits on one prompt."""
    ids = torch.tensor([input_ids], device=peft_model.device)
    with torch.no_grad():
        adapted = peft_model(input_ids=ids).logits
        with peft_model.disable_adapter():
            base = peft_model(input_ids=ids).logits
    return (adapted - base).abs().max().item()


def grpo_trainer(model, tokenizer, rollout_func, prompts, output_dir, max_steps=2, peft_config=None):
    """TRL's GRPOTrainer in float32 on the CPU, 2 prompts x NUM_GENERATIONS completions a step."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(output_dir),
        max_steps=max_steps,
        per_device_train_batch_size=2 * NUM_GENERATIONS,
        num_generations=NUM_GENERATIONS,
        max_completion_length=MAX_COMPLETION_LENGTH,
        learning_rate=0.05,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,  # TRL's default is bf16 autocast; these tests train in float32
        gradient_checkpointing=False,
        disable_tqdm=True,
        seed=0,
    )
    return GRPOTrainer(
        model=model,
        reward_funcs=distinct_characters,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        rollout_func=rollout_func,
        peft_config=peft_config,
    )


def make_engine(name: str, path, tokenizer, **kwargs) -> FlexInference:
    engine_class = FlexGemma4Inference if name == "gemma4" else FlexInference
    limits = dict(max_batch_size=8, max_seq_length=128, n_pages=64, page_size=16) | kwargs
    return engine_class(load_model(name, path), tokenizer, **limits)  # on its own inference copy


@pytest.fixture(scope="module", params=["qwen3", "gemma4"])
def run(request, tmp_path_factory):
    """Two GRPO steps of TRL with the engine's rollouts on a trained checkpoint; Qwen3 with text
    prompts (function headers) on an inference copy of its own, Gemma-4 with chats in zero copy (the
    engine runs the trainer's own PEFT model) with fused projections (the adapter copied in at each call)."""
    name, path = request.param, ensure_trained_checkpoints() / request.param
    tokenizer = AutoTokenizer.from_pretrained(path)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"])
    policy = get_peft_model(load_model(name, path), lora)  # the trainer's model
    # scripts/grpo_trl.py's limits on the CPU: the trained Qwen3's kernels, compiled for tests/test_learning.py, serve
    limits = dict(max_batch_size=64, max_seq_length=1024, n_pages=None, page_size=16, peft_model=policy)
    if name == "gemma4":
        engine = FlexGemma4Inference(policy, tokenizer, fuse_projections=True, **limits)
    else:
        engine = make_engine(name, path, tokenizer, base_model=policy, **limits)
    chats = python_prompts()[:4]
    prompts = chats if name == "gemma4" else [chat[0]["content"] for chat in chats]
    rollout = RecordingRollout(engine)
    trainer = grpo_trainer(policy, tokenizer, rollout, prompts, tmp_path_factory.mktemp(f"grpo_{name}"))
    adapter_before = {k: v.detach().clone() for k, v in policy.named_parameters() if "lora_" in k}
    pristine_before = sha256_of(engine.pristine_lora_weights)
    base_before = sha256_of({name: layer.base_layer.weight for name, layer in lora_layers(policy).items()})
    trainer.train()
    return dict(
        name=name,
        frozen_after_training=gc.get_freeze_count(),
        trainer=trainer,
        engine=engine,
        policy=policy,
        prompts=prompts,
        calls=rollout.calls,
        adapter_before=adapter_before,
        pristine_before=pristine_before,
        base_before=base_before,
    )


def test_two_grpo_steps_on_engine_rollouts_give_a_finite_loss_and_train_the_adapter(run):
    losses = [entry["loss"] for entry in run["trainer"].state.log_history if "loss" in entry]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses), f"{run['name']}: {losses=}"
    changed = [
        k for k, v in run["policy"].named_parameters() if "lora_" in k and not torch.equal(v, run["adapter_before"][k])
    ]
    assert changed, f"{run['name']}: no LoRA weight changed"
    assert [call["step"] for call in run["calls"]] == [0, 1], f"{run['name']}: {[c['step'] for c in run['calls']]=}"


def test_the_rollout_function_freezes_the_heap_from_the_first_step_to_the_end_of_training(run):
    """At the second weight sync, what the first step left alive (models, compiled code, the trainer)
    is frozen out of the collector's full collections, until training ends."""
    first, second = (call["frozen_objects"] for call in run["calls"])
    assert second > first + 10_000, f"{run['name']}: {first=} {second=} objects frozen"
    # training's end gives them back: a later run's deleted models are collected
    assert run["frozen_after_training"] == 0, f"{run['name']}: {run['frozen_after_training']} objects still frozen"


def test_rollouts_return_num_generations_completions_per_prompt_in_trls_order(run):
    for call in run["calls"]:
        output, num_entries = call["output"], len(call["prompts"])
        assert num_entries == 2 * NUM_GENERATIONS, f"TRL passed {num_entries} prompts"
        assert all(len(output[key]) == num_entries for key in ("prompt_ids", "completion_ids", "logprobs"))
        assert output["prompt_ids"] == [list(ids) for ids in call["trl_prompt_ids"]], "not the prompt ids TRL builds"
        for completion, logprobs in zip(output["completion_ids"], output["logprobs"]):
            assert 1 <= len(completion) == len(logprobs) <= MAX_COMPLETION_LENGTH


def test_engine_log_probs_match_the_trainers_own(run):
    differences = torch.cat([call["logprob_differences"] for call in run["calls"]])
    mean, worst = differences.mean().item(), differences.max().item()
    print(f"{run['name']}: sampling_logp_difference mean {mean:.3g} max {worst:.3g} over {differences.numel()} tokens")
    assert mean < 2e-6 and worst < 5e-5, f"{run['name']}: {mean=} {worst=}"


def test_engine_after_the_second_sync_equals_hf_peft_with_the_trainers_adapter(run):
    call = run["calls"][1]
    assert call["engine_greedy"] == call["hf_peft_greedy"], (
        f"{run['name']}: {call['engine_greedy']=} {call['hf_peft_greedy']=}"
    )
    # A trained model's greedy tokens may survive one optimizer step; its logits do not.
    assert call["adapter_logit_change"] > 1e-2, f"{run['name']}: the adapter barely changes the logits: {call=}"


def test_the_pristine_base_is_the_trainers_frozen_base_and_stays_bit_equal(run):
    engine = run["engine"]
    base_weights = {name: layer.base_layer.weight for name, layer in lora_layers(run["policy"]).items()}
    if engine.is_zero_copy:  # no pristine copy: the engine reads the trainer's base (and adapter) themselves
        trainer_storage = {p.data_ptr() for p in run["policy"].parameters()}
        assert all(p.data_ptr() in trainer_storage for p in engine.causal_lm.parameters())
        is_shared = [
            a.data_ptr() in trainer_storage and b.data_ptr() in trainer_storage
            for a, b in engine.unmerged_lora.values()
        ]
        assert all(is_shared) if engine.is_live_adapter else not any(is_shared)
        assert sha256_of(base_weights) == run["base_before"], f"{run['name']}: the base changed"
        return
    assert all(engine.pristine_lora_weights[name].data_ptr() == w.data_ptr() for name, w in base_weights.items())
    assert sha256_of(engine.pristine_lora_weights) == run["pristine_before"], f"{run['name']}: the base changed"


def test_entries_of_a_prompt_group_cut_by_the_process_slice_get_one_completion_each(run):
    """With several processes TRL's slice may start or end inside a prompt group (the rollout
    function's grouping, the same for every model: Qwen3's run only)."""
    if run["name"] != "qwen3":
        pytest.skip("the grouping does not depend on the model")
    trainer, prompts = run["trainer"], [run["prompts"][0], run["prompts"][1], run["prompts"][1]]
    output = make_trl_rollout_func(run["engine"])(prompts, trainer)
    assert output["prompt_ids"] == [list(ids) for ids in trainer._tokenize_prompts(prompts)[0]]
    assert len(output["completion_ids"]) == len(output["logprobs"]) == 3


def test_eval_mode_draws_num_generations_eval_completions_per_prompt(run):
    if run["name"] != "qwen3":
        pytest.skip("num_generations_eval does not depend on the model: Qwen3's run only")
    trainer, num_generations_eval = run["trainer"], 3
    trainer.num_generations_eval, is_training = num_generations_eval, trainer.model.training
    trainer.model.eval()
    try:
        output = make_trl_rollout_func(run["engine"])([run["prompts"][0]] * num_generations_eval, trainer)
    finally:
        trainer.model.train(is_training)
        trainer.num_generations_eval = NUM_GENERATIONS
    assert len(output["completion_ids"]) == num_generations_eval and len(set(map(tuple, output["prompt_ids"]))) == 1
    assert len(set(map(tuple, output["completion_ids"]))) > 1, "the eval completions are all the same draw"


def test_qlora_grpo_steps_on_a_4bit_engine_follow_the_trainers_adapter(tiny_dir, tmp_path):
    """QLoRA in zero copy: the engine runs the trainer's own 4-bit PEFT model, the adapter applied
    unmerged from the trainer's A and B (which TRL casts to bf16, QLoRA's recipe: the engine computes
    the adapter's branch in their dtype, as PEFT does)."""
    pytest.importorskip("bitsandbytes")
    from qwen3_flex_inference import load_qwen3_llama

    path = tiny_dir / "qwen3"
    tokenizer = AutoTokenizer.from_pretrained(path)

    def load_4bit():
        return load_qwen3_llama(str(path), torch.float32, torch.device("cpu"), load_in_4bit=True)

    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"])
    policy = get_peft_model(load_4bit(), lora)
    limits = dict(max_batch_size=8, max_seq_length=128, n_pages=64, page_size=16)
    engine = FlexInference(policy, tokenizer, peft_model=policy, **limits)
    assert engine.is_zero_copy and not engine.merge_lora
    quantized = {name: p for name, p in engine.causal_lm.named_parameters() if not p.is_floating_point()}
    base_before = sha256_of(quantized)
    rollout = RecordingRollout(engine)
    trainer = grpo_trainer(policy, tokenizer, rollout, QUESTIONS, tmp_path)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses), losses
    first, second = rollout.calls
    assert first["logprob_differences"].mean() < 1e-4  # the adapter's B starts at zero
    assert second["logprob_differences"].mean() < 2e-3, second["logprob_differences"].mean()
    assert second["engine_greedy"] == second["hf_peft_greedy"] != second["base_greedy"]
    assert sha256_of(quantized) == base_before, "the engine wrote its 4-bit base"


def test_full_fine_tuning_in_zero_copy_samples_from_the_stepped_weights(tiny_dir, tmp_path):
    """The engine on the trainer's own model (no adapter): the optimizer's in-place steps are what it
    samples from, with no sync."""
    path = tiny_dir / "qwen3"
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = load_model("qwen3", path)
    engine = FlexInference(model, tokenizer, max_batch_size=8, max_seq_length=128, n_pages=64, page_size=16)
    weights_before = sha256_of(dict(model.named_parameters()))
    trainer = grpo_trainer(model, tokenizer, make_trl_rollout_func(engine), QUESTIONS, tmp_path, max_steps=1)
    trainer.train()
    assert sha256_of(dict(model.named_parameters())) != weights_before, "the optimizer step changed no weight"
    prompt_ids = [tokenizer(question)["input_ids"] for question in QUESTIONS[:2]]
    greedy = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS)
    engine_tokens = [seq.output_ids for seq in engine.generate(prompt_ids, greedy)]
    assert engine_tokens == hf_greedy(model, prompt_ids, GREEDY_TOKENS, engine.end_ids)


def test_full_fine_tuning_syncs_every_weight_through_load_weights(tiny_dir, tmp_path):
    path = tiny_dir / "qwen3"
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = load_model("qwen3", path)  # trained in full, no adapter
    engine = make_engine("qwen3", path, tokenizer)
    rollout_func = make_trl_rollout_func(engine)
    trainer = grpo_trainer(model, tokenizer, rollout_func, QUESTIONS, tmp_path, max_steps=1)
    trainer.train()
    inference_weights = dict(engine.causal_lm.named_parameters())
    stale = [name for name, p in model.named_parameters() if not torch.equal(p, inference_weights[name])]
    assert stale, "the optimizer step changed no weight: the sync would prove nothing"
    rollout_func([QUESTIONS[0]] * NUM_GENERATIONS, trainer)  # a new step: syncs first
    stale = [name for name, p in model.named_parameters() if not torch.equal(p, inference_weights[name])]
    assert not stale, f"weights not synced: {stale[:3]}"


def test_an_adapter_that_trl_wraps_itself_is_refused_with_one_sentence(tiny_dir, tmp_path):
    path = tiny_dir / "qwen3"
    tokenizer = AutoTokenizer.from_pretrained(path)
    rollout_func = make_trl_rollout_func(make_engine("qwen3", path, tokenizer))
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj"])
    trainer = grpo_trainer(load_model("qwen3", path), tokenizer, rollout_func, QUESTIONS, tmp_path, peft_config=lora)
    with pytest.raises(FlexInferenceError, match="wrap the model with get_peft_model yourself"):
        rollout_func([QUESTIONS[0]] * NUM_GENERATIONS, trainer)
