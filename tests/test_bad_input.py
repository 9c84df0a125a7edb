"""Bad input that used to escape as a traceback, a long wait or a silent success: each now ends the
CLI with one sentence and a non-zero exit (or, in the library, one FlexInferenceError).

Everything runs in this process on the tiny checkpoints and stops before generating; nothing here
touches the network (the hub's reachability is patched, or offline mode set).
"""

import json
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch
from conftest import QUICK_CLI_ARGS, assert_one_sentence, exit_message

import gemma4_flex_inference
import qwen3_flex_inference
from qwen3_flex_inference import FlexInference, FlexInferenceError

LIMITS = QUICK_CLI_ARGS
ROOT = Path(__file__).resolve().parents[1]
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def cli_argv(model_name, *extra):
    return ["--model_name", str(model_name), *LIMITS, *extra]


# ---------------------------------------------------------------------------------------------
# 1. A checkpoint given to the other engine's CLI
# ---------------------------------------------------------------------------------------------


def test_qwen3_checkpoint_given_to_the_gemma4_cli_exits_naming_the_qwen3_cli(tiny_dir):
    model_dir = tiny_dir / "qwen3"
    message = exit_message(gemma4_flex_inference, cli_argv(model_dir))
    assert_one_sentence(message, f"{model_dir} is a qwen3 checkpoint, not Gemma-4", "qwen3_flex_inference.py")


@pytest.mark.parametrize("checkpoint, model_type", [("gemma4", "gemma4"), ("gemma4_text", "gemma4_text")])
def test_gemma4_checkpoint_given_to_the_qwen3_cli_exits_naming_the_gemma4_cli(tiny_dir, checkpoint, model_type):
    model_dir = tiny_dir / checkpoint
    message = exit_message(qwen3_flex_inference, cli_argv(model_dir))
    assert_one_sentence(
        message, f"{model_dir} is a {model_type} checkpoint, not Qwen3/Llama", "gemma4_flex_inference.py"
    )


# ---------------------------------------------------------------------------------------------
# 2. A KV pool or weights that do not fit in memory; the CPU's automatic pool size
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_model(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir / "qwen3", dtype=torch.float32).eval()


def kv_bytes_per_token(model) -> int:
    config = model.config
    return config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 4  # float32


def test_kv_pool_larger_than_the_free_memory_exits_saying_how_many_gb_and_to_lower_n_pages(tiny_dir, monkeypatch):
    monkeypatch.setattr(qwen3_flex_inference, "free_memory_bytes", lambda device: 10**6)
    message = exit_message(qwen3_flex_inference, cli_argv(tiny_dir / "qwen3", "--n_pages", "4096"))
    # tiny Qwen3: 2 layers x K and V x 2 heads x head_dim 16 x 4 bytes = 512 bytes per token
    want_gb = f"{4096 * 16 * 512 / 1e9:.3g} GB"
    assert_one_sentence(
        message, "KV pool", "--n_pages 4096 x --page_size 16", want_gb, "0.001 GB free", "lower --n_pages"
    )


def test_kv_pool_is_checked_before_anything_is_allocated(qwen3_model, monkeypatch):
    monkeypatch.setattr(qwen3_flex_inference, "free_memory_bytes", lambda device: 10**6)
    monkeypatch.setattr(qwen3_flex_inference, "PageTable", None)  # calling it would raise TypeError
    with pytest.raises(FlexInferenceError, match="KV pool") as info:
        FlexInference(qwen3_model, None, max_batch_size=2, max_seq_length=256, n_pages=10**8, page_size=16)
    assert "n_pages" in info.value.params, info.value.params


def test_triton_decode_attention_on_the_cpu_exits_saying_it_needs_cuda_and_flex_runs_everywhere(tiny_dir, qwen3_model):
    message = exit_message(qwen3_flex_inference, cli_argv(tiny_dir / "qwen3", "--decode_attention", "triton"))
    assert_one_sentence(message, "--decode_attention triton needs a CUDA device", "flex runs everywhere")
    engine = FlexInference(qwen3_model, None, max_batch_size=2, max_seq_length=256, n_pages=64, page_size=16)
    assert engine.runner.decode_attention == "flex"  # the CPU default
    with pytest.raises(FlexInferenceError, match="decode_attention must be triton or flex, got 'fast'"):
        FlexInference(qwen3_model, None, max_batch_size=2, max_seq_length=256, n_pages=64, decode_attention="fast")


