"""TRL's importance-sampling correction on the engine's rollouts (`sampler_corrected`): real TRL, two
GRPO steps with a LoRA adapter on the tiny Qwen3, float32 on the CPU, then single generations in
each of TRL's four modes with the sampler's log-probs moved by known amounts.

The reference is TRL 1.16's own formula (its vLLM path in `_generate_and_score_completions`),
written out again here, and TRL's own ratio-weighted loss (`_compute_loss` with `use_vllm=True`
and `importance_sampling_ratio` in the batch, the only two things that branch reads).
"""

import contextlib
import math
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, assert_one_sentence
from peft import LoraConfig, get_peft_model
from test_trl import NUM_GENERATIONS, QUESTIONS, distinct_characters, grpo_trainer, load_model, make_engine
from transformers import AutoTokenizer

from qwen3_flex_inference import FlexInferenceError, make_trl_rollout_func, sampler_corrected

trl = pytest.importorskip("trl", reason="requirements.txt installs trl on Python >= 3.11 only")
pytestmark = pytest.mark.filterwarnings("ignore:You are using 'rollout_func'")

CLIP_MIN, CLIP_MAX = 0.5, 2.0
MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# One generation batch: two prompts, NUM_GENERATIONS completions each, as TRL's sampler orders them.
GENERATION_INPUTS = [{"prompt": q} for q in QUESTIONS[:2] for _ in range(NUM_GENERATIONS)]
# Advantages set in place of TRL's for the mode runs: non-zero, both signs, so the ratio shows in each row.
KNOWN_ADVANTAGES = torch.tensor([1.0, -1.0, 2.0, -0.5])
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo")


class RecordingTrainer(trl.GRPOTrainer):
    """TRL's GRPOTrainer that records each generation batch as TRL builds it (before the correction)
    and, when `known_advantages` is set, puts those in place of TRL's advantages."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trl_outputs = []
        self.known_advantages = None

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.known_advantages is not None:
            output["advantages"] = self.known_advantages.clone()
        self.trl_outputs.append(dict(output))  # a shallow copy: the correction replaces values, not tensors' data
        return output


def shift_sampler_logprobs(output: dict) -> dict:
    """The rollout with its sampler log-probs moved by known amounts (trainer - sampler grows by the
    negated shift), and the last token of the third completion marked as an environment token."""
    logprobs = [list(row) for row in output["logprobs"]]
    assert len(logprobs) == 4 and all(len(row) >= 2 for row in logprobs), [len(row) for row in logprobs]
    logprobs[0] = [x - 0.25 for x in logprobs[0]]  # each token's ratio exp(0.25); its sequence's exp(0.25 L)
    logprobs[1][0] += 1.0  # ratio exp(-1), below CLIP_MIN
    logprobs[2][0] -= 1.0  # ratio exp(1), above CLIP_MAX
    logprobs[2][-1] += 5.0  # an environment token: outside the mask, so no effect
    logprobs[3][0] = None  # a log-prob the sampler could not give: ratio 1
    env_mask = [[1] * len(row) for row in logprobs]
    env_mask[2][-1] = 0
    return {**output, "logprobs": logprobs, "env_mask": env_mask}


class ShiftedRollout:
    """The engine's rollout_func; with `is_shifted`, its log-probs go through `shift_sampler_logprobs`."""

    def __init__(self, engine):
        self.rollout_func = make_trl_rollout_func(engine)
        self.is_shifted = False
        self.outputs = []

    def __call__(self, prompts, trainer):
        output = self.rollout_func(prompts, trainer)
        if self.is_shifted:
            output = shift_sampler_logprobs(output)
        self.outputs.append(output)
        return output


@contextlib.contextmanager
def trainer_attributes(trainer, **values):
    """Sets the trainer's attributes (TRL reads its config from them) and restores them."""
    before = {name: getattr(trainer, name) for name in values}
    for name, value in values.items():
        setattr(trainer, name, value)
    try:
        yield trainer
    finally:
        for name, value in before.items():
            setattr(trainer, name, value)


