"""scripts/grpo_trl.py's command line: bad flag values and combinations are refused in one sentence
before anything is loaded, --help shows every default; and every script of scripts/ run by path
(`python scripts/x.py`) either runs or says in one sentence how to run it."""

import argparse
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import scripts.grpo_trl as grpo_trl

ROOT = Path(__file__).resolve().parents[1]
REPO_MODULES = ("qwen3_flex_inference", "gemma4_flex_inference", "scripts")

BAD_ARGS = {
    "no steps": (["--steps", "0"], "--steps must be at least 1, got 0"),
    "no prompts": (["--num_prompts", "0"], "--num_prompts must be at least 1, got 0"),
    "one generation": (["--num_generations", "1"], "--num_generations must be at least 2"),
    "no completion": (["--max_completion_length", "0"], "--max_completion_length must be at least 1, got 0"),
    "no rank": (["--lora_r", "0"], "--lora_r must be at least 1, got 0"),
    "no sequence": (["--max_seq_length", "0"], "--max_seq_length must be at least 1, got 0"),
    "zero learning rate": (["--learning_rate", "0"], "--learning_rate must be greater than 0, got 0.0"),
    "negative learning rate": (["--learning_rate=-1e-4"], "--learning_rate must be greater than 0, got -0.0001"),
    "zero temperature": (["--temperature", "0"], "--temperature must be greater than 0, got 0.0"),
    "negative seed": (["--seed", "-1"], "--seed must be in [0, 2**32), got -1"),
    "seed beyond numpy's": (["--seed", str(2**32)], f"--seed must be in [0, 2**32), got {2**32}"),
    "profile past the steps": (
        ["--steps", "2", "--profile_step", "3"],
        "--profile_step must be a step in [1, --steps = 2], got 3",
    ),
    "no stall watch time": (["--stall_traceback_s", "0"], "--stall_traceback_s must be greater than 0, got 0.0"),
    "dummy without tokenizer": (["--load_format", "dummy"], "--load_format dummy has no tokenizer"),
    "missing stdlib": (["--stdlib", "/no/such/folder"], "--stdlib /no/such/folder is not a folder"),
    "out in a missing folder": (["--out", "/no/such/folder/m.json"], "--out /no/such/folder/m.json is not a file"),
    "out is a folder": (["--out", "."], "--out . is not a file"),
    "hf with an engine flag": (["--backend", "hf", "--compile_decode"], "--compile_decode acts on the engine's"),
    "hf comparing log-probs": (["--backend", "hf", "--compare_logprobs"], "--compare_logprobs acts on the engine's"),
    "hf with engine weights": (
        ["--backend", "hf", "--engine_weights", "copy"],
        "--engine_weights acts on the engine's",
    ),
    "hf with a kv budget": (["--backend", "hf", "--kv_cache_gb", "1"], "--kv_cache_gb acts on the engine's"),
    "two kv budgets": (
        ["--kv_cache_gb", "1", "--kv_cache_memory_fraction", "0.5"],
        "--kv_cache_gb and --kv_cache_memory_fraction both size the KV pool: pass one of them",
    ),
    "zero kv budget": (["--kv_cache_gb", "0"], "--kv_cache_gb must be a positive number of GB, got 0.0"),
    "kv share above one": (
        ["--kv_cache_memory_fraction", "1.5"],
        "--kv_cache_memory_fraction is a share of the free memory, in (0, 1], got 1.5",
    ),
    "micro batch off the batch": (
        ["--num_prompts", "2", "--num_generations", "4", "--micro_batch_size", "3"],
        "--micro_batch_size must divide num_prompts x num_generations (8), got 3",
    ),
    "no micro batch": (["--micro_batch_size", "0"], "--micro_batch_size must divide num_prompts x num_generations"),
    "a smaller card on the cpu": (
        ["--device", "cpu", "--gpu_memory_gb", "24"],
        "--gpu_memory_gb simulates a smaller CUDA card: it needs a CUDA device",
    ),
    "cudagraph on the cpu": (["--device", "cpu", "--capture_cudagraph"], "--capture_cudagraph needs a CUDA device"),
    "sequence off the page size": (
        ["--device", "cpu", "--max_seq_length", "1000"],
        "--max_seq_length (1000) must be a multiple of the engine's page size on cpu (16)",
    ),
    "completion as long as the sequence": (
        ["--device", "cpu", "--max_seq_length", "64", "--max_completion_length", "64"],
        "--max_completion_length (64) leaves no room for a prompt in --max_seq_length (64)",
    ),
}


