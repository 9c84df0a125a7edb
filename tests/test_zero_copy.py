"""Zero copy: the engine runs the trainer's own PEFT model (model= and peft_model= the same), sharing
every weight and reading the adapter's live A and B, or, with fused projections, fusing the trainer's
frozen base in place and copying A and B in at each call. Float32 on the CPU, on the trained CI-size
Qwen3 and Gemma-4 (realistic distributions): the trainer's loss and gradients are an untouched
twin's before and after rollouts, and after optimizer steps (no refresh call) the engine's greedy
tokens are HF + PEFT's with the stepped adapter."""

import pytest
import torch
from conftest import gemm_ops, hf_greedy
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from gemma4_flex_inference import FlexGemma4Inference, load_gemma4
from qwen3_flex_inference import FlexInference, FlexInferenceError, SamplingParams, sha256_of
from scripts.train_checkpoints import ensure_trained_checkpoints

PROMPTS = ["def add(a, b):", "class Stack:\n    def push(self, item):", "import os\n\n\ndef walk(root):"]
GREEDY_TOKENS = 16
TRAINING_TEXT = "def add(a, b):\n    return a + b\n"  # the trainer's one training sequence
# tests/test_trl.py's limits: the compiled kernels serve both
LIMITS = dict(max_batch_size=64, max_seq_length=1024, n_pages=None, page_size=16)


def load(name: str, path):
    if name == "gemma4":
        return load_gemma4(str(path), torch.float32, torch.device("cpu"))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")


def loss_and_grads(model, input_ids_1T: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(input_ids=input_ids_1T, labels=input_ids_1T).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def take_optimizer_steps(policy, input_ids_1T: torch.Tensor, num_steps: int = 2) -> None:
    """AdamW steps of the adapter on one sequence, as a trainer takes them between rollouts."""
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=0.05)
    for _ in range(num_steps):
        loss_and_grads(policy, input_ids_1T)
        optimizer.step()


def assert_same_training(model, twin, input_ids_1T, when: str) -> None:
    loss, grads = loss_and_grads(model, input_ids_1T)
    twin_loss, twin_grads = loss_and_grads(twin, input_ids_1T)
    assert grads.keys() == twin_grads.keys() and grads, when
    assert (loss - twin_loss).abs().item() <= 1e-6, f"{when}: loss {loss.item()} against {twin_loss.item()}"
    worst = max((grads[name] - twin_grads[name]).abs().max().item() for name in grads)
    assert worst <= 1e-6, f"{when}: gradients differ by {worst}"


@pytest.fixture(scope="module", params=["qwen3", "gemma4", "qwen3 fused", "gemma4 fused"])
def shared(request):
    """The trainer's PEFT model (dropout 0, B nonzero; train mode, gradient checkpointing and the input
    grad hook on, as TRL leaves it), an untouched twin with the same weights, and a zero-copy engine
    on the first (with fused projections: q/k/v and gate/up each one GEMM, and the adapter's targets,
    some of each group and down_proj alone, in them)."""
    name, is_fused = request.param.split()[0], request.param.endswith("fused")
    path = ensure_trained_checkpoints() / name
    tokenizer = AutoTokenizer.from_pretrained(path)
    policy, twin = trainer_policy(name, path), trainer_policy(name, path)
    twin.load_state_dict(policy.state_dict())
    engine_class = FlexGemma4Inference if name == "gemma4" else FlexInference
    engine = engine_class(policy, tokenizer, peft_model=policy, fuse_projections=is_fused, **LIMITS)
    input_ids_1T = torch.tensor([tokenizer(TRAINING_TEXT)["input_ids"]])
    prompt_ids = [tokenizer(prompt)["input_ids"] for prompt in PROMPTS]
    return dict(
        name=request.param, policy=policy, twin=twin, engine=engine, input_ids=input_ids_1T, prompt_ids=prompt_ids
    )


def trainer_policy(name: str, path):
    """A PEFT model as the trainer holds it: dropout 0, B nonzero (seeded), train mode with gradient
    checkpointing and the input grad hook on, as TRL's GRPOTrainer leaves it by default."""
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"], lora_dropout=0.0)
    torch.manual_seed(0)
    policy = get_peft_model(load(name, path), lora)
    for param_name, param in policy.named_parameters():
        if "lora_B" in param_name:  # PEFT starts B at zero: the adapter would change nothing
            torch.nn.init.normal_(param, std=0.05)
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy.enable_input_require_grads()
    policy.train()
    return policy


