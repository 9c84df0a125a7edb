"""GPU-only checks (skipped without CUDA): exact float32 tokens eager and under CUDA graphs,
bf16 Gemma-4-E2B-shaped decode where eager and graph decode must agree, the bf16 logit error of the
fastest decode mode against HF bf16's, and the skinny decode GEMM
(every Triton config against fp64, skinny_linear's bits eager and replayed). Run by scripts/gpu_check.sh."""

import copy
import json

import pytest
import torch
from conftest import FIRST_TEXT_ID, ROOT, load_hf, random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MAX_NEW_TOKENS = 24


def engine_class(name):
    if name.startswith("gemma4"):
        from gemma4_flex_inference import FlexGemma4Inference

        return FlexGemma4Inference
    from qwen3_flex_inference import FlexInference

    return FlexInference


@pytest.mark.parametrize(
    "options", [{}, {"compile_decode": True, "fuse_projections": True}], ids=["plain", "compiled_fused"]
)
@pytest.mark.parametrize("name", ["qwen3", "llama", "gemma4_text"])
def test_float32_tokens_match_hf_eager_and_with_cuda_graphs(tiny_dir, name, options):
    from qwen3_flex_inference import Sequence

    torch.backends.cuda.matmul.allow_tf32 = False
    path = tiny_dir / name
    hf = load_hf(path).cuda()
    prompts = random_prompts([5, 70, 17, 33, 48, 3, 90, 21, 120, 8], hf.config.vocab_size, seed=7)
    engine = engine_class(name)(
        load_hf(path).cuda(),
        None,
        max_batch_size=8,
        max_seq_length=256,
        n_pages=24,
        page_size=16,
        max_new_tokens=MAX_NEW_TOKENS,
        **options,
    )
    want = []
    for ids in prompts:  # HF reference on the GPU, float32, no KV cache
        want.append(_rollout_cuda(hf, ids, engine.end_ids))
    for use_graph in (False, True):
        sequences = engine.generate([Sequence(input_ids=ids) for ids in prompts], capture_cudagraph=use_graph)
        for i, (seq, w) in enumerate(zip(sequences, want)):
            assert seq.output_ids == w, f"{name} {use_graph=} {options=} prompt {i}: {seq.output_ids=} {w=}"
    assert sum(seq.num_preemptions for seq in sequences) > 0, "expected the small pool to force preemption"


def test_prefill_attention_compiles_once_for_every_packed_length_on_cuda(tiny_dir):
    """tests/test_qwen3_llama_engine.py's check on the GPU: one compiled prefill kernel for packed
    rows of 256, 384 and 512 tokens, float32 tokens equal HF's on the GPU."""
    from conftest import assert_prefill_attention_compiles_once

    assert_prefill_attention_compiles_once(tiny_dir / "qwen3", "cuda")