def test_cli_n_pages_defaults_to_auto():
    args = qwen3_flex_inference.build_arg_parser("unused", "unused").parse_args([])
    assert args.n_pages is None, args.n_pages


def test_auto_n_pages_on_cpu_holds_max_batch_size_sequences_when_memory_allows(qwen3_model):
    engine = FlexInference(qwen3_model, None, max_batch_size=4, max_seq_length=256, n_pages=None, page_size=16)
    got = engine.runner.page_tables["full_attention"].n_pages
    want = 4 * 256 // 16 + 1
    assert got == want, f"{got=} {want=}"
    assert engine.runner.kv_caches[0].k_cache.shape[2] == want * 16, engine.runner.kv_caches[0].k_cache.shape


def test_auto_n_pages_on_cpu_is_cut_to_a_fraction_of_the_free_memory(qwen3_model, monkeypatch):
    page_bytes = 16 * kv_bytes_per_token(qwen3_model)
    free_bytes = 100 * page_bytes
    monkeypatch.setattr(qwen3_flex_inference, "free_memory_bytes", lambda device: free_bytes)
    engine = FlexInference(qwen3_model, None, max_batch_size=32, max_seq_length=256, n_pages=None, page_size=16)
    got = engine.runner.page_tables["full_attention"].n_pages
    want = int(qwen3_flex_inference.CPU_AUTO_MEMORY_FRACTION * free_bytes // page_bytes)
    assert got == want and want < 32 * 256 // 16 + 1, f"{got=} {want=}"


def test_auto_n_pages_keeps_one_sequence_and_refuses_when_even_that_does_not_fit(qwen3_model, monkeypatch):
    monkeypatch.setattr(qwen3_flex_inference, "free_memory_bytes", lambda device: 10)
    with pytest.raises(FlexInferenceError, match=r"n_pages 17 x page_size 16 .* lower n_pages, or max_seq_length"):
        FlexInference(qwen3_model, None, max_batch_size=4, max_seq_length=256, n_pages=None, page_size=16)


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: not enough memory: you tried to allocate 8"
        ),
    ],
    ids=["cuda", "cpu"],
)
def test_weights_out_of_memory_exit_saying_how_many_gb_and_what_lowers_it(tiny_dir, qwen3_model, monkeypatch, error):
    from transformers import AutoModelForCausalLM

    def from_pretrained(*args, **kwargs):
        raise error

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)
    message = exit_message(qwen3_flex_inference, cli_argv(tiny_dir / "qwen3", "--dtype", "float32"))
    num_params = sum(param.numel() for param in qwen3_model.parameters())
    want_gb = f"need about {num_params * 4 / 1e9:.3g} GB as float32"
    assert_one_sentence(message, f"the weights of {tiny_dir / 'qwen3'} {want_gb}", "smaller --dtype", "--load_in_4bit")


def test_other_runtime_errors_while_loading_are_not_taken_for_out_of_memory(tiny_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    def from_pretrained(*args, **kwargs):
        raise RuntimeError("something else broke")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)
    with pytest.raises(RuntimeError, match="something else broke"):
        qwen3_flex_inference.load_causal_lm(str(tiny_dir / "qwen3"), torch.float32, torch.device("cpu"))


# ---------------------------------------------------------------------------------------------
# 3. A LoRA adapter made for another model
# ---------------------------------------------------------------------------------------------


