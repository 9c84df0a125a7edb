"""A memory budget for the KV pool (`kv_cache_gb`, `kv_cache_memory_fraction`; the CLIs'
--kv_cache_gb, --kv_cache_memory_fraction): the pool gets the most pages whose pools fit in it,
and a budget that cannot hold one sequence, or that conflicts with n_pages, fails in one sentence.

Expected sizes are computed here from the checkpoints' configs, not from the engine's helpers.
Free memory is patched to a fixed number wherever a result depends on it.
"""

import json

import pytest
import torch
from conftest import QUICK_CLI_ARGS, assert_one_sentence, exit_message

import qwen3_flex_inference
from gemma4_flex_inference import FlexGemma4Inference, load_gemma4
from qwen3_flex_inference import FlexInference, FlexInferenceError

PAGE_SIZE = 16
MAX_SEQ_LENGTH = 256
ONE_SEQUENCE_PAGES = MAX_SEQ_LENGTH // PAGE_SIZE + 1  # page 0 is reserved


@pytest.fixture(scope="module")
def qwen3_model(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir / "qwen3", dtype=torch.float32).eval()


def padded_head_dim(head_dim: int) -> int:
    """The CPU stores K and V at a head dim rounded up to a multiple of 16."""
    return -(-head_dim // 16) * 16


def qwen3_page_bytes(config) -> int:
    """One page of the tiny Qwen3's pool: layers x K and V x KV heads x head_dim x float32 x page_size."""
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    return layers * 2 * kv_heads * padded_head_dim(config.head_dim) * 4 * PAGE_SIZE


def build_qwen3(model, max_batch_size=4, **budget):
    return FlexInference(
        model, None, max_batch_size=max_batch_size, max_seq_length=MAX_SEQ_LENGTH, page_size=PAGE_SIZE, **budget
    )


def full_pool_pages(engine) -> int:
    return engine.scheduler.page_tables["full_attention"].n_pages


# ---------------------------------------------------------------------------------------------
# The library: sizes
# ---------------------------------------------------------------------------------------------


def test_gb_budget_gives_the_most_pages_that_fit(qwen3_model):
    page_bytes = qwen3_page_bytes(qwen3_model.config)
    engine = build_qwen3(qwen3_model, kv_cache_gb=40.5 * page_bytes / 1e9)
    assert full_pool_pages(engine) == 40, f"{full_pool_pages(engine)=} {page_bytes=}"
    cache = engine.runner.kv_caches[0]
    assert cache.k_cache.shape[2] == 40 * PAGE_SIZE, cache.k_cache.shape
    assert engine.runner.kv_pool_bytes == 40 * page_bytes, f"{engine.runner.kv_pool_bytes=} {40 * page_bytes=}"


def test_gb_budget_of_an_exact_number_of_pages_gets_all_of_them(qwen3_model):
    page_bytes = qwen3_page_bytes(qwen3_model.config)  # 8192: 30 pages are 0.00024576 GB, not exact in binary
    engine = build_qwen3(qwen3_model, kv_cache_gb=30 * page_bytes / 1e9)
    assert full_pool_pages(engine) == 30, f"{full_pool_pages(engine)=}"


def test_gb_budget_stops_at_the_pages_max_batch_size_sequences_can_use(qwen3_model, monkeypatch):
    monkeypatch.setattr(qwen3_flex_inference, "free_memory_bytes", lambda device: 10**10)
    engine = build_qwen3(qwen3_model, max_batch_size=4, kv_cache_gb=1.0)
    want = 4 * (MAX_SEQ_LENGTH // PAGE_SIZE) + 1
    assert full_pool_pages(engine) == want, f"{full_pool_pages(engine)=} {want=}"


def test_memory_fraction_budget_is_a_share_of_the_free_memory(qwen3_model, monkeypatch):
    page_bytes = qwen3_page_bytes(qwen3_model.config)
    free_bytes = 100 * page_bytes
    monkeypatch.setattr(qwen3_flex_inference, "free_memory_bytes", lambda device: free_bytes)
    engine = build_qwen3(qwen3_model, kv_cache_memory_fraction=0.25)
    want = int(0.25 * free_bytes // page_bytes)
    assert full_pool_pages(engine) == want == 25, f"{full_pool_pages(engine)=} {want=}"


def test_gemma4_gb_budget_counts_the_sliding_window_pool_too(tiny_dir):
    """Gemma-4 has two pools: full attention (n_pages) and sliding windows (capped at what
    max_batch_size sequences hold of the window); the budget covers both."""
    model = load_gemma4(str(tiny_dir / "gemma4_text"), torch.float32, torch.device("cpu"))
    config = json.loads((tiny_dir / "gemma4_text" / "config.json").read_text())  # the hub's form of it
    first_shared = config["num_hidden_layers"] - config["num_kv_shared_layers"]
    page_bytes = {"full_attention": 0, "sliding_attention": 0}
    for layer_type in config["layer_types"][:first_shared]:  # the KV-shared layers own no cache
        is_full = layer_type == "full_attention"
        head_dim = config["global_head_dim"] if is_full else config["head_dim"]
        is_global_kv = is_full and config["attention_k_eq_v"] and config.get("num_global_key_value_heads")
        kv_heads = config["num_global_key_value_heads"] if is_global_kv else config["num_key_value_heads"]
        page_bytes[layer_type] += 2 * kv_heads * padded_head_dim(head_dim) * 4 * PAGE_SIZE
    max_batch_size = 2
    sliding_pages = max_batch_size * (-(-config["sliding_window"] // PAGE_SIZE) + 2) + 1
    want = 25  # above the sliding pool's cap, below the 33 pages two sequences can use
    assert sliding_pages < want < max_batch_size * (MAX_SEQ_LENGTH // PAGE_SIZE) + 1, f"{sliding_pages=}"
    budget_bytes = want * page_bytes["full_attention"] + sliding_pages * page_bytes["sliding_attention"]
    budget_bytes += page_bytes["full_attention"] // 2
    engine = FlexGemma4Inference(
        model,
        None,
        max_batch_size=max_batch_size,
        max_seq_length=MAX_SEQ_LENGTH,
        page_size=PAGE_SIZE,
        kv_cache_gb=budget_bytes / 1e9,
    )
    got = {regime: table.n_pages for regime, table in engine.scheduler.page_tables.items()}
    assert got == {"sliding_attention": sliding_pages, "full_attention": want}, f"{got=} {page_bytes=}"
    assert engine.runner.kv_pool_bytes <= budget_bytes, f"{engine.runner.kv_pool_bytes=} {budget_bytes=}"


# ---------------------------------------------------------------------------------------------
# The library: refusals
# ---------------------------------------------------------------------------------------------


def test_budget_too_small_for_one_sequence_raises_saying_what_one_sequence_needs(qwen3_model, monkeypatch):
    page_bytes = qwen3_page_bytes(qwen3_model.config)
    monkeypatch.setattr(qwen3_flex_inference, "PageTable", None)  # calling it would raise TypeError
    kv_cache_gb = 10 * page_bytes / 1e9
    with pytest.raises(FlexInferenceError) as info:
        build_qwen3(qwen3_model, kv_cache_gb=kv_cache_gb)
    want_gb = f"needs {ONE_SEQUENCE_PAGES * page_bytes / 1e9:.3g} GB ({ONE_SEQUENCE_PAGES} pages of 16 tokens"
    assert_one_sentence(
        str(info.value),
        f"a KV budget of {kv_cache_gb:.3g} GB (kv_cache_gb {kv_cache_gb:g})",
        f"cannot hold one sequence of max_seq_length {MAX_SEQ_LENGTH}",
        want_gb,
        "raise kv_cache_gb",
    )
    assert info.value.params == ("kv_cache_gb", "max_seq_length"), info.value.params


def test_fraction_too_small_for_one_sequence_raises_naming_the_free_memory(qwen3_model, monkeypatch):
    page_bytes = qwen3_page_bytes(qwen3_model.config)
    monkeypatch.setattr(qwen3_flex_inference, "free_memory_bytes", lambda device: 100 * page_bytes)
    with pytest.raises(FlexInferenceError) as info:
        build_qwen3(qwen3_model, kv_cache_memory_fraction=0.1)
    assert_one_sentence(
        str(info.value),
        f"(kv_cache_memory_fraction 0.1 of the {100 * page_bytes / 1e9:.3g} GB free)",
        "cannot hold one sequence",
        "raise kv_cache_memory_fraction",
    )


def test_gb_budget_beyond_the_free_memory_is_refused(qwen3_model, monkeypatch):
    monkeypatch.setattr(qwen3_flex_inference, "free_memory_bytes", lambda device: 10**6)
    with pytest.raises(FlexInferenceError) as info:
        build_qwen3(qwen3_model, kv_cache_gb=2.0)
    assert_one_sentence(str(info.value), "kv_cache_gb asks for 2 GB", "cpu has 0.001 GB free", "lower kv_cache_gb")


def test_fraction_on_a_device_of_unknown_free_memory_is_refused(qwen3_model, monkeypatch):
    monkeypatch.setattr(qwen3_flex_inference, "free_memory_bytes", lambda device: None)
    with pytest.raises(FlexInferenceError, match="does not report its free memory.*pass kv_cache_gb instead"):
        build_qwen3(qwen3_model, kv_cache_memory_fraction=0.5)


@pytest.mark.parametrize(
    "sizes, names",
    [
        (dict(n_pages=64, kv_cache_gb=0.001), ("n_pages", "kv_cache_gb")),
        (dict(n_pages=64, kv_cache_memory_fraction=0.5), ("n_pages", "kv_cache_memory_fraction")),
        (dict(kv_cache_gb=0.001, kv_cache_memory_fraction=0.5), ("kv_cache_gb", "kv_cache_memory_fraction")),
    ],
    ids=["n_pages_and_gb", "n_pages_and_fraction", "gb_and_fraction"],
)
def test_two_sizes_for_the_pool_are_refused_naming_both(qwen3_model, sizes, names):
    with pytest.raises(FlexInferenceError) as info:
        build_qwen3(qwen3_model, **sizes)
    assert_one_sentence(str(info.value), f"{names[0]} and {names[1]} both size the KV pool: pass one of them")
    assert info.value.params == names, info.value.params


@pytest.mark.parametrize(
    "budget, message",
    [
        (dict(kv_cache_gb=0.0), "kv_cache_gb must be a positive number of GB, got 0.0"),
        (dict(kv_cache_gb=-1.0), "kv_cache_gb must be a positive number of GB, got -1.0"),
        (dict(kv_cache_gb=float("inf")), "kv_cache_gb must be a positive number of GB, got inf"),
        (dict(kv_cache_gb=float("nan")), "kv_cache_gb must be a positive number of GB, got nan"),
        (dict(kv_cache_memory_fraction=0.0), "kv_cache_memory_fraction is a share of the free memory, in (0, 1]"),
        (dict(kv_cache_memory_fraction=1.5), "in (0, 1], got 1.5"),
        (dict(kv_cache_memory_fraction=float("nan")), "in (0, 1], got nan"),
    ],
    ids=["gb_zero", "gb_negative", "gb_inf", "gb_nan", "fraction_zero", "fraction_above_one", "fraction_nan"],
)
def test_bad_budget_values_are_refused_before_anything_is_built(qwen3_model, monkeypatch, budget, message):
    monkeypatch.setattr(qwen3_flex_inference, "kv_pool_pages", None)  # calling it would raise TypeError
    with pytest.raises(FlexInferenceError) as info:
        build_qwen3(qwen3_model, **budget)
    assert_one_sentence(str(info.value), message)


# ---------------------------------------------------------------------------------------------
# The CLI
# ---------------------------------------------------------------------------------------------

LIMITS = QUICK_CLI_ARGS  # its --max_seq_length and --page_size are MAX_SEQ_LENGTH and PAGE_SIZE


# tiny Qwen3: 2 layers x K and V x 2 KV heads x head_dim 16 x float32 bytes x page_size tokens
QWEN3_PAGE_BYTES = 2 * 2 * 2 * 16 * 4 * PAGE_SIZE


def cli_argv(tiny_dir, *extra):
    return ["--model_name", str(tiny_dir / "qwen3"), *LIMITS, *extra]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--n_pages", "64", "--kv_cache_gb", "1"], "--n_pages and --kv_cache_gb both size the KV pool"),
        (["--n_pages", "64", "--kv_cache_memory_fraction", "0.5"], "--n_pages and --kv_cache_memory_fraction both"),
        (["--kv_cache_gb", "1", "--kv_cache_memory_fraction", "0.5"], "--kv_cache_gb and --kv_cache_memory_fraction"),
        (["--kv_cache_gb", "0"], "--kv_cache_gb must be a positive number of GB, got 0.0"),
        (["--kv_cache_memory_fraction", "1.5"], "--kv_cache_memory_fraction is a share of the free memory, in (0, 1]"),
    ],
    ids=["n_pages_and_gb", "n_pages_and_fraction", "gb_and_fraction", "gb_zero", "fraction_above_one"],
)
def test_cli_refuses_conflicting_or_bad_budget_flags_before_loading(tiny_dir, monkeypatch, flags, message):
    monkeypatch.setattr(qwen3_flex_inference, "load_causal_lm", None)  # calling it would raise TypeError
    assert_one_sentence(exit_message(qwen3_flex_inference, cli_argv(tiny_dir, *flags)), message)


def test_cli_budget_too_small_for_one_sequence_exits_naming_the_flags(tiny_dir):
    page_bytes = QWEN3_PAGE_BYTES
    message = exit_message(qwen3_flex_inference, cli_argv(tiny_dir, "--kv_cache_gb", "0.0001"))
    assert_one_sentence(
        message,
        "a KV budget of 0.0001 GB (--kv_cache_gb 0.0001)",
        f"cannot hold one sequence of --max_seq_length {MAX_SEQ_LENGTH}",
        f"needs {ONE_SEQUENCE_PAGES * page_bytes / 1e9:.3g} GB",
        "raise --kv_cache_gb, or lower --max_seq_length",
    )


def test_cli_gb_budget_sizes_the_pool_and_the_stats_and_summary_report_it(tiny_dir, tmp_path, capsys):
    page_bytes = QWEN3_PAGE_BYTES
    stats_path = tmp_path / "stats.json"
    qwen3_flex_inference.main(
        cli_argv(tiny_dir, "--kv_cache_gb", str(30 * page_bytes / 1e9), "--stats_path", str(stats_path))
    )
    stats = json.loads(stats_path.read_text())
    assert stats["kv_pool_pages"] == {"full_attention": 30}, stats["kv_pool_pages"]
    assert stats["kv_pool_gb"] == pytest.approx(30 * page_bytes / 1e9), stats["kv_pool_gb"]
    out = capsys.readouterr().out
    assert f"KV pool {30 * page_bytes / 1e9:.3g} GB" in out, out


def test_cli_memory_fraction_sizes_the_pool_from_the_free_memory(tiny_dir, tmp_path, monkeypatch):
    page_bytes = QWEN3_PAGE_BYTES
    monkeypatch.setattr(qwen3_flex_inference, "free_memory_bytes", lambda device: 100 * page_bytes)
    stats_path = tmp_path / "stats.json"
    qwen3_flex_inference.main(cli_argv(tiny_dir, "--kv_cache_memory_fraction", "0.2", "--stats_path", str(stats_path)))
    stats = json.loads(stats_path.read_text())
    assert stats["kv_pool_pages"] == {"full_attention": 20}, stats["kv_pool_pages"]