@pytest.mark.parametrize("name", ["qwen3", "llama", "gemma4", "gemma4_text"])
def test_4bit_float32_compute_tokens_match_hf_peft_4bit_eager_and_with_cuda_graphs_compiled(tiny_dir, name):
    """NF4 weights with a float32 compute dtype and the tiny LoRA adapter unmerged: the engine's
    tokens equal HF's own 4-bit model with PEFT's 4-bit LoRA layers (the adapter the engine takes),
    eager and with the compiled step under CUDA graphs; a refresh after changing the adapter is
    followed without recapturing a graph."""
    pytest.importorskip("bitsandbytes")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, Gemma4ForConditionalGeneration

    from gemma4_flex_inference import load_gemma4
    from qwen3_flex_inference import Sequence, load_qwen3_llama, nf4_config

    torch.backends.cuda.matmul.allow_tf32 = False
    path, device = tiny_dir / name, torch.device("cuda")
    model_class = Gemma4ForConditionalGeneration if name == "gemma4" else AutoModelForCausalLM
    hf = model_class.from_pretrained(
        path,
        dtype=torch.float32,
        attn_implementation="eager",
        quantization_config=nf4_config(torch.float32),
        device_map={"": 0},
    )
    reference = PeftModel.from_pretrained(hf, path / "lora").eval()
    load = load_gemma4 if name.startswith("gemma4") else load_qwen3_llama
    limits = dict(max_batch_size=8, max_seq_length=256, n_pages=64, page_size=16, max_new_tokens=MAX_NEW_TOKENS)
    engines = [  # eager decode; the compiled step under CUDA graphs
        engine_class(name)(
            load(str(path), torch.float32, device, load_in_4bit=True),
            None,
            peft_model=reference,
            compile_decode=compiled,
            **limits,
        )
        for compiled in (False, True)
    ]
    prompts = random_prompts(
        [5, 70, 17, 33, 48], reference.config.get_text_config().vocab_size, seed=7, low=FIRST_TEXT_ID
    )
    for step in range(2):
        want = [_rollout_cuda(reference, ids, engines[0].end_ids) for ids in prompts]
        for engine, use_graph in ((engines[0], False), (engines[1], True)):
            sequences = [Sequence(input_ids=ids) for ids in prompts]
            got = [s.output_ids for s in engine.generate(sequences, capture_cudagraph=use_graph)]
            assert got == want, f"{name} {use_graph=} {step=}"
        if step == 0:
            graphs = dict(engines[1].runner.cuda_graphs)  # (bucket, mode) -> the captured graph and its buffers
        with torch.no_grad():  # the trainer's optimizer step, in effect
            for param_name, param in reference.named_parameters():
                if "lora_B" in param_name:
                    param.add_(torch.randn_like(param) * 0.5)
        for engine in engines:
            engine.refresh_lora()
    assert engines[1].runner.cuda_graphs == graphs, "a refresh recaptured a graph"


def _rollout_cuda(model, ids, end_ids):
    tokens = list(ids)
    for _ in range(MAX_NEW_TOKENS):
        with torch.no_grad():
            next_id = int(model(torch.tensor([tokens], device="cuda")).logits[0, -1].argmax())
        tokens.append(next_id)
        if next_id in end_ids:
            break
    return tokens[len(ids) :]


