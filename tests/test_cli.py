"""The command lines of qwen3_flex_inference.py and gemma4_flex_inference.py (CPU, float32).

Most runs call `main([...])` in this process (imports and compiled kernels are paid once); a real
subprocess is used only where the test is about the process itself: the exit code, and that
stderr holds one sentence and no traceback.
"""

import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_one_sentence, exit_message, hf_greedy, load_hf

import gemma4_flex_inference
import qwen3_flex_inference

ROOT = Path(__file__).resolve().parents[1]
GEMMA4_MODULE = "transformers.models.gemma4.modeling_gemma4"

MAX_NEW_TOKENS = 8
N_PROMPTS = 3
# The same limits in every run, so compiled kernels are shared between tests.
LIMITS = [
    "--device", "cpu",
    "--max_new_tokens", str(MAX_NEW_TOKENS),
    "--max_batch_size", "2",
    "--max_seq_length", "256",
    "--n_pages", "64",
    "--page_size", "16",
    "--quiet",
]  # fmt: skip

STATS_KEYS = [
    "backend", "model_name", "capture_cudagraph", "lora_adapter", "n_prompts", "n_decoded_tokens",
    "wall_times_s", "first_round_s", "timed_rounds", "median_wall_s", "best_wall_s", "decode_tps_median",
    "decode_tps_best", "n_cut_by_max_seq_length",
    "max_new_tokens", "peak_memory_gb", "kv_pool_pages", "kv_pool_gb", "sample_completions",
]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def cli_argv(model_dir, *extra, n_prompts=N_PROMPTS, n_rounds=1):
    return ["--model_name", str(model_dir), "--n_prompts", str(n_prompts), "--n_rounds", str(n_rounds), *LIMITS, *extra]


def run_cli(module, argv, stats_path: Path) -> dict:
    """Runs `module.main(argv + --stats_path)` in process; returns the stats JSON it wrote."""
    try:
        module.main([*argv, "--stats_path", str(stats_path)])
    except SystemExit as error:
        pytest.fail(f"{module.__name__}.main({argv}) exited: {error.code!r}")
    assert stats_path.is_file(), f"no stats written to {stats_path}"
    return json.loads(stats_path.read_text())


