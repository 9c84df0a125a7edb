"""Data-parallel rollouts under torchrun (2 ranks, gloo on the CPU, the tiny Qwen3, float32): the
completions gathered in input order equal a single-process run's, for uneven splits, an empty shard
and unseeded sampling, through the CLI and through `generate_sharded` on a process group the caller
initialised.

The torchrun launches start at once, in the background (module fixture): their imports and
compiles overlap with each other and with the single-process reference runs in this process.
"""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import random_prompts

import qwen3_flex_inference
from qwen3_flex_inference import demo_prompts, shard_slice

ROOT = Path(__file__).resolve().parents[1]
NUM_RANKS = 2
MAX_NEW_TOKENS = 8
# The same limits in the CLI and the API runs, so compiled kernels are shared between them.
ENGINE_LIMITS = {
    "max_batch_size": 2,
    "max_seq_length": 256,
    "n_pages": 64,
    "page_size": 16,
    "max_new_tokens": MAX_NEW_TOKENS,
}
CLI_LIMITS = [
    "--device", "cpu", "--dtype", "float32", "--n_rounds", "1",
    "--max_new_tokens", str(MAX_NEW_TOKENS), "--max_batch_size", "2", "--max_seq_length", "256",
    "--n_pages", "64", "--page_size", "16",
]  # fmt: skip
# Three prompts on two ranks (blocks of 2 and 1) whose tiny-Qwen3 completions all differ, so that a
# block gathered out of order would show; the stats' sample_completions hold exactly three.
CLI_PROMPTS = demo_prompts()[2:5]
# Prompt lengths per API case: 5 prompts on 2 ranks (blocks of 3 and 2); 1 prompt (rank 1's block is empty).
API_CASES = {"5_prompts_on_2_ranks": [23, 5, 40, 11, 17], "1_prompt_on_2_ranks": [13]}
# Sampling without a seed: one prompt 4 times, 2 copies per rank (the copies differ only by seed).
SAMPLED_CASE = "4_unseeded_samples_of_one_prompt_on_2_ranks"
SAMPLED_PROMPT_LENGTH, SAMPLED_COPIES = 9, 4
# Rank 1's block holds a prompt longer than max_seq_length, rank 0's is fine.
API_BAD_CASE = {"too_long_prompt_in_rank_1_block": [13, 300]}
TOO_LONG_MESSAGE = "a prompt has 300 tokens, max_seq_length is 256"


def cli_argv(model_dir: Path, prompts_file: Path, n_prompts: int, *extra) -> list[str]:
    return [
        "--model_name",
        str(model_dir),
        "--prompts_file",
        str(prompts_file),
        "--n_prompts",
        str(n_prompts),
        *CLI_LIMITS,
        *extra,
    ]


def torchrun(*args) -> subprocess.Popen:
    """`python -m torch.distributed.run --standalone --nproc_per_node 2 ARGS` (a free port is picked)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(NUM_RANKS), *args]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen, timeout: float = 240) -> subprocess.CompletedProcess:
    stdout, stderr = process.communicate(timeout=timeout)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def runs(tiny_dir, tmp_path_factory):
    """Starts the three torchrun launches of this file; runs the CLI's single-process reference meanwhile."""
    tmp = tmp_path_factory.mktemp("distributed")
    model_dir = tiny_dir / "qwen3"

    cli_prompts = tmp / "cli_prompts.txt"
    cli_prompts.write_text("\n".join(CLI_PROMPTS) + "\n")
    argv = cli_argv(model_dir, cli_prompts, len(CLI_PROMPTS))
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    cases = {
        case: random_prompts(lengths, vocab_size, seed=i)
        for i, (case, lengths) in enumerate({**API_CASES, **API_BAD_CASE}.items())
    }
    cases[SAMPLED_CASE] = random_prompts([SAMPLED_PROMPT_LENGTH], vocab_size, seed=len(cases)) * SAMPLED_COPIES
    spec = tmp / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "model_dir": str(model_dir),
                "engine": ENGINE_LIMITS,
                "cases": cases,
                "sampling": {SAMPLED_CASE: {"temperature": 1.0}},
                "out_dir": str(tmp),
            }
        )
    )
    # The second prompt, rank 1's block, is longer than max_seq_length; the first fits.
    bad_prompts = tmp / "bad_prompts.txt"
    bad_prompts.write_text(CLI_PROMPTS[0] + "\n" + " ".join(["seven apples and three pears"] * 100) + "\n")
    processes = {
        # No --quiet: a test checks that only rank 0 prints.
        "cli": torchrun("qwen3_flex_inference.py", *argv, "--stats_path", str(tmp / "stats.json")),
        "bad_input": torchrun("qwen3_flex_inference.py", *cli_argv(model_dir, bad_prompts, 2, "--quiet")),
        "api": torchrun("-m", "tests.distributed_generate", str(spec)),
    }

    single_process_stats = tmp / "single_process_stats.json"
    qwen3_flex_inference.main([*argv, "--quiet", "--stats_path", str(single_process_stats)])
    yield {
        "tmp": tmp,
        "processes": processes,
        "cli_want": json.loads(single_process_stats.read_text()),
    }
    for process in processes.values():
        if process.poll() is None:
            process.kill()
        process.communicate()