@pytest.mark.parametrize(
    "preset, batch_size",
    [("unsloth__gemma-4-E2B-it", 1), ("unsloth__gemma-4-E2B-it", 64), ("unsloth__Qwen3-4B-Base", 64)],
)
def test_bf16_dummy_model_eager_and_graph_decode_agree(preset, batch_size):
    """Real architecture (E2B: head_dim 256 and 512), random weights, default kernel options."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from qwen3_flex_inference import Sequence

    config = AutoConfig.for_model(**json.loads((ROOT / f"scripts/presets/{preset}.json").read_text()))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    cls = engine_class("gemma4" if "gemma" in preset else "qwen3")
    engine = cls(model, None, max_batch_size=64, max_seq_length=1024, n_pages=1024, page_size=128, max_new_tokens=64)
    engine.end_ids = set()  # random weights: run every sequence the full length
    prompts = random_prompts([128] * batch_size, config.vocab_size, seed=8)
    eager = [s.output_ids for s in engine.generate([Sequence(input_ids=ids) for ids in prompts])]
    graph = [
        s.output_ids for s in engine.generate([Sequence(input_ids=ids) for ids in prompts], capture_cudagraph=True)
    ]
    assert all(len(o) == 64 for o in eager)
    assert eager == graph


def test_bf16_decode_logit_error_of_the_fastest_mode_at_most_1_2x_hf_bf16():
    """E2B architecture, random float32 weights as the reference. The engine's fastest decode mode
    (compiled step, fused projections, skinny GEMMs, CUDA graphs) in bf16 against HF bf16 on the
    same rounded weights: each one's relative logit error against float32 HF, on the same tokens
    (the engine's decode logits; HF teacher-forced on the sequences the engine produced)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from gemma4_flex_inference import FlexGemma4Inference
    from qwen3_flex_inference import Sequence

    torch.backends.cuda.matmul.allow_tf32 = False
    config = AutoConfig.for_model(**json.loads((ROOT / "scripts/presets/unsloth__gemma-4-E2B-it.json").read_text()))
    torch.manual_seed(0)
    with torch.device("cuda"):
        reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    hf_bf16 = copy.deepcopy(reference).to(torch.bfloat16)
    engine = FlexGemma4Inference(
        copy.deepcopy(hf_bf16),
        None,
        max_batch_size=4,
        max_seq_length=1024,
        n_pages=64,
        page_size=128,
        max_new_tokens=16,
        compile_decode=True,
        fuse_projections=True,
    )
    engine.end_ids = set()
    prompts = random_prompts([100, 37, 600, 250], config.vocab_size, seed=21)
    sequences = engine.generate(
        [Sequence(input_ids=ids, record_logits=True) for ids in prompts], capture_cudagraph=True
    )
    for i, seq in enumerate(sequences):
        tokens = torch.tensor([seq.token_ids], device="cuda")
        decode_rows = slice(len(seq.input_ids), len(seq.token_ids) - 1)  # logits that sampled tokens 2..16
        with torch.no_grad():
            want = reference(tokens).logits[0, decode_rows].float()
            hf_got = hf_bf16(tokens).logits[0, decode_rows].float()
        engine_got = torch.stack(seq.output_logits[1:]).to("cuda", torch.float32)  # the first comes from prefill
        hf_err = ((hf_got - want).norm() / want.norm()).item()
        engine_err = ((engine_got - want).norm() / want.norm()).item()
        assert engine_err <= 1.2 * hf_err, f"prompt {i}: {engine_err=:.3e} {hf_err=:.3e}"


@pytest.mark.parametrize("num_rows", [64, 72], ids=["raced", "above_the_race"])
def test_compiled_decode_multiplies_no_weight_once_per_row(num_rows):
    """E2B architecture, bf16, the compiled step with fused projections: no decode GEMM runs as a
    batched GEMM of one row per batch entry (aten::bmm [rows, 1, K] x [rows, K, N], the weight read
    once per row), whichever backend serves it: the race's picks at 64 rows, cuBLAS above them. The
    compiled step hands o_proj its input with the size-1 dim strided, which F.linear does not fold."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from gemma4_flex_inference import FlexGemma4Inference
    from qwen3_flex_inference import Sequence

    config = AutoConfig.for_model(**json.loads((ROOT / "scripts/presets/unsloth__gemma-4-E2B-it.json").read_text()))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    engine = FlexGemma4Inference(
        model, None, max_batch_size=num_rows, max_seq_length=128, page_size=128, max_new_tokens=4,
        compile_decode=True, fuse_projections=True,
    )  # fmt: skip
    engine.end_ids = set()
    prompts = random_prompts([16] * num_rows, config.vocab_size, seed=3)
    engine.generate([Sequence(input_ids=ids) for ids in prompts])  # compiles, races
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        engine.generate([Sequence(input_ids=ids) for ids in prompts])
    events = prof.key_averages(group_by_input_shape=True)
    per_row = [
        shapes
        for shapes in (event.input_shapes for event in events if event.key == "aten::bmm")
        if len(shapes[0]) == 3 and shapes[0][0] > 1 and shapes[0][1] == 1 and shapes[1][0] == shapes[0][0]
    ]
    assert not per_row, f"batched GEMMs of one row per batch entry: {per_row}"
    assert any(event.key == "aten::mm" for event in events), "no GEMM was profiled"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_skinny_gemv_configs_match_fp64_and_skinny_linear_is_deterministic_under_cuda_graphs(dtype):
    """Every Triton GEMV config compiles and matches an fp64 reference (in float32 a config may
    only fail for lack of shared memory); skinny_linear then races, and gives the same bits on
    every call and replayed from a CUDA graph."""
    from triton.runtime.errors import OutOfResources

    from qwen3_flex_inference import (
        SKINNY_CHOICES,
        SKINNY_CONFIGS,
        skinny_block_rows,
        skinny_linear,
        skinny_matmul_triton,
    )

    max_rel_err = 1e-2 if dtype == torch.bfloat16 else 1e-5  # ||out - ref|| / ||ref||
    generator = torch.Generator(device="cuda").manual_seed(0)
    # E2B's qkv (sliding), o (sliding), PLE gate and projection; and one off every block size.
    for N, K in [(2560, 1536), (1536, 2048), (256, 1536), (1536, 256), (40, 96)]:
        w_NK = (torch.randn(N, K, device="cuda", generator=generator) / K**0.5).to(dtype)
        for M in (1, 3, 16, 40):  # 40: the 64-row bucket (BLOCK_M 64)
            x_M1K = torch.randn(M, 1, K, device="cuda", generator=generator).to(dtype)
            ref_M1N = x_M1K.double() @ w_NK.double().T
            for idx, config in enumerate(SKINNY_CONFIGS):
                try:
                    out_MN = skinny_matmul_triton(x_M1K.reshape(M, K), w_NK, config)
                except OutOfResources:
                    assert dtype == torch.float32, f"{idx=} {config=} ran out of resources in {dtype}"
                    continue
                rel_err = ((out_MN.double().reshape(ref_M1N.shape) - ref_M1N).norm() / ref_M1N.norm()).item()
                assert rel_err < max_rel_err, f"{N=} {K=} {M=} {idx=} {config=} {rel_err=}"
            got_M1N = skinny_linear(x_M1K, w_NK)
            choice = SKINNY_CHOICES[(N, K, str(dtype).removeprefix("torch."), skinny_block_rows(M))]
            assert torch.equal(skinny_linear(x_M1K, w_NK), got_M1N), f"{N=} {K=} {M=} {choice=}"
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_M1N = skinny_linear(x_M1K, w_NK)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(static_M1N, got_M1N), f"{N=} {K=} {M=} {choice=}"


def test_skinny_pick_saved_by_one_process_is_read_by_the_next_without_a_race(tmp_path, monkeypatch):
    """A race's pick goes to the cache folder; a process starting afresh (its picks and the file's
    contents forgotten) reads it back with no race, and computes the same bits."""
    import qwen3_flex_inference as engine

    monkeypatch.setenv(engine.SKINNY_CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(engine, "SKINNY_SAVED", {})
    monkeypatch.setattr(engine, "SKINNY_CHOICES", {})
    generator = torch.Generator(device="cuda").manual_seed(0)
    w_NK = torch.randn(2560, 1536, device="cuda", generator=generator, dtype=torch.bfloat16)
    x_M1K = torch.randn(5, 1, 1536, device="cuda", generator=generator, dtype=torch.bfloat16)
    raced = engine.skinny_linear(x_M1K, w_NK)
    (key, choice), *_ = engine.SKINNY_CHOICES.items()
    assert "saved" not in choice and len(list(tmp_path.glob("skinny_choices_*.json"))) == 1

    def no_race(*args):
        raise AssertionError("raced a key that an earlier process saved")

    monkeypatch.setattr(engine, "race_skinny_backends", no_race)
    monkeypatch.setattr(engine, "SKINNY_SAVED", {})
    monkeypatch.setattr(engine, "SKINNY_CHOICES", {})
    assert torch.equal(engine.skinny_linear(x_M1K, w_NK), raced)
    assert engine.SKINNY_CHOICES[key] == {**json.loads(json.dumps(choice)), "saved": True}


def test_a_second_process_builds_none_of_the_projects_triton_kernels_again(tiny_dir, tmp_path):
    """Two processes of the Gemma-4 CLI (compiled step under CUDA graphs: inductor's kernels, the
    skinny GEMM's races, the Triton decode attention) on one set of empty cache folders: the second
    finds each of the project's Triton kernels in Triton's cache (use_inductors_ptxas; before it,
    the second of two E2B processes built all 40 again)."""
    import os
    import subprocess
    import sys

    caches = {
        name: tmp_path / name for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "FLEX_INFERENCE_CACHE_DIR")
    }
    env = {**os.environ, **{name: str(path) for name, path in caches.items()}}
    env.pop("TRITON_PTXAS_PATH", None)  # set in this process by any inductor build before: each child sets its own
    command = [sys.executable, "gemma4_flex_inference.py", "--model_name", str(tiny_dir / "gemma4"), "--device", "cuda"]
    command += ["--dtype", "float32", "--capture_cudagraph", "--compile_decode", "--quiet", "--n_prompts", "4"]
    command += ["--max_batch_size", "4", "--max_seq_length", "256", "--n_pages", "32", "--page_size", "16"]
    command += ["--max_new_tokens", "16"]

    def project_kernel_builds() -> set:
        return {
            path.parent.name
            for path in caches["TRITON_CACHE_DIR"].glob("*/*.cubin")
            if path.stem in ("_skinny_matmul_kernel", "_paged_decode_attention_kernel", "_paged_decode_combine_kernel")
        }

    def run_process() -> None:
        run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]

    run_process()
    first = project_kernel_builds()
    run_process()
    second = project_kernel_builds() - first
    assert first, "the first process built none of the project's Triton kernels: the check checks nothing"
    assert not second, f"the second process built {len(second)} of them again"


@pytest.mark.parametrize("decode_attention", ["triton", "flex"])
@pytest.mark.parametrize("page_size", [16, 128])
def test_float32_gemma4_at_head_dims_256_and_512_fits_its_kernel_options_and_matches_hf(page_size, decode_attention):
    """float32 at E2B's head dims (256 sliding, 512 full): the kernel options, per dtype and page
    size, fit the GPU's shared memory (bf16's prefill tiles do not) and flex's block-size rules
    (decode tiles no wider than a page), and the tokens equal HF's, eager and with CUDA graphs, with
    either decode attention (the Triton paged kernel, flex's decode kernel). A small model with
    E2B's attention shapes: 6 layers, 2 of them KV-shared, a window (24) that is no multiple of a page."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from gemma4_flex_inference import FlexGemma4Inference
    from qwen3_flex_inference import Sequence

    torch.backends.cuda.matmul.allow_tf32 = False
    preset = json.loads((ROOT / "scripts/presets/unsloth__gemma-4-E2B-it.json").read_text())
    preset.update(
        vocab_size=512, vocab_size_per_layer_input=512, hidden_size=128, hidden_size_per_layer_input=16,
        intermediate_size=256, num_hidden_layers=6, num_kv_shared_layers=2, sliding_window=24,
        layer_types=["sliding_attention", "full_attention"] * 3,
    )  # fmt: skip
    config = AutoConfig.for_model(**preset)
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    assert {layer.self_attn.head_dim for layer in hf.model.layers} == {256, 512}
    engine = FlexGemma4Inference(
        copy.deepcopy(hf), None, max_batch_size=4, max_seq_length=256, n_pages=64, page_size=page_size,
        max_new_tokens=MAX_NEW_TOKENS, decode_attention=decode_attention,
    )  # fmt: skip
    prompts = random_prompts([5, 70, 17, 40, 130], config.vocab_size, seed=13)
    want = [_rollout_cuda(hf, ids, engine.end_ids) for ids in prompts]
    for use_graph in (False, True):
        sequences = engine.generate([Sequence(input_ids=ids) for ids in prompts], capture_cudagraph=use_graph)
        for i, (seq, w) in enumerate(zip(sequences, want)):
            assert seq.output_ids == w, f"{use_graph=} prompt {i}: {seq.output_ids=} {w=}"


@pytest.mark.parametrize(
    "options", [{}, {"compile_decode": True, "fuse_projections": True}], ids=["plain", "compiled_fused"]
)
def test_sampling_under_cuda_graphs_equals_eager_matches_hf_logprobs_and_load_weights_recaptures_nothing(
    tiny_dir, options
):
    """Sampled rollouts (top-p, n completions on shared pages, log-probs) replayed from CUDA graphs
    draw the eager tokens; their log-probs equal HF's; after load_weights the same graphs serve the
    new weights (none is captured again) and the log-probs follow them."""
    from qwen3_flex_inference import FlexInference, SamplingParams

    torch.backends.cuda.matmul.allow_tf32 = False
    path = tiny_dir / "qwen3"
    engine = FlexInference(
        load_hf(path).cuda(), None, max_batch_size=8, max_seq_length=256, n_pages=64, page_size=16,
        max_new_tokens=MAX_NEW_TOKENS, **options,
    )  # fmt: skip
    prompts = random_prompts([5, 40, 23], engine.config.vocab_size, seed=61)
    params = SamplingParams(temperature=0.9, top_p=0.9, n=3, seed=77, logprobs=True)

    def rollouts(use_graph):
        return [seq for group in engine.rollouts(prompts, params, capture_cudagraph=use_graph) for seq in group]

    def check_logprobs(hf, sequences):
        for seq in sequences:
            with torch.no_grad():
                logits = hf(torch.tensor([seq.token_ids], device="cuda")).logits[0, len(seq.input_ids) - 1 : -1]
            want = torch.log_softmax(logits / 0.9, -1).gather(1, torch.tensor(seq.output_ids, device="cuda")[:, None])
            err = (torch.tensor(seq.output_logprobs, device="cuda") - want.squeeze(1)).abs().max().item()
            assert err < 1e-4, f"{options=} {err=}"

    eager, graph = rollouts(False), rollouts(True)
    assert [s.output_ids for s in graph] == [s.output_ids for s in eager], f"{options=}"
    check_logprobs(load_hf(path).cuda(), graph)
    graphs_before = dict(engine.runner.cuda_graphs)
    new_weights = load_hf(path).cuda()
    with torch.no_grad():
        for param in new_weights.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    engine.load_weights(new_weights.state_dict().items())
    after = rollouts(True)
    assert engine.runner.cuda_graphs == graphs_before, "load_weights made the engine capture again"
    assert [s.output_ids for s in after] != [s.output_ids for s in graph]
    check_logprobs(new_weights, after)


@pytest.mark.parametrize(
    "options",
    [{}, {"compile_decode": True}, {"compile_decode": True, "fuse_projections": True}],
    ids=["plain", "compiled", "compiled_fused"],
)
def test_zero_copy_greedy_follows_optimizer_steps_under_cuda_graphs_with_no_refresh_or_recapture(options):
    """The engine on the trainer's own PEFT model (trained CI-size Gemma-4, float32, train mode with
    gradient checkpointing as TRL leaves it): greedy tokens replayed from CUDA graphs equal HF + PEFT's
    before and after AdamW steps, with no refresh call and the same graphs; the KV pool sleeps through
    the steps (its memory given back to the driver) and wakes at the same addresses. Fused: the
    adapter's copies inside the fused weights, refreshed at each call."""
    from peft import LoraConfig, get_peft_model

    from gemma4_flex_inference import FlexGemma4Inference, load_gemma4
    from qwen3_flex_inference import SamplingParams
    from scripts.train_checkpoints import ensure_trained_checkpoints

    torch.backends.cuda.matmul.allow_tf32 = False
    path = ensure_trained_checkpoints() / "gemma4"
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"], lora_dropout=0.0)
    policy = get_peft_model(load_gemma4(str(path), torch.float32, torch.device("cuda")), lora)
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy.enable_input_require_grads()
    engine = FlexGemma4Inference(
        policy, None, max_batch_size=8, max_seq_length=256, n_pages=64, page_size=16, peft_model=policy,
        enable_sleep_mode=True, **options,
    )  # fmt: skip
    pool_bytes = sum(c.k_cache.nbytes + c.v_cache.nbytes for c in engine.runner.kv_caches if c is not None)
    prompts = random_prompts([5, 40, 23], engine.config.vocab_size, seed=5, low=FIRST_TEXT_ID)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=0.05)
    tokens, graphs = [], None
    for _ in range(2):
        policy.train()
        engine_tokens = [seq.output_ids for seq in engine.generate(prompts, greedy, capture_cudagraph=True)]
        graphs = graphs or dict(engine.runner.cuda_graphs)
        assert engine.runner.cuda_graphs == graphs, f"{options=}: the engine captured again"
        policy.eval()
        assert engine_tokens == [_rollout_cuda(policy, ids, engine.end_ids) for ids in prompts], f"{options=}"
        tokens.append(engine_tokens)
        free_awake = torch.cuda.mem_get_info()[0]
        engine.sleep()
        freed = torch.cuda.mem_get_info()[0] - free_awake
        assert freed >= pool_bytes, f"{options=}: sleep gave back {freed} bytes of a {pool_bytes}-byte pool"
        held = engine.runner.graph_pool_bytes()  # what sleep keeps: the graphs' pool, in the allocator
        assert 0 < held <= torch.cuda.memory_reserved(), f"{options=}: graph pool {held} bytes"
        print(f"{options=}: the CUDA graphs' pool holds {held / 1e6:.1f} MB while the engine sleeps")
        policy.train()
        for _ in range(2):
            ids = torch.tensor([prompts[1]], device="cuda")
            policy(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        engine.wake_up()
    assert tokens[0] != tokens[1], f"{options=}: the optimizer steps changed no greedy token: the test proves nothing"