def test_the_engine_shares_every_weight_and_patches_nothing_outside_its_calls(shared):
    engine, policy = shared["engine"], shared["policy"]
    assert engine.is_zero_copy and not engine.merge_lora
    trainer_storage = {p.data_ptr() for p in policy.parameters()}
    assert all(p.data_ptr() in trainer_storage for p in engine.causal_lm.parameters())
    if engine.is_live_adapter:
        for name, (lora_A_RI, lora_B_OR) in engine.unmerged_lora.items():
            assert lora_A_RI.data_ptr() in trainer_storage and lora_B_OR.data_ptr() in trainer_storage, name
    else:  # fused: the trainer's frozen q/k/v and gate/up are views of one tensor, with the A copies below them
        attn = engine.causal_lm.model.layers[0].self_attn
        fused = attn.fused_qkv_weight
        assert attn.q_proj.base_layer.weight.data_ptr() == fused.data_ptr()
        assert any(attn.q_proj.base_layer.weight is p for p in policy.parameters())
        lora_A_RI = engine.unmerged_lora["model.layers.0.self_attn.q_proj"][0]
        assert lora_A_RI.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
        copies = [w.data_ptr() for pair in engine.unmerged_lora.values() for w in pair]
        assert not set(copies) & trainer_storage, "the engine's A and B are its copies, refreshed at each call"
    engine.generate(PROMPTS[:1], SamplingParams(max_tokens=4))
    patched = [
        name
        for name, module in policy.named_modules()
        if any(key == "forward" or key.startswith("flex_") for key in module.__dict__)
    ]
    assert not patched, f"engine forwards or their attributes left on the trainer's modules: {patched[:3]}"


def test_fused_zero_copy_runs_the_adapter_inside_the_fused_gemms(shared, monkeypatch):
    """GEMMs per layer in a forward (the fixture's adapter: q, v, up and down): unfused, each of the 7
    projections and each target's A and B (7 + 2 x 4 = 15); fused, one per group (q/k/v, o,
    gate/up, down), its targets' A rows inside it, and one B per adapted group (4 + 3 = 7)."""
    if not shared["name"].startswith("qwen3"):
        pytest.skip("Gemma-4's per-layer-input projections add GEMMs of their own: Qwen3's count only")
    engine, linear = shared["engine"], torch.nn.functional.linear
    weight_shapes = []
    monkeypatch.setattr(
        torch.nn.functional, "linear", lambda x, w, b=None: (weight_shapes.append(tuple(w.shape)), linear(x, w, b))[1]
    )
    engine.score([shared["prompt_ids"][0]])
    num_layers = len(engine.causal_lm.model.layers)
    per_layer = (len(weight_shapes) - 1) / num_layers  # and the lm_head
    assert per_layer == (15 if engine.is_live_adapter else 7), f"{shared['name']}: {weight_shapes[:16]}"


def test_training_equals_an_untouched_models_before_and_after_rollouts(shared):
    policy, twin, engine = shared["policy"], shared["twin"], shared["engine"]
    assert_same_training(policy, twin, shared["input_ids"], "before rollouts")
    sampled = engine.rollouts(PROMPTS, SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=3, logprobs=0))
    assert all(len(seq.output_ids) > 0 for group in sampled for seq in group)
    engine.score([shared["prompt_ids"][0]])
    assert_same_training(policy, twin, shared["input_ids"], "after rollouts")


def test_greedy_tokens_follow_optimizer_steps_with_no_refresh(shared):
    policy, engine, prompt_ids = shared["policy"], shared["engine"], shared["prompt_ids"]
    base_layers = {name: p for name, p in policy.named_parameters() if "lora_" not in name}
    base_before = sha256_of(base_layers)
    greedy = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS)
    before = [seq.output_ids for seq in engine.generate(prompt_ids, greedy)]
    take_optimizer_steps(policy, shared["input_ids"])
    after = [seq.output_ids for seq in engine.generate(prompt_ids, greedy)]
    policy.eval()  # HF generate with its cache: not under gradient checkpointing
    try:
        assert after == hf_greedy(policy, prompt_ids, GREEDY_TOKENS, engine.end_ids), shared["name"]
    finally:
        policy.train()
    assert after != before, f"{shared['name']}: two optimizer steps changed no greedy token: the test proves nothing"
    assert sha256_of(base_layers) == base_before, "the frozen base changed"