# Tests about the process itself -> the command line they run (`python ARGS`, cwd = repo root).
PROCESS_RUNS = {
    "test_missing_model_path_exits_with_one_sentence_in_a_subprocess": [
        "qwen3_flex_inference.py", "--model_name", "./no/such/dir", "--device", "cpu",
    ],
    "test_decode_kernel_options_not_json_exits_with_one_sentence_in_a_subprocess": [
        "qwen3_flex_inference.py", "--device", "cpu", "--decode_kernel_options", "{bad",
    ],
    "test_gemma4_help_works_in_a_subprocess": ["gemma4_flex_inference.py", "--help"],
    "test_gemma4_help_works_in_a_subprocess_without_the_gemma4_module": [
        "-c",
        "import sys\n"
        f"sys.modules[{GEMMA4_MODULE!r}] = None  # import raises ImportError\n"
        "import gemma4_flex_inference\n"
        "try:\n"
        "    gemma4_flex_inference.require_gemma4()\n"
        "except gemma4_flex_inference.FlexInferenceError:\n"
        "    pass  # the simulated missing module took effect\n"
        "else:\n"
        "    sys.exit('the gemma4 module was still importable')\n"
        "gemma4_flex_inference.main(['--help'])\n",
    ],
}  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def processes(request):
    """Starts the subprocesses of the selected tests of PROCESS_RUNS at once, in the background.

    Each pays ~5 s of imports before it fails (or prints --help); started early they overlap with
    each other and with the in-process runs instead of adding up.
    """
    this_module = sys.modules[__name__]
    selected = {item.name for item in request.session.items if getattr(item, "module", None) is this_module}
    started = {
        name: subprocess.Popen(
            [sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name, args in PROCESS_RUNS.items()
        if name in selected
    }
    yield started
    for process in started.values():
        if process.poll() is None:
            process.kill()
        process.communicate()


def finish_process(processes: dict, test_name: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Waits for the subprocess started for `test_name`; returns its exit code, stdout and stderr."""
    process = processes[test_name]
    stdout, stderr = process.communicate(timeout=timeout)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def assert_process_fails_with_one_sentence(result: subprocess.CompletedProcess, *keywords) -> None:
    assert result.returncode != 0, f"exit code {result.returncode}; stdout={result.stdout!r} stderr={result.stderr!r}"
    assert "Traceback" not in result.stderr, f"traceback in stderr: {result.stderr!r}"
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"stderr is not exactly one line: {lines!r}"
    assert_one_sentence(lines[0], *keywords)


def check_sane_stats(stats: dict, model_name: str, n_rounds: int) -> None:
    missing = [key for key in STATS_KEYS if key not in stats]
    assert not missing, f"stats lacks {missing}: {sorted(stats)}"
    assert stats["backend"] == "flex_attention", stats["backend"]
    assert stats["model_name"] == model_name, (stats["model_name"], model_name)
    assert stats["capture_cudagraph"] is False, stats["capture_cudagraph"]
    assert stats["n_prompts"] == N_PROMPTS, stats["n_prompts"]
    assert stats["max_new_tokens"] == MAX_NEW_TOKENS, stats["max_new_tokens"]
    n_decoded = stats["n_decoded_tokens"]
    assert 0 < n_decoded <= N_PROMPTS * MAX_NEW_TOKENS, f"n_decoded_tokens {n_decoded}"
    walls = stats["wall_times_s"]
    assert len(walls) == n_rounds and all(t > 0 for t in walls), f"wall_times_s {walls}"
    # the first round (compiles) is start-up; the rounds after it are the timed ones
    assert stats["first_round_s"] == walls[0], (stats["first_round_s"], walls)
    timed = walls[1:] or walls
    assert stats["timed_rounds"] == len(timed), (stats["timed_rounds"], walls)
    assert stats["median_wall_s"] == pytest.approx(statistics.median(timed)), (stats["median_wall_s"], walls)
    assert stats["best_wall_s"] == pytest.approx(min(timed)), (stats["best_wall_s"], walls)
    assert stats["n_cut_by_max_seq_length"] == 0, stats["n_cut_by_max_seq_length"]
    assert stats["kv_pool_pages"]["full_attention"] == 64, stats["kv_pool_pages"]  # LIMITS' --n_pages
    # every pool at most --n_pages pages (a sliding-window pool fewer)
    pool_bytes = stats["kv_pool_gb"] * 1e9
    assert 0 < pool_bytes <= 64 * 16 * stats["kv_bytes_per_token"] * (1 + 1e-9), (
        pool_bytes,
        stats["kv_bytes_per_token"],
    )
    tps = [n_decoded / t for t in timed]
    assert stats["decode_tps_median"] > 0 and stats["decode_tps_best"] > 0, (
        stats["decode_tps_median"],
        stats["decode_tps_best"],
    )
    assert stats["decode_tps_median"] == pytest.approx(statistics.median(tps)), (stats["decode_tps_median"], tps)
    assert stats["decode_tps_best"] == pytest.approx(max(tps)), (stats["decode_tps_best"], tps)
    assert stats["peak_memory_gb"] > 0, stats["peak_memory_gb"]
    completions = stats["sample_completions"]
    assert isinstance(completions, list) and len(completions) == N_PROMPTS, f"sample_completions {completions!r}"
    assert all(isinstance(c, str) for c in completions), f"sample_completions {completions!r}"


def hf_completions(model_dir: Path, argv: list[str], chat_template: str, model_class=None):
    """What HF generate gives greedily for the prompts the CLI builds from `argv`.

    Returns (decoded completions, number of generated tokens)."""
    from transformers import AutoTokenizer

    args = qwen3_flex_inference.build_arg_parser("unused", "unused").parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = load_hf(model_dir, model_class)
    sequences = qwen3_flex_inference.make_sequences(
        qwen3_flex_inference.read_prompts(args.prompts_file, args.n_prompts),
        tokenizer,
        chat_template,
        hf.config.vocab_size,
        args.seed,
    )
    prompts = [seq.input_ids for seq in sequences]
    assert all(len(ids) + MAX_NEW_TOKENS <= args.max_seq_length for ids in prompts), [len(ids) for ids in prompts]
    end_ids = qwen3_flex_inference.end_token_ids(hf, tokenizer)
    outputs = hf_greedy(hf, prompts, MAX_NEW_TOKENS, end_ids)
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in outputs], sum(len(ids) for ids in outputs)


# ---------------------------------------------------------------------------------------------
# 1. Qwen3 end to end
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_run(tiny_dir, tmp_path_factory):
    model_dir = tiny_dir / "qwen3"
    argv = cli_argv(model_dir, n_rounds=2)
    stats = run_cli(qwen3_flex_inference, argv, tmp_path_factory.mktemp("qwen3") / "stats.json")
    return dict(model_dir=model_dir, argv=argv, stats=stats)


def test_qwen3_cli_writes_stats_with_every_key_and_sane_values(qwen3_run):
    stats = qwen3_run["stats"]
    check_sane_stats(stats, str(qwen3_run["model_dir"]), n_rounds=2)
    assert stats["lora_adapter"] is None, stats["lora_adapter"]
    assert "drift_verification" not in stats, stats.get("drift_verification")


def test_qwen3_cli_completions_equal_hf_greedy_generate_on_grpo_chat_prompts(qwen3_run):
    # --chat_template auto is "grpo" for this CLI.
    want, want_n_decoded = hf_completions(qwen3_run["model_dir"], qwen3_run["argv"], "grpo")
    stats = qwen3_run["stats"]
    assert stats["n_decoded_tokens"] == want_n_decoded, (stats["n_decoded_tokens"], want_n_decoded)
    assert stats["sample_completions"] == want, f"cli {stats['sample_completions']!r} hf {want!r}"


# ---------------------------------------------------------------------------------------------
# 2. LoRA + drift verification
# ---------------------------------------------------------------------------------------------


def test_qwen3_cli_lora_adapter_with_verify_no_drift_reports_a_passed_drift_check(tiny_dir, tmp_path):
    model_dir = tiny_dir / "qwen3"
    adapter = model_dir / "lora"
    argv = cli_argv(model_dir, "--lora_adapter", str(adapter), "--verify_no_drift", "--verify_iterations", "3")
    stats = run_cli(qwen3_flex_inference, argv, tmp_path / "stats.json")
    check_sane_stats(stats, str(model_dir), n_rounds=1)
    assert stats["lora_adapter"] == str(adapter), stats["lora_adapter"]
    drift = stats.get("drift_verification")
    assert drift is not None, f"no drift_verification in stats: {sorted(stats)}"
    assert drift["passed"] is True, drift
    assert drift["pristine_unchanged"] is True, drift
    assert drift["restored_matches_first"] is True, drift
    assert drift["iterations"] == 3, drift


# ---------------------------------------------------------------------------------------------
# 3. Prompts files
# ---------------------------------------------------------------------------------------------


def test_prompts_file_jsonl_and_plain_text_both_cycle_to_n_prompts(tiny_dir, tmp_path):
    model_dir = tiny_dir / "qwen3"
    first, second = "What is 2 plus 3?", "Name a prime number larger than 10."
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text(
        json.dumps({"prompt": first}) + "\n\n" + json.dumps({"messages": [{"role": "user", "content": second}]}) + "\n"
    )
    text = tmp_path / "prompts.txt"
    text.write_text(f"{first}\n{second}\n")

    stats_jsonl = run_cli(
        qwen3_flex_inference, cli_argv(model_dir, "--prompts_file", str(jsonl)), tmp_path / "jsonl.json"
    )
    stats_text = run_cli(qwen3_flex_inference, cli_argv(model_dir, "--prompts_file", str(text)), tmp_path / "text.json")
    for stats in (stats_jsonl, stats_text):
        check_sane_stats(stats, str(model_dir), n_rounds=1)
    # Two prompts cycled to three: the third is the first again (greedy, so the same completion).
    completions = stats_text["sample_completions"]
    assert completions[2] == completions[0], f"third prompt is not the first one again: {completions!r}"
    # A one-user-turn "messages" line is the same chat as a plain prompt with that content.
    assert stats_jsonl["sample_completions"] == completions, (
        f"jsonl {stats_jsonl['sample_completions']!r} text {completions!r}"
    )
    assert stats_jsonl["n_decoded_tokens"] == stats_text["n_decoded_tokens"], (
        stats_jsonl["n_decoded_tokens"],
        stats_text["n_decoded_tokens"],
    )


# ---------------------------------------------------------------------------------------------
# 4. Gemma-4 end to end
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma4_runs(tiny_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gemma4")
    runs = {}
    for name, n_rounds in (("gemma4", 2), ("gemma4_text", 1)):
        # NOTE: one batch slot per prompt: a single prefill and a single decode bucket to compile
        # (two attention regimes each), which halves the cold-cache compile time of this fixture.
        argv = cli_argv(
            tiny_dir / name, "--chat_template", "auto", "--max_batch_size", str(N_PROMPTS), n_rounds=n_rounds
        )
        runs[name] = dict(
            argv=argv, n_rounds=n_rounds, stats=run_cli(gemma4_flex_inference, argv, tmp / f"{name}.json")
        )
    return runs


def test_gemma4_cli_on_multimodal_checkpoint_writes_sane_stats(tiny_dir, gemma4_runs):
    run = gemma4_runs["gemma4"]
    check_sane_stats(run["stats"], str(tiny_dir / "gemma4"), n_rounds=run["n_rounds"])


def test_gemma4_text_checkpoint_gives_the_same_completions_as_the_multimodal_one(tiny_dir, gemma4_runs):
    stats_text, stats_mm = gemma4_runs["gemma4_text"]["stats"], gemma4_runs["gemma4"]["stats"]
    check_sane_stats(stats_text, str(tiny_dir / "gemma4_text"), n_rounds=1)
    assert stats_text["n_decoded_tokens"] == stats_mm["n_decoded_tokens"], (
        stats_text["n_decoded_tokens"],
        stats_mm["n_decoded_tokens"],
    )
    assert stats_text["sample_completions"] == stats_mm["sample_completions"], (
        stats_text["sample_completions"],
        stats_mm["sample_completions"],
    )


def test_gemma4_cli_auto_chat_template_is_native_and_matches_hf_greedy(tiny_dir, gemma4_runs):
    from transformers import Gemma4ForCausalLM

    run = gemma4_runs["gemma4_text"]
    want, want_n_decoded = hf_completions(tiny_dir / "gemma4_text", run["argv"], "native", Gemma4ForCausalLM)
    stats = run["stats"]
    assert stats["n_decoded_tokens"] == want_n_decoded, (stats["n_decoded_tokens"], want_n_decoded)
    assert stats["sample_completions"] == want, f"cli {stats['sample_completions']!r} hf {want!r}"


# ---------------------------------------------------------------------------------------------
# 5. Bad input: one sentence, non-zero exit, no traceback
# ---------------------------------------------------------------------------------------------


def test_missing_model_path_exits_with_one_sentence_in_a_subprocess(processes):
    result = finish_process(processes, "test_missing_model_path_exits_with_one_sentence_in_a_subprocess")
    assert_process_fails_with_one_sentence(result, "./no/such/dir", "does not exist")


def test_decode_kernel_options_not_json_exits_with_one_sentence_in_a_subprocess(processes):
    result = finish_process(processes, "test_decode_kernel_options_not_json_exits_with_one_sentence_in_a_subprocess")
    assert_process_fails_with_one_sentence(result, "--decode_kernel_options", "not valid JSON")


@pytest.mark.parametrize(
    "flag, value, keyword",
    [
        ("--decode_kernel_options", "{bad", "not valid JSON"),
        ("--prefill_kernel_options", "[1]", "must be a JSON object"),
    ],
    ids=["decode_not_json", "prefill_json_list"],
)
def test_kernel_options_that_are_not_a_json_object_exit_with_one_sentence(tiny_dir, flag, value, keyword):
    message = exit_message(qwen3_flex_inference, cli_argv(tiny_dir / "qwen3", flag, value))
    assert_one_sentence(message, flag, keyword)


def test_max_seq_length_not_a_multiple_of_page_size_exits_with_one_sentence(tiny_dir):
    argv = cli_argv(tiny_dir / "qwen3", "--max_seq_length", "100", "--page_size", "16")
    assert_one_sentence(exit_message(qwen3_flex_inference, argv), "max_seq_length", "multiple of page_size")


def test_prompt_longer_than_max_seq_length_exits_with_one_sentence(tiny_dir, tmp_path):
    prompts = tmp_path / "long.txt"
    prompts.write_text(" ".join(["seven apples and three pears"] * 100) + "\n")
    argv = cli_argv(
        tiny_dir / "qwen3",
        "--prompts_file",
        str(prompts),
        "--max_seq_length",
        "64",
        "--page_size",
        "16",
        "--n_pages",
        "64",
        n_prompts=1,
    )
    assert_one_sentence(exit_message(qwen3_flex_inference, argv), "max_seq_length is 64")


def test_page_pool_too_small_for_one_sequence_exits_with_one_sentence(tiny_dir):
    argv = cli_argv(tiny_dir / "qwen3", "--n_pages", "2", "--page_size", "16", "--max_seq_length", "256")
    assert_one_sentence(exit_message(qwen3_flex_inference, argv), "page pool", "--n_pages")


def test_max_new_tokens_zero_exits_with_one_sentence(tiny_dir):
    argv = cli_argv(tiny_dir / "qwen3", "--max_new_tokens", "0")
    assert_one_sentence(exit_message(qwen3_flex_inference, argv), "--max_new_tokens", "at least 1")


def test_adapter_whose_target_modules_are_missing_exits_saying_it_does_not_fit(tiny_dir, tmp_path):
    adapter = tmp_path / "bad_lora"
    shutil.copytree(tiny_dir / "qwen3" / "lora", adapter)
    config_path = adapter / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["target_modules"] = ["no_such_proj"]
    config_path.write_text(json.dumps(config))
    argv = cli_argv(tiny_dir / "qwen3", "--lora_adapter", str(adapter))
    assert_one_sentence(exit_message(qwen3_flex_inference, argv), str(adapter), "does not fit this model")


def test_verify_no_drift_without_lora_adapter_exits_with_one_sentence(tiny_dir):
    argv = cli_argv(tiny_dir / "qwen3", "--verify_no_drift")
    assert_one_sentence(exit_message(qwen3_flex_inference, argv), "--verify_no_drift", "--lora_adapter")


def test_capture_cudagraph_on_cpu_exits_with_one_sentence(tiny_dir):
    argv = cli_argv(tiny_dir / "qwen3", "--capture_cudagraph")
    assert_one_sentence(exit_message(qwen3_flex_inference, argv), "--capture_cudagraph", "CUDA")


# ---------------------------------------------------------------------------------------------
# 6. Loading never runs code from a checkpoint
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("module", [qwen3_flex_inference, gemma4_flex_inference], ids=["qwen3", "gemma4"])
def test_trust_remote_code_and_pickle_weights_are_off_by_default(module):
    args = module.build_arg_parser("unused", "unused").parse_args([])
    assert args.trust_remote_code is False, args.trust_remote_code
    assert args.allow_pickle_weights is False, args.allow_pickle_weights


@pytest.fixture(scope="module")
def pickle_only_checkpoint(tiny_dir, tmp_path_factory):
    """The tiny Qwen3 with its weights in a pickled pytorch_model.bin only (no safetensors)."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("pickle_only") / "qwen3"
    shutil.copytree(tiny_dir / "qwen3", folder, ignore=shutil.ignore_patterns("lora", "*.safetensors"))
    # NOTE: transformers 5 save_pretrained always writes safetensors, so the .bin is written by hand.
    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "qwen3", dtype=torch.float32)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    assert not list(folder.glob("*.safetensors")), list(folder.iterdir())
    return folder


def test_pickle_only_checkpoint_is_refused_without_allow_pickle_weights(pickle_only_checkpoint):
    message = exit_message(qwen3_flex_inference, cli_argv(pickle_only_checkpoint))
    assert_one_sentence(message, "no safetensors weights", "--allow_pickle_weights")


def test_pickle_only_checkpoint_loads_with_allow_pickle_weights(pickle_only_checkpoint, qwen3_run, tmp_path):
    stats = run_cli(
        qwen3_flex_inference, cli_argv(pickle_only_checkpoint, "--allow_pickle_weights"), tmp_path / "stats.json"
    )
    check_sane_stats(stats, str(pickle_only_checkpoint), n_rounds=1)
    want = qwen3_run["stats"]["sample_completions"]
    assert stats["sample_completions"] == want, f"pickled weights {stats['sample_completions']!r} safetensors {want!r}"


# ---------------------------------------------------------------------------------------------
# 7. Gemma-4 install hint and --help
# ---------------------------------------------------------------------------------------------


def test_require_gemma4_raises_with_install_hint_when_gemma4_cannot_be_imported(monkeypatch, tiny_dir):
    monkeypatch.setitem(sys.modules, GEMMA4_MODULE, None)  # makes `import` raise ImportError
    with pytest.raises(gemma4_flex_inference.FlexInferenceError) as info:
        gemma4_flex_inference.require_gemma4()
    assert_one_sentence(str(info.value), "transformers >= 5.5")
    # main() gives the same hint before loading anything.
    message = exit_message(gemma4_flex_inference, cli_argv(tiny_dir / "gemma4_text"))
    assert_one_sentence(message, "transformers >= 5.5")


def test_gemma4_help_works_in_a_subprocess(processes):
    result = finish_process(processes, "test_gemma4_help_works_in_a_subprocess")
    assert result.returncode == 0, f"exit code {result.returncode}; stderr={result.stderr!r}"
    assert "--model_name" in result.stdout, result.stdout
    assert "Traceback" not in result.stderr, result.stderr


def test_gemma4_help_works_in_a_subprocess_without_the_gemma4_module(processes):
    result = finish_process(processes, "test_gemma4_help_works_in_a_subprocess_without_the_gemma4_module")
    assert result.returncode == 0, f"exit code {result.returncode}; stderr={result.stderr!r}"
    assert "--model_name" in result.stdout, result.stdout
    assert "Traceback" not in result.stderr, result.stderr


# ---------------------------------------------------------------------------------------------
# 8. --help text
# ---------------------------------------------------------------------------------------------


def test_every_qwen3_cli_flag_has_help_text():
    parser = qwen3_flex_inference.build_arg_parser("unsloth/Qwen3-4B-Base", "description")
    help_text = parser.format_help()
    for action in parser._actions:
        if "-h" in action.option_strings:
            continue
        assert action.help and action.help.strip(), f"{action.option_strings} has no help text: {action.help!r}"
        for option in action.option_strings:
            assert option in help_text, f"{option} is not listed in --help"


# ---------------------------------------------------------------------------------------------
# What a run prints
# ---------------------------------------------------------------------------------------------


def test_a_run_prints_start_up_apart_from_timed_rounds_completions_and_a_short_quiet_log(tiny_dir, capsys):
    """stdout: start-up (load, the compiling first round) apart from the timed rounds, what the
    tok/s counts, two completions and that tiny random weights give random text; stderr (not a
    terminal here) holds no progress-bar frames and no library notices."""
    argv = cli_argv(tiny_dir / "qwen3", "--lora_adapter", str(tiny_dir / "qwen3" / "lora"), n_rounds=2)
    qwen3_flex_inference.main([a for a in argv if a != "--quiet"])
    out, err = capsys.readouterr()
    assert "start-up: load" in out and "first round (compiles)" in out, out
    assert "timed rounds (1 after the first)" in out and "end to end" in out, out
    assert out.count("completion 1:\n") == 1 and out.count("completion 2:\n") == 1, out
    assert "random text by construction" in out, out
    assert err.strip().splitlines() == [line for line in err.strip().splitlines() if line.startswith("loaded ")], err


def test_dummy_weights_are_said_to_be_built_not_loaded(tiny_dir, capsys):
    argv = cli_argv(tiny_dir / "qwen3", "--load_format", "dummy")
    qwen3_flex_inference.main([a for a in argv if a != "--quiet"])
    out, err = capsys.readouterr()
    assert "random weights (--load_format dummy)" in err and "loaded" not in err, err
    assert "random text by construction" in out, out


def test_completions_cut_by_max_seq_length_are_counted_and_said(tiny_dir, tmp_path, capsys):
    """A prompt that leaves fewer than --max_new_tokens positions stops at --max_seq_length: the
    run says how many did."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "word " * 40}) + "\n")
    argv = cli_argv(tiny_dir / "qwen3", "--prompts_file", str(prompts), "--chat_template", "native", n_prompts=2)
    argv[argv.index("--max_seq_length") + 1] = "160"  # the prompt takes 137 of them
    argv[argv.index("--max_new_tokens") + 1] = "64"
    stats = run_cli(qwen3_flex_inference, argv, tmp_path / "stats.json")
    assert stats["n_cut_by_max_seq_length"] == 2, stats["n_cut_by_max_seq_length"]
    assert "2 of 2 completions stopped at --max_seq_length 160 before --max_new_tokens 64" in capsys.readouterr().out


def test_grpo_template_keeps_a_prompt_s_own_system_turn(tiny_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "qwen3")
    own = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "2 + 2?"}]
    text = qwen3_flex_inference.format_prompt(tokenizer, own, "grpo")
    assert "Answer in French." in text and qwen3_flex_inference.GRPO_SYSTEM_PROMPT not in text, text
    plain = qwen3_flex_inference.format_prompt(tokenizer, "2 + 2?", "grpo")
    assert qwen3_flex_inference.GRPO_SYSTEM_PROMPT in plain, plain


def test_quiet_leaves_stderr_empty(tiny_dir, capsys):
    qwen3_flex_inference.main(cli_argv(tiny_dir / "qwen3", "--lora_adapter", str(tiny_dir / "qwen3" / "lora")))
    out, err = capsys.readouterr()
    assert err == "" and "completion 1:\n" in out, f"{err=}"
