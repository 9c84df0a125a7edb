"""Learning on the trained CI-size checkpoints (scripts/train_checkpoints.py, committed), float32 on
the CPU, through `scripts/grpo_trl.py`: GRPO on the Python task (a held-out function's header in, 1
when the completion parses) raises the reward with the engine's rollouts and with TRL's own
generation alike, and the script's log-prob comparison finds the engine's log-probs equal to the
trainer's."""

import json
import statistics

import pytest

from scripts.grpo_trl import main as grpo_main
from scripts.train_checkpoints import ensure_trained_checkpoints

pytest.importorskip("trl", reason="requirements.txt installs trl on Python >= 3.11 only")
pytestmark = pytest.mark.filterwarnings("ignore:You are using 'rollout_func'")

LEARNING_STEPS = 8
WINDOW = 3  # steps averaged at each end of the run
MARGIN = 0.2  # the rise of the mean reward (the share of completions that parse), first WINDOW steps to last
LEARNING_ARGS = [
    "--device", "cpu", "--num_prompts", "8", "--num_generations", "8", "--max_completion_length", "48",
    "--learning_rate", "3e-3",
]  # fmt: skip


@pytest.fixture(scope="module")
def trained_dir():
    return ensure_trained_checkpoints()


@pytest.mark.parametrize("backend", ["engine", "hf"])
def test_grpo_raises_the_share_of_completions_that_parse(backend, trained_dir, tmp_path, capsys):
    out = tmp_path / "metrics.json"
    model = str(trained_dir / "qwen3")
    grpo_main(
        ["--model_name", model, "--backend", backend, "--steps", str(LEARNING_STEPS), "--out", str(out), *LEARNING_ARGS]
    )
    lines = capsys.readouterr().out.splitlines()
    step_lines = [line for line in lines if line.startswith("step ")]
    assert len(step_lines) == LEARNING_STEPS and all("reward=" in line and "loss=" in line for line in step_lines)
    logs = [log for log in json.loads(out.read_text())["logs"] if log["label"].startswith("step ")]
    rewards = [log["reward"] for log in logs]
    first, last = statistics.fmean(rewards[:WINDOW]), statistics.fmean(rewards[-WINDOW:])
    print(f"{backend}: reward {first:.3f} -> {last:.3f} over {LEARNING_STEPS} steps: {rewards}")
    assert last - first >= MARGIN, f"{backend}: {first=:.3f} {last=:.3f} {rewards=}"


def test_grpo_script_compares_the_engines_log_probs_with_hf_generates_and_the_trainers_recompute(
    trained_dir, tmp_path, capsys
):
    """The learning run's shapes (the engine's compiled kernels serve both); tests/test_trl.py checks
    the engine's log-probs inside TRL's steps on the trained Gemma-4 too."""
    out = tmp_path / "metrics.json"
    model = str(trained_dir / "qwen3")
    grpo_main(["--model_name", model, "--steps", "2", "--compare_logprobs", "--out", str(out), *LEARNING_ARGS])
    records = json.loads(out.read_text())["sampling_logp_difference"]
    assert [record["step"] for record in records] == [0, 1]
    for record in records:
        for sampler in ("engine", "hf_generate", "trainer_recompute"):
            stats = record[sampler]
            assert stats["tokens"] > 0 and stats["mean"] < 2e-6 and stats["outside"] == 0, f"{sampler}: {record}"
    assert "outside [0.9, 1.1]" in capsys.readouterr().out