@pytest.fixture(scope="module")
def cli_run(runs):
    """The torchrun CLI run: its exit code, output and stats."""
    result = finish(runs["processes"]["cli"])
    assert result.returncode == 0, f"torchrun exit code {result.returncode}; stderr={result.stderr[-3000:]!r}"
    return {"result": result, "stats": json.loads((runs["tmp"] / "stats.json").read_text())}


@pytest.fixture(scope="module")
def api_run(runs):
    """The torchrun run of tests/distributed_generate.py: rank -> case name -> its results."""
    result = finish(runs["processes"]["api"])
    assert result.returncode == 0, f"torchrun exit code {result.returncode}; stderr={result.stderr[-3000:]!r}"
    return [json.loads((runs["tmp"] / f"rank{rank}.json").read_text()) for rank in range(NUM_RANKS)]


@pytest.mark.parametrize("num_items", [0, 1, 2, 5, 7, 64])
@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_shard_slices_are_contiguous_blocks_in_rank_order_one_item_apart_in_size(num_items, world_size):
    slices = [shard_slice(num_items, rank, world_size) for rank in range(world_size)]
    covered = [i for s in slices for i in range(num_items)[s]]
    assert covered == list(range(num_items)), f"{num_items=} {world_size=} {slices=}"
    sizes = [len(range(num_items)[s]) for s in slices]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True), f"{num_items=} {world_size=} {sizes=}"


def test_torchrun_cli_completions_equal_a_single_process_run_in_input_order(runs, cli_run):
    want, got = runs["cli_want"]["sample_completions"], cli_run["stats"]["sample_completions"]
    assert len(set(want)) == len(CLI_PROMPTS), (
        f"the prompts' completions are not all different, order is untested: {want!r}"
    )
    assert got == want, f"torchrun {got!r} single process {want!r}"
    got_n, want_n = cli_run["stats"]["n_decoded_tokens"], runs["cli_want"]["n_decoded_tokens"]
    assert got_n == want_n, f"torchrun {got_n=} single process {want_n=}"