def save_qwen3_adapter(tiny_dir, folder, **config_changes):
    """A LoRA adapter (the tiny adapters' targets) trained, so to speak, on the tiny Qwen3 with
    `config_changes`; saved as PEFT saves it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config_dict = json.loads((tiny_dir / "qwen3" / "config.json").read_text())
    config_dict.pop("layer_types", None)  # derived from num_hidden_layers again
    config = AutoConfig.for_model(**{**config_dict, **config_changes})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    lora_config = LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, lora_dropout=0.0, task_type="CAUSAL_LM")
    get_peft_model(model, lora_config).save_pretrained(folder)
    return folder


def test_adapter_with_other_shapes_exits_naming_the_module_and_shapes(tiny_dir, tmp_path):
    adapter = save_qwen3_adapter(tiny_dir, tmp_path / "narrow", hidden_size=32)
    message = exit_message(qwen3_flex_inference, cli_argv(tiny_dir / "qwen3", "--lora_adapter", str(adapter)))
    # the first weight PEFT saves is layer 0's down_proj: lora_B [out_features 32, r 4] against 64 here
    assert_one_sentence(
        message,
        f"the adapter at {adapter} does not fit this model",
        "model.layers.0.mlp.down_proj.lora_B has shape (32, 4)",
        "maps 128 features to 64 here",
    )


def test_adapter_for_a_deeper_model_exits_naming_a_module_the_model_lacks(tiny_dir, tmp_path):
    adapter = save_qwen3_adapter(tiny_dir, tmp_path / "deeper", num_hidden_layers=3)
    message = exit_message(qwen3_flex_inference, cli_argv(tiny_dir / "qwen3", "--lora_adapter", str(adapter)))
    assert_one_sentence(message, "does not fit this model", "it adapts model.layers.2.", "which the model lacks")


def test_adapter_for_a_shallower_model_exits_naming_a_module_it_has_no_weights_for(tiny_dir, tmp_path):
    adapter = save_qwen3_adapter(tiny_dir, tmp_path / "shallower", num_hidden_layers=1)
    message = exit_message(qwen3_flex_inference, cli_argv(tiny_dir / "qwen3", "--lora_adapter", str(adapter)))
    assert_one_sentence(
        message, "does not fit this model", "its target_modules select model.layers.1.", "no weights for"
    )


def test_qwen3_adapter_given_to_the_gemma4_cli_exits_saying_it_does_not_fit(tiny_dir):
    adapter = tiny_dir / "qwen3" / "lora"
    message = exit_message(gemma4_flex_inference, cli_argv(tiny_dir / "gemma4_text", "--lora_adapter", str(adapter)))
    assert_one_sentence(message, f"the adapter at {adapter} does not fit this model", "no weights for")


def test_multimodal_gemma4_adapter_with_other_shapes_exits_naming_the_module_and_shapes(tiny_dir, tmp_path):
    # The multimodal adapter's weights are renamed onto the text shell; the k_eq_v model's full
    # attention layers have half as many KV features.
    adapter = tmp_path / "multimodal_lora"
    shutil.copytree(tiny_dir / "gemma4" / "lora", adapter)
    argv = cli_argv(tiny_dir / "gemma4_text_keqv", "--lora_adapter", str(adapter))
    message = exit_message(gemma4_flex_inference, argv)
    assert_one_sentence(message, "does not fit this model", "k_proj.lora_B has shape", "features to")


def test_matching_adapter_still_loads(tiny_dir, qwen3_model):
    import copy

    peft_model = qwen3_flex_inference.load_lora(copy.deepcopy(qwen3_model), str(tiny_dir / "qwen3" / "lora"))
    num_lora_weights = sum("lora_" in name for name, _ in peft_model.named_parameters())
    assert num_lora_weights == 2 * 7 * qwen3_model.config.num_hidden_layers, num_lora_weights


# ---------------------------------------------------------------------------------------------
# 5. A hub id that is neither local nor cached, with the hub out of reach
# ---------------------------------------------------------------------------------------------

UNKNOWN_HUB_ID = "no-such-org/no-such-model-for-flex-rollouts"


def test_unknown_hub_id_with_the_hub_unreachable_exits_at_once_with_one_sentence(monkeypatch):
    monkeypatch.setattr(qwen3_flex_inference, "hub_unreachable_reason", lambda: "no network in this test")
    message = exit_message(qwen3_flex_inference, cli_argv(UNKNOWN_HUB_ID))
    assert_one_sentence(
        message,
        f"{UNKNOWN_HUB_ID} is not a local folder and not in the Hugging Face cache, and the hub cannot be reached",
        "no network in this test",
    )


def test_hf_hub_offline_makes_the_hub_unreachable_without_opening_a_socket(monkeypatch):
    def create_connection(*args, **kwargs):
        raise AssertionError("offline mode opened a connection")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(socket, "create_connection", create_connection)
    message = exit_message(gemma4_flex_inference, cli_argv(UNKNOWN_HUB_ID))
    assert_one_sentence(message, "not in the Hugging Face cache", "(HF_HUB_OFFLINE is set)")


def test_hub_reachability_is_a_connection_with_a_timeout(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "https://huggingface.co")
    for name in ("https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    calls = []

    def create_connection(address, timeout=None):
        calls.append((address, timeout))
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(socket, "create_connection", create_connection)
    reason = qwen3_flex_inference.hub_unreachable_reason()
    assert calls == [(("huggingface.co", 443), 2.0)], calls
    assert reason == "no connection to huggingface.co:443: Network is unreachable", reason


def test_hub_id_in_the_cache_passes_the_check_while_offline(monkeypatch, tmp_path):
    from huggingface_hub import constants

    snapshot = tmp_path / ("models--" + UNKNOWN_HUB_ID.replace("/", "--"))
    (snapshot / "refs").mkdir(parents=True)
    (snapshot / "refs" / "main").write_text("0" * 40)
    (snapshot / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (snapshot / "snapshots" / ("0" * 40) / "config.json").write_text("{}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(qwen3_flex_inference, "hub_unreachable_reason", lambda: "no network in this test")
    qwen3_flex_inference.check_model_path(UNKNOWN_HUB_ID)  # no error: transformers finds it in the cache


# ---------------------------------------------------------------------------------------------
# 6. --help
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("module", [qwen3_flex_inference, gemma4_flex_inference], ids=["qwen3", "gemma4"])
def test_help_says_what_each_default_means_for_no_skinny_gemms_fa4_prefill_and_n_pages(module, capsys):
    with pytest.raises(SystemExit) as info:
        module.main(["--help"])
    assert info.value.code == 0, info.value.code
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere

    def flag_help(flag: str, next_flag: str) -> str:
        start = help_text.index(flag + " ", help_text.index("options:"))
        return help_text[start : help_text.index(next_flag, start)]

    skinny = flag_help("--no_skinny_gemms", "--lora_adapter")
    assert "(default: True)" not in skinny and "default: off" in skinny, skinny
    fa4 = flag_help("--fa4_prefill,", "--decode_kernel_options")
    assert "(default: None)" not in fa4 and "default: auto" in fa4, fa4
    n_pages = flag_help("--n_pages N_PAGES", "--page_size")
    assert "(default: None)" not in n_pages and "default: auto" in n_pages and "on the CPU" in n_pages, n_pages


# ---------------------------------------------------------------------------------------------
# 7. A prompts file line that is not a prompt
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "line, keyword",
    [
        ("42", "is JSON but neither an object nor a string: 42"),
        ("[1, 2]", "is JSON but neither an object nor a string: [1, 2]"),
        ("null", "is JSON but neither an object nor a string: null"),
        ('{"prompt": 5}', "has a prompt that is not a string: 5"),
        ('{"text": ["hi"]}', 'has a text that is not a string: ["hi"]'),
        ('{"messages": "hello"}', 'has messages that are not a non-empty list of {"role": ..., "content": ...}'),
        ('{"messages": []}', "has messages that are not a non-empty list"),
        ('{"messages": ["hello"]}', 'has message 1 that is not an object with a role and a content: "hello"'),
        ('{"messages": [{"role": "user"}]}', 'has message 1 without a string content: {"role": "user"}'),
        (
            '{"messages": [{"role": "system", "content": "x"}, {"content": "hi"}]}',
            "has message 2 without a string role",
        ),
        ('{"messages": [{"role": 1, "content": "hi"}]}', "has message 1 without a string role"),
        ('{"messages": [{"role": "user", "content": ["hi"]}]}', "has message 1 without a string content"),
    ],
)
def test_prompts_file_line_that_is_not_a_prompt_exits_naming_the_file_and_line(tiny_dir, tmp_path, line, keyword):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "What is 2 + 2?"}\n' + line + "\n")
    message = exit_message(qwen3_flex_inference, cli_argv(tiny_dir / "qwen3", "--prompts_file", str(prompts)))
    assert_one_sentence(message, f"line 2 of {prompts} {keyword}")


def test_prompts_file_lines_are_numbered_as_in_the_file_blank_lines_included(tiny_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('\n{"prompt": "What is 2 + 2?"}\n\n   \n{"prompt": \n')
    message = exit_message(qwen3_flex_inference, cli_argv(tiny_dir / "qwen3", "--prompts_file", str(prompts)))
    assert_one_sentence(message, f"line 5 of {prompts} is not valid JSON")


def test_prompts_file_that_is_a_folder_or_not_text_exits_saying_so(tiny_dir, tmp_path):
    message = exit_message(qwen3_flex_inference, cli_argv(tiny_dir / "qwen3", "--prompts_file", str(tmp_path)))
    assert_one_sentence(message, f"prompts file {tmp_path} is a folder")
    binary = tmp_path / "prompts.txt"
    binary.write_bytes(b"What is 2 + 2?\n\xff\xfe\x00\x01")
    message = exit_message(qwen3_flex_inference, cli_argv(tiny_dir / "qwen3", "--prompts_file", str(binary)))
    assert_one_sentence(message, f"prompts file {binary} is not UTF-8 text (byte 15 is 0xff)")


def test_prompts_file_records_of_each_accepted_form_are_still_read(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    turns = [{"role": "system", "content": ""}, {"role": "user", "content": "a turn", "name": "extra keys pass"}]
    records = ["a bare string", {"prompt": "a prompt", "text": "unused"}, {"text": "a text"}, {"messages": turns}]
    prompts.write_text("\n".join(json.dumps(record) for record in records) + "\n")
    got = qwen3_flex_inference.read_prompts(str(prompts), 5)
    want = ["a bare string", "a prompt", "a text", turns, "a bare string"]
    assert got == want, f"{got=} {want=}"


# ---------------------------------------------------------------------------------------------
# 8. A --model_name folder without config.json; a --lora_adapter that is not an adapter
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def loading_fails(monkeypatch):
    """The Qwen3 CLI's loader raises: a test that exits through it checked its input too late."""

    def load_qwen3_llama(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(qwen3_flex_inference, "load_qwen3_llama", load_qwen3_llama)


def copy_adapter(tiny_dir, folder, base_model_name_or_path):
    shutil.copytree(tiny_dir / "qwen3" / "lora", folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(
        json.dumps({**config, "base_model_name_or_path": base_model_name_or_path})
    )
    return folder


@pytest.mark.parametrize("module", [qwen3_flex_inference, gemma4_flex_inference], ids=["qwen3", "gemma4"])
def test_adapter_folder_as_model_name_exits_saying_to_pass_it_as_lora_adapter_beside_its_base_model(
    tiny_dir, tmp_path, module
):
    # A folder named like the flag: the flag's name inside the path stays as it is.
    adapter = copy_adapter(tiny_dir, tmp_path / "lora_adapter", "unsloth/Qwen3-4B-Base")
    message = exit_message(module, cli_argv(adapter))
    assert_one_sentence(
        message,
        f"{adapter} is a LoRA adapter, not a model",
        "pass its base model unsloth/Qwen3-4B-Base as --model_name and it as --lora_adapter",
    )


@pytest.mark.parametrize("module", [qwen3_flex_inference, gemma4_flex_inference], ids=["qwen3", "gemma4"])
def test_adapter_folder_that_names_no_base_model_as_model_name_exits_saying_to_pass_its_base_model(tiny_dir, module):
    adapter = tiny_dir / "qwen3" / "lora"  # base_model_name_or_path null
    message = exit_message(module, cli_argv(adapter))
    assert_one_sentence(
        message,
        f"{adapter} is a LoRA adapter, not a model",
        "pass the base model it was trained on as --model_name and it as --lora_adapter",
    )


@pytest.mark.parametrize("module", [qwen3_flex_inference, gemma4_flex_inference], ids=["qwen3", "gemma4"])
def test_folder_of_model_folders_as_model_name_exits_naming_two_of_them(tiny_dir, module):
    message = exit_message(module, cli_argv(tiny_dir))
    assert_one_sentence(
        message,
        f"{tiny_dir} has no config.json but holds model folders, such as {tiny_dir / 'gemma4'} and "
        f"{tiny_dir / 'gemma4_text'}: pass one of them",
    )


def test_folder_without_config_json_or_models_as_model_name_exits_saying_it_has_no_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    for argv in (cli_argv(tmp_path), cli_argv(tmp_path, "--load_format", "dummy")):
        message = exit_message(qwen3_flex_inference, argv)
        assert_one_sentence(message, f"{tmp_path} has no config.json, so it is not a checkpoint folder")


def test_file_as_model_name_exits_saying_to_pass_its_folder(tiny_dir):
    config = tiny_dir / "qwen3" / "config.json"
    message = exit_message(qwen3_flex_inference, cli_argv(config))
    assert_one_sentence(message, f"model path {config} is a file: pass the checkpoint folder that holds config.json")


@pytest.mark.parametrize(
    "adapter, keyword",
    [
        ("llama", "is a model, not a LoRA adapter (it has config.json but no adapter_config.json)"),
        ("", "has no adapter_config.json, so it is not a PEFT LoRA adapter folder"),
        ("qwen3/lora/adapter_config.json", "is a file: pass the adapter's folder"),
    ],
    ids=["model", "folder", "file"],
)
def test_lora_adapter_that_is_not_an_adapter_folder_exits_before_loading_saying_what_it_is(
    tiny_dir, loading_fails, adapter, keyword
):
    adapter = tiny_dir / adapter
    message = exit_message(qwen3_flex_inference, cli_argv(tiny_dir / "qwen3", "--lora_adapter", str(adapter)))
    assert_one_sentence(message, f"{adapter} {keyword}")


def test_cli_message_writes_parameters_as_flags_but_leaves_paths_alone():
    error = FlexInferenceError(
        "pass runs/lora_adapter as lora_adapter, not ./model_name.json as model_name", "lora_adapter", "model_name"
    )
    got = qwen3_flex_inference.cli_message(error, {"lora_adapter": None, "model_name": None})
    want = "pass runs/lora_adapter as --lora_adapter, not ./model_name.json as --model_name"
    assert got == want, f"{got=} {want=}"


# ---------------------------------------------------------------------------------------------
# 9. A --stats_path that cannot be written, found before any work
# ---------------------------------------------------------------------------------------------


def test_stats_path_that_is_a_folder_exits_before_loading_saying_to_name_a_file(tiny_dir, tmp_path, loading_fails):
    message = exit_message(qwen3_flex_inference, cli_argv(tiny_dir / "qwen3", "--stats_path", str(tmp_path)))
    assert_one_sentence(message, f"--stats_path {tmp_path} is a folder: name a file, such as {tmp_path / 'stats.json'}")


def test_stats_path_under_a_file_exits_before_loading_saying_it_cannot_be_created(tiny_dir, tmp_path, loading_fails):
    (tmp_path / "runs").write_text("a file where a folder would go")
    stats_path = tmp_path / "runs" / "today" / "stats.json"
    message = exit_message(qwen3_flex_inference, cli_argv(tiny_dir / "qwen3", "--stats_path", str(stats_path)))
    assert_one_sentence(message, f"--stats_path {stats_path} cannot be created: {tmp_path / 'runs'} is a file")


def test_stats_path_in_a_read_only_folder_exits_before_loading(tiny_dir, tmp_path, loading_fails, monkeypatch):
    folder = tmp_path / "read_only"
    folder.mkdir(mode=0o555)
    if os.geteuid() == 0:  # root may write anywhere: access() answers as it would for another user
        access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode: access(path, mode) and Path(path) != folder)
    stats_path = folder / "new" / "stats.json"
    message = exit_message(qwen3_flex_inference, cli_argv(tiny_dir / "qwen3", "--stats_path", str(stats_path)))
    assert_one_sentence(message, f"--stats_path {stats_path} cannot be written: {folder} is read-only to this user")


def test_stats_that_cannot_be_written_after_the_run_raise_one_sentence(tmp_path):
    with pytest.raises(FlexInferenceError, match=f"could not write --stats_path {tmp_path}: Is a directory"):
        qwen3_flex_inference.write_stats({"n_prompts": 1}, str(tmp_path))


# ---------------------------------------------------------------------------------------------
# 10. A dummy build that takes minutes says what it builds first
# ---------------------------------------------------------------------------------------------


class BuildStarted(Exception):
    """Raised where the random weights would be built."""


def test_dummy_build_of_the_default_gemma4_says_its_size_before_building_unless_quiet(monkeypatch, capsys):
    from transformers import AutoModelForCausalLM

    from_config = AutoModelForCausalLM.from_config

    def build_only_on_meta(config, **kwargs):  # parameters are counted on the meta device, at no cost
        if torch.get_default_device().type != "meta":
            raise BuildStarted
        return from_config(config, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_config", build_only_on_meta)
    argv = [*LIMITS, "--load_format", "dummy"]
    with pytest.raises(BuildStarted):
        gemma4_flex_inference.main([arg for arg in argv if arg != "--quiet"])
    err = capsys.readouterr().err
    # The E2B preset's text model: 4.63B parameters (its per-layer embeddings included), 4 bytes each.
    want = "building unsloth/gemma-4-E2B-it's architecture with random weights (4.63B parameters, 18.5 GB as float32)"
    assert err.strip().splitlines() == [f"{want} on cpu"], err
    with pytest.raises(BuildStarted):
        gemma4_flex_inference.main(argv)
    err = capsys.readouterr().err
    assert err == "", err


# ---------------------------------------------------------------------------------------------
# The library's prompts and models: one FlexInferenceError before any work
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_engine(tiny_dir, qwen3_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "qwen3")
    return FlexInference(qwen3_model, tokenizer, max_batch_size=2, max_seq_length=256, n_pages=64, page_size=16)


@pytest.mark.parametrize(
    "prompt, keywords",
    [
        (5, ("prompt 0 is int", "give a string, a chat")),
        (None, ("prompt 0 is NoneType",)),
        ([1.5, 2.0], ("prompt 0 is list", "token ids")),
        ([{"role": "user"}], ("prompt 0 holds the message", "string role and content")),
        ([{"role": "user", "content": 5}], ("prompt 0 holds the message",)),
        ([3, 10**6], ("token ids from 3 to 1000000", "outside the vocabulary")),
        ([-1, 3], ("token ids from -1 to 3", "outside the vocabulary")),
        ([], ("has no tokens",)),
    ],
    ids=[
        "int",
        "none",
        "floats",
        "chat_without_content",
        "chat_content_not_text",
        "id_too_big",
        "negative_id",
        "empty",
    ],
)
def test_a_prompt_that_is_not_text_a_chat_or_token_ids_is_refused_with_one_sentence(qwen3_engine, prompt, keywords):
    with pytest.raises(FlexInferenceError) as info:
        qwen3_engine.generate([prompt, [5, 6, 7]])
    assert_one_sentence(str(info.value), *keywords)
    with pytest.raises(FlexInferenceError) as info:
        qwen3_engine.rollouts([prompt], qwen3_flex_inference.SamplingParams(n=2))
    assert_one_sentence(str(info.value), *keywords)


def test_text_or_a_chat_without_a_tokenizer_or_chat_template_is_refused_with_one_sentence(qwen3_model):
    engine = FlexInference(qwen3_model, None, max_batch_size=2, max_seq_length=256, n_pages=64, page_size=16)
    with pytest.raises(FlexInferenceError) as info:
        engine.generate(["hi"])
    assert_one_sentence(str(info.value), "no tokenizer", "token ids")

    class NoTemplate:
        chat_template = None

    engine.tokenizer = NoTemplate()
    with pytest.raises(FlexInferenceError) as info:
        engine.rollouts([[{"role": "user", "content": "hi"}]], qwen3_flex_inference.SamplingParams(n=2))
    assert_one_sentence(str(info.value), "no chat template")


def test_refresh_lora_without_a_peft_model_is_refused_with_one_sentence(qwen3_engine):
    with pytest.raises(FlexInferenceError) as info:
        qwen3_engine.refresh_lora()
    assert_one_sentence(str(info.value), "no LoRA adapter", "peft_model=", "load_weights")


def test_a_trainers_own_model_is_refused_only_where_the_engine_would_rewrite_it(tiny_dir):
    """Zero copy runs the trainer's own PEFT model (tests/test_zero_copy.py); merging the adapter into
    it would rewrite the trainer's weights: refused in one sentence before anything changes. A full
    model (every weight trained) the engine fused is refused at the trainer's first sync."""
    from conftest import load_hf
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(load_hf(tiny_dir / "qwen3"), LoraConfig(r=4, target_modules=LORA_TARGETS))
    weights = {name: p.data_ptr() for name, p in policy.named_parameters()}
    limits = dict(max_batch_size=2, max_seq_length=256, n_pages=64, page_size=16)
    with pytest.raises(FlexInferenceError) as info:
        FlexInference(policy, None, peft_model=policy, **limits, merge_lora=True)
    assert_one_sentence(str(info.value), "trainer's own model", "merge_lora", "a copy of the model of its own")
    assert {name: p.data_ptr() for name, p in policy.named_parameters()} == weights, "a weight was rewritten"
    assert not [name for name, module in policy.named_modules() if "forward" in module.__dict__], "a module patched"

    full_model = load_hf(tiny_dir / "qwen3")
    engine = FlexInference(full_model, None, fuse_projections=True, **limits)
    with pytest.raises(FlexInferenceError) as info:
        qwen3_flex_inference.sync_trainer_weights(engine, full_model)
    assert_one_sentence(str(info.value), "trainer's own model", "fused projections")


def test_fused_projections_refuse_an_adapter_the_engine_was_not_given(tiny_dir):
    """A PEFT model as model= without peft_model=: fused GEMMs would skip its adapter, so it is refused."""
    from conftest import load_hf
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(load_hf(tiny_dir / "qwen3"), LoraConfig(r=4, target_modules=LORA_TARGETS))
    with pytest.raises(FlexInferenceError) as info:
        FlexInference(
            policy, None, max_batch_size=2, max_seq_length=256, n_pages=64, page_size=16, fuse_projections=True
        )
    assert_one_sentence(str(info.value), "fuse_projections would skip an adapter", "peft_model=")


def test_a_long_prompt_gets_the_engines_sentence_and_no_tokenizer_warning(qwen3_engine, capfd, monkeypatch):
    text = "word " * 5000
    monkeypatch.setattr(qwen3_engine.tokenizer, "model_max_length", 64)
    with pytest.raises(FlexInferenceError) as info:
        qwen3_engine.generate([text])
    assert_one_sentence(str(info.value), "max_seq_length is 256")
    captured = capfd.readouterr()
    assert "Token indices sequence length" not in captured.err + captured.out, captured.err[-500:]


def test_importing_the_engine_then_peft_prints_no_bitsandbytes_kernels_notice():
    import subprocess
    import sys

    probe = "import qwen3_flex_inference, peft, bitsandbytes"
    run = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "kernels" not in run.stderr, run.stderr[-2000:]


@pytest.mark.parametrize("value", ["inf", "nan", "-1"])
def test_cli_temperature_that_is_not_a_finite_number_of_at_least_0_exits_naming_the_flag(
    tiny_dir, value, loading_fails
):
    message = exit_message(qwen3_flex_inference, cli_argv(tiny_dir / "qwen3", "--temperature", value))
    assert_one_sentence(message, "--temperature must be a finite number")