@pytest.fixture
def refuses_to_load(monkeypatch):
    """Makes loading a checkpoint fail the test: bad arguments must be refused before it."""

    def load(*args, **kwargs):
        raise AssertionError(f"grpo_trl loaded {args} before refusing its arguments")

    for name in ("ensure_trained_checkpoints", "load_config", "load_model"):
        monkeypatch.setattr(grpo_trl, name, load)


def refusal(argv: list[str], capsys) -> str:
    """grpo_trl's main on `argv`: the one line it writes to stderr before exiting non-zero."""
    with pytest.raises(SystemExit) as exit_info:
        grpo_trl.main(argv)
    stderr = capsys.readouterr().err
    assert exit_info.value.code not in (0, None), f"{argv=} {exit_info.value.code=} {stderr=}"
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, f"{argv=} {stderr=}"
    return lines[0]


@pytest.mark.parametrize("argv, message", BAD_ARGS.values(), ids=BAD_ARGS.keys())
def test_bad_flag_is_refused_in_one_sentence_before_loading(argv, message, refuses_to_load, capsys):
    line = refusal(argv, capsys)
    assert message in line, f"{argv=} {line=} {message=}"


def test_more_prompts_than_the_task_has_are_refused_before_loading(refuses_to_load, capsys):
    pytest.importorskip("trl", reason="requirements.txt installs trl on Python >= 3.11 only")
    num_prompts = len(grpo_trl.demo_prompts()) + 1  # TRL would drop the short batch and train no step
    line = refusal(["--task", "digits", "--device", "cpu", "--num_prompts", str(num_prompts)], capsys)
    assert f"--num_prompts {num_prompts} is more than the digits task's {num_prompts - 1} prompts" in line, f"{line=}"


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--backend", "hf"],
        ["--device", "cpu", "--num_prompts", "8", "--num_generations", "8", "--max_completion_length", "48"],
        ["--load_format", "dummy", "--tokenizer", "t", "--device", "cpu", "--max_seq_length", "128", "--out", "m.json"],
        ["--device", "cpu", "--kv_cache_gb", "0.5"],
        ["--device", "cpu", "--kv_cache_memory_fraction", "0.25"],
    ],
)
def test_good_flags_pass_the_checks(argv):
    grpo_trl.check_args(grpo_trl.build_arg_parser().parse_args(argv))


def test_an_engine_run_less_its_engine_flags_is_the_same_run_for_trls_own_generation():
    """bench_learning's hf runs: every engine-only flag and its value dropped, nothing else."""
    parser = grpo_trl.build_arg_parser()
    engine_flags = []
    for flag in (*grpo_trl.ENGINE_ONLY_FLAGS, "engine_weights"):
        value = {"kv_cache_gb": ["1.5"], "kv_cache_memory_fraction": ["0.5"], "engine_weights": ["copy"]}.get(flag, [])
        assert isinstance(parser.get_default(flag), bool) == (not value), f"{flag=}: give it a value here"
        engine_flags += [f"--{flag}", *value]
    shared = ["--device", "cpu", "--steps", "3", "--out", "m.json"]
    engine_run = [*shared[:2], *engine_flags, *shared[2:], "--engine_weights=shared"]
    hf_run = grpo_trl.without_engine_flags(engine_run)
    assert hf_run == shared, f"{hf_run=}"
    grpo_trl.check_args(parser.parse_args([*hf_run, "--backend", "hf"]))