def trl_importance_ratio(trainer_logps, sampler_rows, completion_mask, env_mask_rows, mode):
    """TRL 1.16's ratio (grpo_trainer.py, its vLLM path), from the sampler's log-prob lists as returned."""
    sampler_logps = torch.zeros_like(trainer_logps)
    env_mask = torch.ones_like(completion_mask)
    for row, (logps, env) in enumerate(zip(sampler_rows, env_mask_rows)):
        sampler_logps[row, : len(logps)] = torch.tensor([math.nan if x is None else x for x in logps])
        env_mask[row, : len(env)] = torch.tensor(env)
    difference = torch.nan_to_num((trainer_logps - sampler_logps) * (completion_mask * env_mask), nan=0.0)
    if mode.startswith("sequence"):
        difference = difference.sum(-1, keepdim=True)
    ratio = difference.exp()
    if mode.endswith("truncate"):
        return ratio.clamp(CLIP_MIN, CLIP_MAX), ratio
    return ratio.masked_fill((ratio < CLIP_MIN) | (ratio > CLIP_MAX), 0.0), ratio


@pytest.fixture(scope="module")
def run(tiny_dir, tmp_path_factory):
    """Two GRPO steps of the corrected trainer on the engine's float32 rollouts (TRL's default mode,
    sequence_mask), then one generation batch per mode with the sampler's log-probs shifted."""
    path = tiny_dir / "qwen3"
    tokenizer = AutoTokenizer.from_pretrained(path)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"])
    policy = get_peft_model(load_model("qwen3", path), lora)
    rollout = ShiftedRollout(make_engine("qwen3", path, tokenizer, peft_model=policy, base_model=policy))
    with pytest.MonkeyPatch.context() as patch:  # test_trl's grpo_trainer builds trl.GRPOTrainer
        patch.setattr(trl, "GRPOTrainer", sampler_corrected(RecordingTrainer))
        trainer = grpo_trainer(policy, tokenizer, rollout, QUESTIONS, tmp_path_factory.mktemp("grpo_corrected"))
    trainer.train()
    trainer.model.train()
    modes = {}
    with trainer_attributes(
        trainer,
        known_advantages=KNOWN_ADVANTAGES,
        vllm_importance_sampling_clip_min=CLIP_MIN,
        vllm_importance_sampling_clip_max=CLIP_MAX,
    ):
        rollout.is_shifted = True
        try:
            for mode in MODES:
                with trainer_attributes(trainer, vllm_importance_sampling_mode=mode):
                    corrected = trainer._generate_and_score_completions(GENERATION_INPUTS)
                metrics = {key: values[-1] for key, values in trainer._metrics["train"].items() if "sampling/" in key}
                modes[mode] = dict(
                    trl=trainer.trl_outputs[-1], corrected=corrected, rollout=rollout.outputs[-1], metrics=metrics
                )
        finally:
            rollout.is_shifted = False
    return dict(trainer=trainer, rollout=rollout, modes=modes)


def test_engine_rollouts_give_a_sampler_difference_below_1e4_and_ratios_of_one(run):
    trainer = run["trainer"]
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2 and all(math.isfinite(entry["loss"]) for entry in logs), logs
    assert trainer.vllm_importance_sampling_mode == "sequence_mask"  # TRL's default
    for step, entry in enumerate(logs):
        mean, worst = entry["sampling/sampling_logp_difference/mean"], entry["sampling/sampling_logp_difference/max"]
        ratios = [entry[f"sampling/importance_sampling_ratio/{stat}"] for stat in ("min", "mean", "max")]
        print(f"step {step}: sampling_logp_difference mean {mean:.3g} max {worst:.3g}, ratio min/mean/max {ratios}")
        assert 0 <= mean < 1e-4 and mean <= worst, f"{step=} {mean=} {worst=}"
        assert all(abs(ratio - 1) < 1e-3 for ratio in ratios), f"{step=} {ratios=}"