@pytest.mark.parametrize("name", ["qwen3", "gemma4"])
def test_compiled_fused_zero_copy_follows_optimizer_steps_without_compiling_again(name):
    """The compiled decode step in fused zero copy: the adapter copied into the fused GEMMs at each
    call is data, not a guard, so a generate after optimizer steps compiles nothing new (a recompile
    there would cost every GRPO step) and its greedy tokens are HF + PEFT's with the stepped adapter."""
    from conftest import compiled_decode_regions

    path = ensure_trained_checkpoints() / name
    tokenizer = AutoTokenizer.from_pretrained(path)
    policy = trainer_policy(name, path)
    engine_class = FlexGemma4Inference if name == "gemma4" else FlexInference
    engine = engine_class(policy, tokenizer, peft_model=policy, fuse_projections=True, compile_decode=True, **LIMITS)
    prompt_ids = [tokenizer(prompt)["input_ids"] for prompt in PROMPTS]
    greedy = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS)
    before = [seq.output_ids for seq in engine.generate(prompt_ids, greedy)]
    compiled_before = compiled_decode_regions()
    take_optimizer_steps(policy, torch.tensor([tokenizer(TRAINING_TEXT)["input_ids"]]))
    after = [seq.output_ids for seq in engine.generate(prompt_ids, greedy)]
    assert compiled_decode_regions() == compiled_before, "a generate after optimizer steps compiled again"
    policy.eval()
    assert after == hf_greedy(policy, prompt_ids, GREEDY_TOKENS, engine.end_ids)
    assert after != before, "two optimizer steps changed no greedy token: the test proves nothing"


def test_a_fused_groups_adapter_product_compiles_to_one_gemm_for_a_symbolic_batch():
    """Compiled as the decode step is (its batch symbolic), the B product of a fused group's adapter
    is one GEMM over the rows, not a batched GEMM of one row per batch entry (which reads B again for
    every row), and it equals base + (x A^T) B^T x scaling, split into the group's outputs. An input
    strided (hidden, 1, 1) also runs plain GEMMs."""
    from torch._dynamo.backends.common import aot_autograd

    from qwen3_flex_inference import project

    torch.manual_seed(0)
    hidden, sizes, rank = 32, [24, 8, 8], 6
    owner = torch.nn.Module()
    owner.fused_weight = torch.randn(sum(sizes) + rank, hidden)  # the A rows below the weights
    owner.fused_weight_sizes = sizes
    owner.fused_weight_lora_B = torch.randn(sum(sizes), rank)
    owner.fused_weight_lora_scaling = torch.full((sum(sizes),), 2.0)
    graphs = []

    def keep_graph(graph_module, _inputs):
        graphs.append(graph_module.graph)
        return graph_module.forward

    compiled = torch.compile(
        lambda x: project(owner, [], "fused_weight", x), backend=aot_autograd(fw_compiler=keep_graph), fullgraph=True
    )
    hidden_B1H = torch.randn(5, 1, hidden)
    torch._dynamo.mark_dynamic(hidden_B1H, 0)
    with torch.no_grad():
        outputs = compiled(hidden_B1H)
    weight, lora_A = owner.fused_weight[: sum(sizes)], owner.fused_weight[sum(sizes) :]
    expected = hidden_B1H @ weight.T + (hidden_B1H @ lora_A.T) @ owner.fused_weight_lora_B.T * 2.0
    torch.testing.assert_close(torch.cat(outputs, -1), expected)
    ops = {node.target for graph in graphs for node in graph.nodes}
    assert torch.ops.aten.bmm.default not in ops and torch.ops.aten.mm.default in ops, sorted(map(str, ops))
    # a decode input strided (hidden, 1, 1), as a compiled step can hand o_proj its input: one GEMM each
    strided_B1H = hidden_B1H.flatten().as_strided((5, 1, hidden), (hidden, 1, 1))
    assert gemm_ops(lambda: project(owner, [], "fused_weight", strided_B1H)) == {"aten::mm"}