@pytest.mark.parametrize(
    "argv, budget",
    [
        (["--kv_cache_gb", "0.5"], dict(kv_cache_gb=0.5, kv_cache_memory_fraction=None)),
        (["--kv_cache_memory_fraction", "0.25"], dict(kv_cache_gb=None, kv_cache_memory_fraction=0.25)),
        ([], dict(kv_cache_gb=None, kv_cache_memory_fraction=None)),
    ],
    ids=["gb", "fraction", "none"],
)
def test_kv_budget_flags_reach_the_engine(argv, budget, monkeypatch, capsys):
    """The engine is built with the budget flags as given, and n_pages left to them (None)."""
    pytest.importorskip("trl", reason="requirements.txt installs trl on Python >= 3.11 only")
    built = {}

    def engine_class(*args, **kwargs):
        built.update(kwargs)
        raise grpo_trl.FlexInferenceError("engine built")

    monkeypatch.setattr(grpo_trl, "FlexInference", engine_class)
    argv = ["--device", "cpu", "--task", "digits", "--num_prompts", "1", "--num_generations", "2", *argv]
    with pytest.raises(SystemExit):
        grpo_trl.main(argv)
    line = capsys.readouterr().err.strip().splitlines()[-1]  # after the loaders' progress bars
    assert line == "error: engine built", f"{line=}"
    got = {name: built.get(name, "missing") for name in ("kv_cache_gb", "kv_cache_memory_fraction")}
    assert got == budget and built.get("n_pages") is None, f"{got=} {built.get('n_pages')=}"


def test_help_shows_every_default():
    parser = grpo_trl.build_arg_parser()
    text = " ".join(parser.format_help().split())  # unwrapped
    flags = [action for action in parser._actions if action.option_strings and action.default != argparse.SUPPRESS]
    unshown = [a.dest for a in flags if a.default is not None and f"(default: {a.default})" not in text]
    assert not unshown, f"{unshown=}"
    unsaid = [a.dest for a in flags if a.default is None and "default" not in a.help]  # an automatic default, said
    assert not unsaid, f"{unsaid=}"


def repository_imports(path: Path) -> list[str]:
    """The modules of the repository root (engine modules, scripts.*) that a file imports, lazily or not."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.append(node.module)
    return sorted({name for name in names if name.split(".")[0] in REPO_MODULES})


SCRIPTS = sorted(
    path.relative_to(ROOT).as_posix()
    for path in [*ROOT.glob("scripts/*.py"), *ROOT.glob("scripts/benchmarks/*.py")]
    if 'if __name__ == "__main__"' in path.read_text()
)
RUN_BY_PATH_IN_MAKEFILE = re.findall(r"\$\(PY\) (scripts/\S+\.py)", (ROOT / "Makefile").read_text())


def run_by_path(script: str) -> subprocess.CompletedProcess:
    """`python scripts/x.py --help` from the repository root, the root not on PYTHONPATH."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, script, "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_script_run_by_path_runs_or_says_how_to_run_it(script):
    imports = repository_imports(ROOT / script)
    if script not in RUN_BY_PATH_IN_MAKEFILE and not imports:
        return  # it imports nothing of the repository root: Python runs it by path as it is (no subprocess: light)
    run = run_by_path(script)
    if not imports:
        assert run.returncode == 0 and "usage:" in run.stdout, f"{script=} {run.returncode=} {run.stderr[-2000:]=}"
        return
    module = script.removesuffix(".py").replace("/", ".")
    want = f"run it from the repository root ({ROOT}) as: python -m {module} --help"
    assert run.returncode != 0 and run.stderr.strip() == want, f"{script=} {imports=} {run.returncode=} {run.stderr=}"