@pytest.mark.parametrize("mode", MODES)
def test_the_applied_ratio_is_trls_formula_on_the_shifted_sampler_log_probs(run, mode):
    record = run["modes"][mode]
    trl_output, corrected, rollout = record["trl"], record["corrected"], record["rollout"]
    assert "old_per_token_logps" not in trl_output, "TRL computed them itself: the extra forward went untested"
    trainer_logps = corrected["old_per_token_logps"]
    completion_mask = corrected["completion_mask"]
    want, unclipped = trl_importance_ratio(
        trainer_logps, rollout["logprobs"], completion_mask, rollout["env_mask"], mode
    )
    assert (unclipped < CLIP_MIN).any() and (unclipped > CLIP_MAX).any(), f"{mode}: no shift crosses a bound"
    advantages = trl_output["advantages"]
    assert torch.equal(advantages, KNOWN_ADVANTAGES)
    got = corrected["advantages"]
    assert got.shape == want.shape == (4, 1 if mode.startswith("sequence") else completion_mask.size(1))
    torch.testing.assert_close(got, advantages[:, None] * want, rtol=0, atol=1e-6, msg=f"{mode}: {got=} {want=}")
    got_ratio = got / advantages[:, None]

    # The shifts, as known amounts (the engine's log-probs equal the trainer's to ~1e-6).
    lengths = completion_mask.sum(-1).tolist()
    if mode.startswith("token"):
        torch.testing.assert_close(
            got_ratio[0, : lengths[0]], torch.full((lengths[0],), math.exp(0.25)), atol=1e-3, rtol=0
        )
        assert got_ratio[1, 0] == (CLIP_MIN if mode == "token_truncate" else 0.0), f"{got_ratio[1]=}"
        assert got_ratio[2, 0] == (CLIP_MAX if mode == "token_truncate" else 0.0), f"{got_ratio[2]=}"
        assert got_ratio[2, lengths[2] - 1] == 1.0 and got_ratio[3, 0] == 1.0, f"{got_ratio[2:]=}"
    else:
        first = min(math.exp(0.25 * lengths[0]), CLIP_MAX)
        if mode == "sequence_truncate":
            known = [first, CLIP_MIN, CLIP_MAX, 1.0]
        else:
            known = [0.0 if math.exp(0.25 * lengths[0]) > CLIP_MAX else first, 0.0, 0.0, 1.0]
        torch.testing.assert_close(got_ratio[:, 0], torch.tensor(known), atol=1e-3, rtol=0, msg=f"{mode}: {got_ratio=}")

    # TRL's metrics of this generation: its flattening of the ratio, and |trainer - sampler| over the scored tokens.
    mask = (completion_mask * trl_output["tool_mask"]).bool()
    flat = want.flatten() if mode.startswith("sequence") else want[mask]
    metrics = record["metrics"]
    for stat, value in (("min", flat.min()), ("mean", flat.mean()), ("max", flat.max())):
        assert metrics[f"sampling/importance_sampling_ratio/{stat}"] == pytest.approx(value.item(), abs=1e-6), stat
    delta = (trainer_logps - corrected["sampling_per_token_logps"]).abs()
    delta = delta[mask & ~delta.isnan()]
    assert metrics["sampling/sampling_logp_difference/mean"] == pytest.approx(delta.mean().item(), abs=1e-6)
    assert metrics["sampling/sampling_logp_difference/max"] == pytest.approx(delta.max().item(), abs=1e-6)


def loss_and_gradients(trainer, inputs) -> tuple[float, dict[str, torch.Tensor]]:
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.model.zero_grad()
    return loss.item(), grads


# Each loss type once, the four (mode, level) pairs in turn: every pair and every loss type covered.
MODE_LEVELS = [(mode, level) for mode in ("token_mask", "sequence_truncate") for level in ("token", "sequence")]
LOSS_CASES = [(loss_type, *MODE_LEVELS[i % len(MODE_LEVELS)]) for i, loss_type in enumerate(LOSS_TYPES)]