def test_torchrun_cli_stats_hold_per_rank_and_total_throughput(cli_run):
    stats = cli_run["stats"]
    assert stats["world_size"] == NUM_RANKS, stats.get("world_size")
    ranks = stats["ranks"]
    assert [r["rank"] for r in ranks] == list(range(NUM_RANKS)), ranks
    assert [r["n_prompts"] for r in ranks] == [2, 1], [r["n_prompts"] for r in ranks]
    assert stats["n_prompts"] == len(CLI_PROMPTS), stats["n_prompts"]
    per_rank_tokens = [r["n_decoded_tokens"] for r in ranks]
    assert sum(per_rank_tokens) == stats["n_decoded_tokens"], f"{per_rank_tokens=} total {stats['n_decoded_tokens']}"
    for r in ranks:
        assert len(r["wall_times_s"]) == 1 and r["wall_times_s"][0] > 0, r
        assert r["decode_tps_median"] == pytest.approx(r["n_decoded_tokens"] / r["wall_times_s"][0]), r
        assert r["decode_tps_median"] > 0 and r["decode_step_tps"] > 0 and r["peak_memory_gb"] > 0, r
    # The total is the whole round on rank 0: every rank's generation and the gather.
    wall = stats["wall_times_s"]
    assert len(wall) == 1 and wall[0] >= ranks[0]["wall_times_s"][0], f"{wall=} {ranks=}"
    assert stats["decode_tps_median"] == pytest.approx(stats["n_decoded_tokens"] / statistics.median(wall)), stats
    assert stats["decode_step_tps"] == pytest.approx(sum(r["decode_step_tps"] for r in ranks)), stats


def test_torchrun_cli_prints_only_on_rank_0(cli_run):
    result = cli_run["result"]
    summaries = [line for line in result.stdout.splitlines() if " on 2 ranks, " in line]
    assert len(summaries) == 1, f"summary lines {summaries!r}; stdout={result.stdout!r}"
    assert result.stdout.count("start-up: ") == 1 and result.stdout.count("completion 1:\n") == 1, result.stdout
    loaded = [line for line in result.stderr.splitlines() if line.startswith("loaded ")]
    assert len(loaded) == 1, f"'loaded' lines {loaded!r}"


def test_generate_sharded_on_a_gloo_group_equals_single_process_generate_in_input_order(api_run):
    for case in API_CASES:
        for rank, results in enumerate(api_run):
            got, want = results[case]["gathered"], results[case]["single_process"]
            outputs = [tuple(output_ids) for output_ids, _ in want]
            assert len(set(outputs)) == len(outputs), (
                f"{case}: completions not all different, order is untested: {want}"
            )
            assert got == want, f"{case} {rank=} got={got} want={want}"
        assert api_run[0][case] == api_run[1][case], f"{case}: the ranks disagree: {api_run}"


def test_unseeded_samples_on_2_ranks_equal_one_process_s_and_the_ranks_draw_different_samples(api_run):
    # Every copy of the prompt is seeded by its index in the whole list, as in one process; ranks
    # that drew seeds per block would repeat each other's samples.
    for rank, results in enumerate(api_run):
        got, want = results[SAMPLED_CASE]["gathered"], results[SAMPLED_CASE]["single_process"]
        assert got == want, f"{rank=} 2 ranks {got} one process {want}"
        outputs = [tuple(output_ids) for output_ids, _ in got]
        assert len(set(outputs)) == SAMPLED_COPIES, f"{rank=}: samples repeat across copies of one prompt: {outputs}"
    assert api_run[0][SAMPLED_CASE] == api_run[1][SAMPLED_CASE], f"the ranks disagree: {api_run}"


def test_generate_sharded_fails_on_every_rank_when_one_rank_s_block_holds_bad_input(api_run):
    # Rank 0's block is fine: it must fail too rather than wait in the gather for rank 1.
    (case,) = API_BAD_CASE
    for rank, results in enumerate(api_run):
        assert TOO_LONG_MESSAGE in results[case].get("error", ""), f"{case} {rank=} got={results[case]!r}"


def test_torchrun_cli_bad_input_exits_non_zero_with_the_sentence_and_no_worker_traceback(runs):
    result = finish(runs["processes"]["bad_input"])
    assert result.returncode != 0, f"exit code {result.returncode}; stderr={result.stderr[-3000:]!r}"
    sentence = f"max_seq_length is {ENGINE_LIMITS['max_seq_length']}: shorten it or raise --max_seq_length"
    assert sentence in result.stderr, f"{sentence!r} not in stderr={result.stderr[-3000:]!r}"
    # torchrun reports the failed worker with a traceback of its own; the workers print none.
    assert 'qwen3_flex_inference.py", line' not in result.stderr, result.stderr[-3000:]