def test_the_makefiles_script_run_by_path_is_checked():
    assert "scripts/make_tiny_checkpoints.py" in RUN_BY_PATH_IN_MAKEFILE, f"{RUN_BY_PATH_IN_MAKEFILE=}"


def test_a_simulated_card_caps_the_device_by_its_ordinal_when_cuda_names_none(monkeypatch):
    """`--device cuda` has no index; torch.cuda.set_per_process_memory_fraction refuses such a
    device, so the cap goes to the current device's ordinal (CUDA mocked: the suite has no GPU)."""
    calls = []
    monkeypatch.setattr(grpo_trl.torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(
        grpo_trl.torch.cuda, "get_device_properties", lambda device: argparse.Namespace(total_memory=80e9)
    )
    monkeypatch.setattr(
        grpo_trl.torch.cuda,
        "set_per_process_memory_fraction",
        lambda fraction, device: calls.append((fraction, device)),
    )
    grpo_trl.limit_gpu_memory(grpo_trl.torch.device("cuda"), 24e9)
    grpo_trl.limit_gpu_memory(grpo_trl.torch.device("cuda", 1), 40e9)
    assert calls == [(0.3, 3), (0.5, 1)]


def test_garbage_collection_timer_counts_a_full_collection_and_detaches():
    """The per-step log's gc_s and gc_full_collections: a full collection is timed and counted, and
    closing the timer removes its callback."""
    import gc

    timer = grpo_trl.GarbageCollectionTimer()
    try:
        cycles = [[] for _ in range(10_000)]
        for cycle in cycles:
            cycle.append(cycle)  # reference cycles: only the collector frees them
        del cycles
        gc.collect(2)
        assert timer.full_collections >= 1 and timer.seconds > 0, f"{timer.full_collections=} {timer.seconds=}"
    finally:
        timer.close()
    assert timer._on_collection not in gc.callbacks
    full_collections = timer.full_collections
    gc.collect(2)
    assert timer.full_collections == full_collections, "a closed timer still counts"


def test_step_phases_charge_the_generation_and_the_optimizer_and_leave_the_rest_to_training():
    """The per-step log's generate_s, optimizer_s, train_s and step_s: TRL's generation is timed through
    the wrapped method, the rest of the step is training, split into micro batches (the fastest and
    slowest, generation taken out), and each log starts from zero."""
    import time

    class Trainer:
        def _generate_and_score_completions(self, batch):
            time.sleep(0.05)
            return batch + 1

        def compute_loss(self, model, inputs, num_items_in_batch=None):
            return model

    def micro_batch(prompt_tokens: int, seconds: float) -> None:
        inputs = {"prompt_ids": grpo_trl.torch.zeros(8, prompt_tokens), "completion_ids": grpo_trl.torch.zeros(8, 5)}
        assert trainer.compute_loss("loss", inputs, num_items_in_batch=3) == "loss"  # passes through
        time.sleep(seconds)  # its forward and backward

    trainer = Trainer()
    phases = grpo_trl.StepPhases(trainer, grpo_trl.torch.device("cpu"))
    phases.on_step_begin(None, None, None)
    assert trainer._generate_and_score_completions(1) == 2  # the wrapped method's result passes through
    micro_batch(7, 0.01)
    phases.on_substep_end(None, None, None)
    micro_batch(9, 0.03)
    phases.on_pre_optimizer_step(None, None, None)
    time.sleep(0.02)
    phases.on_optimizer_step(None, None, None)
    phases.on_step_end(None, None, None)
    got = phases.counts()
    assert got["generate_s"] >= 0.05 and got["optimizer_s"] >= 0.02 and got["train_s"] >= 0.04, f"{got=}"
    assert got["step_s"] == pytest.approx(got["generate_s"] + got["optimizer_s"] + got["train_s"]), f"{got=}"
    assert got["generate_s"] < got["step_s"] - 0.05, f"the optimizer or training charged to generation: {got=}"
    assert 0.01 <= got["micro_batch_min_s"] < 0.03 <= got["micro_batch_max_s"] < 0.05, (
        f"generation in a micro batch: {got=}"
    )
    assert (got["micro_batch_max_index"], got["micro_batch_max_width"], got["micro_batch_max_new_width"]) == (1, 14, 1)
    assert set(phases.counts().values()) == {0.0}, "a log does not reset the phases"
    phases.on_step_begin(None, None, None)  # the next step: the slowest micro batch has a width seen before
    micro_batch(2, 0.0)
    phases.on_substep_end(None, None, None)
    micro_batch(9, 0.03)
    phases.on_pre_optimizer_step(None, None, None)
    phases.on_optimizer_step(None, None, None)
    phases.on_step_end(None, None, None)
    got = phases.counts()
    assert (got["micro_batch_max_index"], got["micro_batch_max_width"], got["micro_batch_max_new_width"]) == (1, 14, 0)


def test_step_phases_print_the_stacks_of_a_stalled_micro_batch_only(capfd):
    """--stall_traceback_s: a micro batch running past it prints the Python stacks (its own frame among
    them); a fast micro batch, the generation and the optimizer step, each longer than it, print none."""
    import time

    class Trainer:
        def _generate_and_score_completions(self, batch):
            time.sleep(0.3)
            return batch

        def compute_loss(self, model, inputs, num_items_in_batch=None):
            return model

    def stalled_micro_batch():
        time.sleep(0.6)

    trainer = Trainer()
    phases = grpo_trl.StepPhases(trainer, grpo_trl.torch.device("cpu"), stall_s=0.2)
    phases.on_step_begin(None, None, None)
    trainer._generate_and_score_completions(0)
    phases.on_substep_end(None, None, None)  # a fast first micro batch
    stalled_micro_batch()
    phases.on_pre_optimizer_step(None, None, None)
    time.sleep(0.3)  # the optimizer step
    phases.on_optimizer_step(None, None, None)
    phases.on_step_end(None, None, None)
    time.sleep(0.3)  # between steps
    err = capfd.readouterr().err
    assert err.count("Timeout (") == 1 and "stalled_micro_batch" in err, err


def test_sdpa_cudnn_sets_torch_attention_backend_and_gives_the_old_setting_back():
    """grpo_trl trains with cuDNN attention off unless --trainer_cudnn_attention: the setting holds inside,
    and the one before returns after, an exception included."""
    cuda = grpo_trl.torch.backends.cuda
    assert grpo_trl.build_arg_parser().parse_args([]).trainer_cudnn_attention is False
    was_enabled = cuda.cudnn_sdp_enabled()
    for before in (True, False):
        cuda.enable_cudnn_sdp(before)
        with grpo_trl.sdpa_cudnn(not before):
            assert cuda.cudnn_sdp_enabled() is not before
        assert cuda.cudnn_sdp_enabled() is before
        with pytest.raises(RuntimeError), grpo_trl.sdpa_cudnn(not before):
            raise RuntimeError("training failed")
        assert cuda.cudnn_sdp_enabled() is before
    cuda.enable_cudnn_sdp(was_enabled)


def test_step_profiler_prints_the_chosen_step_only(capsys):
    """--profile_step's callback profiles one optimizer step: its host ops show, other steps print nothing."""
    from types import SimpleNamespace

    profiler = grpo_trl.StepProfiler(2, grpo_trl.torch.device("cpu"))
    for global_step in (0, 1, 2):  # steps 1, 2, 3
        profiler.on_step_begin(None, SimpleNamespace(global_step=global_step), None)
        x = grpo_trl.torch.ones(8, 8)
        (x @ x if global_step == 1 else x + x).sum()
        profiler.on_step_end(None, SimpleNamespace(global_step=global_step + 1), None)
    out = capsys.readouterr().out
    assert out.count("profile of step 2") == 1 and "aten::mm" in out and "aten::add" not in out, out