@pytest.mark.parametrize("loss_type, mode, level", LOSS_CASES)
def test_folded_advantages_give_the_loss_and_gradient_of_trls_ratio_weighted_loss(run, loss_type, mode, level):
    """With a KL term and the PPO clip active (old log-probs moved off the current ones), so the
    fold must commute with the clip's min and the ratio must not reach the KL term."""
    trainer, record = run["trainer"], run["modes"][mode]
    corrected, rollout = record["corrected"], record["rollout"]
    ratio, _ = trl_importance_ratio(
        corrected["old_per_token_logps"], rollout["logprobs"], corrected["completion_mask"], rollout["env_mask"], mode
    )
    generator = torch.Generator().manual_seed(0)
    old = corrected["old_per_token_logps"]
    shared = dict(
        old_per_token_logps=old + 0.3 * torch.randn(old.shape, generator=generator),
        ref_per_token_logps=old + 0.2 * torch.randn(old.shape, generator=generator),
    )
    folded_inputs = {**corrected, **shared}
    trl_inputs = {**corrected, **shared, "advantages": record["trl"]["advantages"], "importance_sampling_ratio": ratio}
    with trainer_attributes(trainer, loss_type=loss_type, importance_sampling_level=level, beta=0.04):
        folded_loss, folded_grads = loss_and_gradients(trainer, folded_inputs)
        with trainer_attributes(trainer, use_vllm=True):  # TRL's branch: per_token_loss * importance_sampling_ratio
            trl_loss, trl_grads = loss_and_gradients(trainer, trl_inputs)
    scale = max(g.abs().max().item() for g in trl_grads.values())
    worst = max((folded_grads[name] - g).abs().max().item() for name, g in trl_grads.items())
    print(
        f"{loss_type} {mode} {level}: |loss difference| {abs(folded_loss - trl_loss):.2g}, "
        f"max |gradient difference| {worst:.2g} of max |gradient| {scale:.2g}"
    )
    assert scale > 0, "no gradient"
    assert abs(folded_loss - trl_loss) <= 1e-6, f"{loss_type=} {mode=} {level=} {folded_loss=} {trl_loss=}"
    assert worst <= 1e-6, f"{loss_type=} {mode=} {level=} {worst=} {scale=}"


def test_without_the_correction_the_output_is_trls_unchanged(run):
    trainer = run["trainer"]
    counts = {key: len(values) for key, values in trainer._metrics["train"].items()}
    with trainer_attributes(trainer, vllm_importance_sampling_correction=False):
        output = trainer._generate_and_score_completions(GENERATION_INPUTS)
    trl_output = trainer.trl_outputs[-1]
    assert "sampling_per_token_logps" in output, "no sampler log-probs: the correction had nothing to skip"
    assert output.keys() == trl_output.keys() and "old_per_token_logps" not in output, sorted(output)
    assert all(output[key] is trl_output[key] for key in output), "a value was replaced"
    assert output["advantages"].dim() == 1, output["advantages"].shape
    added = [key for key, values in trainer._metrics["train"].items() if len(values) != counts.get(key, 0)]
    assert not [key for key in added if key.startswith("sampling/")], added


@pytest.mark.parametrize("config, keyword", [({"loss_type": "vespo"}, "vespo"), ({"use_vllm": True}, "use_vllm=True")])
def test_vespo_and_use_vllm_are_refused_with_one_sentence(config, keyword, tmp_path):
    args = trl.GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, **config)
    with pytest.raises(FlexInferenceError) as info:
        sampler_corrected()(model="unused: refused before loading", reward_funcs=distinct_characters, args=args)
    assert_one_sentence(str(info.value), keyword)


def test_importing_the_engine_does_not_import_trl():
    probe = "import sys, qwen3_flex_inference; print(any(name.split('.')[0] == 'trl' for name in sys.modules))"
    run = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().splitlines()[-1] == "False", run.stdout + run.stderr[-2000:]