def test_an_unmerged_adapter_multiplies_a_decode_input_with_a_strided_size_one_dim_as_one_gemm():
    """The unmerged adapter's products take x as rows: a compiled decode step's [rows, 1, K] input
    strided (K, 1, 1) would otherwise run batched GEMMs of one row per batch entry (A and B read
    once per row); the result is base + (x A^T) B^T x scaling."""

    from qwen3_flex_inference import unmerged_lora_forward

    generator = torch.Generator().manual_seed(0)
    x_B1K = torch.randn(8 * 64, generator=generator).as_strided((8, 1, 64), (64, 1, 1))
    lora_A, lora_B = torch.randn(4, 64, generator=generator), torch.randn(48, 4, generator=generator)
    module = torch.nn.Module()
    module.flex_lora_base_forward = lambda x: torch.zeros(*x.shape[:-1], 48)
    module.flex_lora_A_RI, module.flex_lora_B_OR, module.flex_lora_scaling = lora_A, lora_B, 0.5
    assert gemm_ops(lambda: torch.nn.functional.linear(x_B1K, lora_A)) == {"aten::bmm"}, "the input folds: no case"
    assert gemm_ops(lambda: unmerged_lora_forward(module, x_B1K)) == {"aten::mm"}
    expected = torch.nn.functional.linear(torch.nn.functional.linear(x_B1K, lora_A), lora_B) * 0.5
    torch.testing.assert_close(unmerged_lora_forward(module, x_B1K), expected)


def test_a_replaced_adapter_weight_is_read_again_at_the_next_sync(shared):
    """A trainer that replaces the adapter's tensors (TRL casts a 4-bit model's adapter to bf16 when it
    starts) rather than updating them in place: refresh_lora (the TRL sync) points the engine at the
    new ones."""
    policy, engine, prompt_ids = shared["policy"], shared["engine"], shared["prompt_ids"]
    lora_B = next(p for name, p in policy.named_parameters() if "lora_B" in name)
    own = lora_B.data
    greedy = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS)
    before = [seq.output_ids for seq in engine.generate(prompt_ids, greedy)]
    try:
        lora_B.data = own * 40  # new storage, different values
        engine.refresh_lora()
        engine_tokens = [seq.output_ids for seq in engine.generate(prompt_ids, greedy)]
        policy.eval()
        assert engine_tokens == hf_greedy(policy, prompt_ids, GREEDY_TOKENS, engine.end_ids), shared["name"]
        assert engine_tokens != before, f"{shared['name']}: the new B changed no greedy token: the test proves nothing"
    finally:
        policy.train()
        lora_B.data = own
        engine.refresh_lora()


def test_a_merged_adapter_is_refused_in_zero_copy(shared):
    if shared["name"] != "qwen3":
        pytest.skip("the refusal does not depend on the model")
    with pytest.raises(FlexInferenceError, match="merge_lora needs a copy of the model of its own"):
        FlexInference(
            shared["policy"], max_seq_length=256, n_pages=64, page_size=16, peft_model=shared["policy"], merge_lora=True
        )


def test_sleep_gives_the_kv_pool_back_and_wake_up_generates_the_same_tokens(tiny_dir):
    from conftest import load_hf, random_prompts

    engine = FlexInference(load_hf(tiny_dir / "qwen3"), None, enable_sleep_mode=True, **LIMITS)
    prompts = random_prompts([5, 30, 17], engine.vocab_size, seed=2)
    greedy = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS)
    before = [seq.output_ids for seq in engine.generate(prompts, greedy)]
    caches = [t for cache in engine.runner.kv_caches if cache is not None for t in (cache.k_cache, cache.v_cache)]
    pool_bytes = sum(t.untyped_storage().nbytes() for t in caches)
    engine.sleep()
    assert pool_bytes > 0 and sum(t.untyped_storage().nbytes() for t in caches) == 0, "the pool was not given back"
    with pytest.raises(FlexInferenceError, match="asleep"):
        engine.generate(prompts, greedy)
    engine.wake_up()
    assert sum(t.untyped_storage().nbytes() for t in caches) == pool_bytes
    assert [seq.output_ids for seq in engine.generate(prompts, greedy)] == before


def test_sleep_without_sleep_mode_is_refused_in_one_sentence(shared):
    if shared["name"] != "qwen3":
        pytest.skip("the refusal does not depend on the model")
    with pytest.raises(FlexInferenceError, match="enable_sleep_mode=True"):
        shared["engine"].sleep()
