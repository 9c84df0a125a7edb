"""Gemma-4 on the engine against Hugging Face (eager attention, float32, CPU) on tiny checkpoints
with a 24-token sliding window, KV-shared layers of both types, PLE and the logit softcap."""

import pytest
import torch
from conftest import FIRST_TEXT_ID, hf_argmax_rollout, load_hf, random_prompts

from gemma4_flex_inference import FlexGemma4Inference, Sequence, kv_store_layers, load_gemma4

MAX_NEW_TOKENS = 24
# Prompts and generations run past the 24-token window; more prompts than batch slots.
PROMPT_LENGTHS = [5, 70, 17, 33, 48, 3, 90, 21]


def make_engine(model, **overrides):
    limits = dict(max_batch_size=4, max_seq_length=256, n_pages=64, page_size=16, max_new_tokens=MAX_NEW_TOKENS)
    limits.update(overrides)
    return FlexGemma4Inference(model, None, **limits)


@pytest.fixture(scope="module", params=["gemma4_text", "gemma4_text_keqv"])
def case(request, tiny_dir):
    path = tiny_dir / request.param
    hf = load_hf(path)
    engine = make_engine(load_hf(path))
    prompts = random_prompts(PROMPT_LENGTHS, hf.config.vocab_size, seed=2)
    want = hf_argmax_rollout(hf, prompts, MAX_NEW_TOKENS, engine.end_ids)
    return dict(name=request.param, path=path, hf=hf, engine=engine, prompts=prompts, want=want)


def test_end_ids_are_every_gemma_end_of_sequence_and_end_of_turn(case):
    assert {1, 4} <= case["engine"].end_ids, f"{case['engine'].end_ids=}"


def test_greedy_tokens_match_hf_argmax_beyond_sliding_window(case):
    sequences = case["engine"].generate([Sequence(input_ids=ids) for ids in case["prompts"]])
    for i, (seq, want) in enumerate(zip(sequences, case["want"])):
        assert seq.output_ids == want, f"{case['name']} prompt {i}: {seq.output_ids=} {want=}"
    assert max(seq.seq_len for seq in sequences) > 4 * case["hf"].config.sliding_window


def test_forced_preemption_and_reversed_order_still_match_hf(case):
    engine = make_engine(load_hf(case["path"]), n_pages=18, max_seq_length=128)
    sequences = engine.generate([Sequence(input_ids=ids) for ids in case["prompts"][::-1]])
    assert sum(seq.num_preemptions for seq in sequences) > 0, "the pool was large enough: no preemption"
    for i, (seq, want) in enumerate(zip(sequences, case["want"][::-1])):
        assert seq.output_ids == want, f"prompt {i}: {seq.output_ids=} {want=}"


def logit_tolerance(case, tokens) -> float:
    """1e-4, or twice HF's own eager-vs-SDPA gap on the same tokens if that is larger.

    NOTE: the tiny Gemma-4 is badly conditioned (scale-1.0 attention over normed q/k gives sharp
    softmaxes), so float32 rounding differences between attention kernels reach ~5e-4 in HF
    itself; float64 would settle it, but CPU flex_attention has no float64 kernel.
    """
    from transformers import AutoModelForCausalLM

    if "sdpa" not in case:
        case["sdpa"] = AutoModelForCausalLM.from_pretrained(case["path"], attn_implementation="sdpa").eval()
    gap = 0.0
    for ids in tokens:
        with torch.no_grad():
            gap = max(
                gap,
                (case["hf"](torch.tensor([ids])).logits - case["sdpa"](torch.tensor([ids])).logits).abs().max().item(),
            )
    return max(1e-4, 2 * gap)


def test_teacher_forced_logits_match_gemma4_for_causal_lm(case):
    tokens = [p + w for p, w in zip(case["prompts"], case["want"])]
    tolerance = logit_tolerance(case, tokens)
    got = case["engine"].score(tokens)
    for i, ids in enumerate(tokens):
        with torch.no_grad():
            want = case["hf"](torch.tensor([ids])).logits[0]
        err = (got[i] - want).abs().max().item()
        assert err < tolerance, f"prompt {i} ({len(ids)} tokens): max |logit error| {err} {tolerance=}"


def test_decode_step_logits_match_hf(case):
    sequences = [Sequence(input_ids=ids, record_logits=True) for ids in case["prompts"][:4]]
    case["engine"].generate(sequences)
    tolerance = logit_tolerance(case, [seq.token_ids for seq in sequences])
    for i, seq in enumerate(sequences):
        with torch.no_grad():
            want = case["hf"](torch.tensor([seq.token_ids])).logits[0, len(seq.input_ids) - 1 : -1]
        err = (torch.stack(seq.output_logits) - want).abs().max().item()
        assert err < tolerance, f"prompt {i}: max |logit error| {err} {tolerance=}"


def test_shared_layers_allocate_no_cache_and_bytes_per_token_sum_the_rest(case):
    engine, config = case["engine"], case["hf"].config
    first_shared = config.num_hidden_layers - config.num_kv_shared_layers
    want_bytes = 0
    for layer_idx, attn in enumerate(case["hf"].model.layers):
        cache = engine.runner.kv_caches[layer_idx]
        if layer_idx >= first_shared:
            assert cache is None, f"shared layer {layer_idx} owns a cache"
            continue
        head_dim = config.per_layer_config[layer_idx].head_dim
        num_kv_heads = attn.self_attn.k_proj.out_features // head_dim
        pool_pages = engine.scheduler.page_tables[config.layer_types[layer_idx]].n_pages
        assert cache.k_cache.shape[1:] == (num_kv_heads, pool_pages * 16, head_dim)
        want_bytes += 2 * num_kv_heads * head_dim * 4
    assert engine.runner.kv_bytes_per_token == want_bytes, f"{engine.runner.kv_bytes_per_token=} {want_bytes=}"


def test_kv_shared_layers_read_the_last_non_shared_layer_of_their_type(case):
    config = case["hf"].config
    first_shared = config.num_hidden_layers - config.num_kv_shared_layers
    store = kv_store_layers(config)
    types = config.layer_types
    assert {types[i] for i in range(first_shared, len(types))} == {"sliding_attention", "full_attention"}
    for layer_idx in range(first_shared, len(types)):
        want = max(j for j in range(first_shared) if types[j] == types[layer_idx])
        assert store[layer_idx] == want, f"{layer_idx=} {store[layer_idx]=} {want=}"
        assert case["hf"].model.layers[want].self_attn.store_full_length_kv
    assert store[:first_shared] == list(range(first_shared))


def test_multimodal_checkpoint_and_plain_checkpoint_give_identical_tokens(tiny_dir):
    multimodal = load_gemma4(str(tiny_dir / "gemma4"), torch.float32, torch.device("cpu"))
    plain = load_gemma4(str(tiny_dir / "gemma4_text"), torch.float32, torch.device("cpu"))
    assert type(multimodal).__name__ == "Gemma4ForCausalLM"
    assert not any("vision" in n or "audio" in n for n, _ in multimodal.named_parameters())
    assert multimodal.lm_head.weight is multimodal.model.embed_tokens.weight
    prompts = random_prompts([9, 40], plain.config.vocab_size, seed=3)
    outputs = []
    for model in (multimodal, plain):
        engine = make_engine(model, max_batch_size=2)
        outputs.append([s.output_ids for s in engine.generate([Sequence(input_ids=ids) for ids in prompts])])
    assert outputs[0] == outputs[1], f"{outputs=}"
    assert make_engine(multimodal).end_ids == make_engine(plain).end_ids == {1, 4}


def test_lora_double_copy_equals_hf_peft_merged_and_drift_check_passes(tiny_dir):
    from peft import PeftModel

    path = tiny_dir / "gemma4_text"
    reference = PeftModel.from_pretrained(load_hf(path), path / "lora").merge_and_unload()
    peft_model = PeftModel.from_pretrained(load_hf(path), path / "lora")
    engine = make_engine(peft_model, peft_model=peft_model)
    prompts = random_prompts([7, 30, 55], reference.config.vocab_size, seed=4)
    want = hf_argmax_rollout(reference, prompts, MAX_NEW_TOKENS, engine.end_ids)
    got = [s.output_ids for s in engine.generate([Sequence(input_ids=ids) for ids in prompts])]
    assert got == want, f"{got=} {want=}"
    drift = engine.verify_no_drift(iterations=3)
    assert drift["passed"], drift
    got_again = [s.output_ids for s in engine.generate([Sequence(input_ids=ids) for ids in prompts])]
    assert got_again == want


def test_adapter_trained_on_the_multimodal_model_equals_hf_peft_merged(tiny_dir):
    """An adapter naming `model.language_model.*` modules loads onto the text shell unchanged."""
    from peft import PeftModel
    from transformers import Gemma4ForConditionalGeneration

    from gemma4_flex_inference import load_gemma4_adapter

    path = tiny_dir / "gemma4"
    multimodal = Gemma4ForConditionalGeneration.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    reference = PeftModel.from_pretrained(multimodal, path / "lora").merge_and_unload().eval()
    shell = load_gemma4(str(path), torch.float32, torch.device("cpu"))
    peft_model = load_gemma4_adapter(shell, str(path / "lora"))
    engine = make_engine(peft_model, peft_model=peft_model)
    assert len(engine.lora_targets) == 62, f"{len(engine.lora_targets)=}"  # 124 LoRA tensors = 62 modules
    prompts = random_prompts([7, 30, 55], shell.config.vocab_size, seed=6, low=FIRST_TEXT_ID)
    want = hf_argmax_rollout(reference, prompts, MAX_NEW_TOKENS, engine.end_ids)
    got = [s.output_ids for s in engine.generate([Sequence(input_ids=ids) for ids in prompts])]
    assert got == want, f"{got=} {want=}"


def test_prefill_shortcut_runs_kv_shared_layers_on_last_positions_only(case):
    """Past the last store layer only each prompt's last position goes on; tokens still match HF."""
    engine, config = case["engine"], case["hf"].config
    first_shared = config.num_hidden_layers - config.num_kv_shared_layers
    rows_seen = {}
    hooks = [  # on each layer's MLP: the engine runs decoder layers by their forward, which calls no hook
        layer.mlp.register_forward_hook(
            lambda module, args, output, i=i: rows_seen.setdefault(i, []).append(output.shape[1])
        )
        for i, layer in enumerate(engine.runner.decoder.layers)
    ]
    try:
        prompts = case["prompts"][:3]
        sequences = engine.generate([Sequence(input_ids=ids, max_new_tokens=1) for ids in prompts])
    finally:
        for hook in hooks:
            hook.remove()
    packed = sum(len(p) for p in prompts)
    assert rows_seen[0] == [max(engine.runner.min_packed_tokens, -(-packed // 128) * 128)], f"{rows_seen[0]=}"
    assert rows_seen[first_shared - 1] == rows_seen[0]
    assert all(rows_seen[i] == [len(prompts)] for i in range(first_shared, config.num_hidden_layers)), f"{rows_seen=}"
    assert [s.output_ids for s in sequences] == [w[:1] for w in case["want"][:3]]
    engine.runner.use_prefill_shortcut = False  # the path the benchmark compares against: same tokens
    try:
        unshortened = engine.generate([Sequence(input_ids=ids, max_new_tokens=1) for ids in prompts])
    finally:
        engine.runner.use_prefill_shortcut = True
    assert [s.output_ids for s in unshortened] == [w[:1] for w in case["want"][:3]]


def test_sliding_window_pages_are_recycled_and_tokens_still_match_hf(tiny_dir):
    """Sliding layers hold at most pool_pages' window + two pages per sequence (the page written,
    one taken ahead); the full pool every token and at most a page ahead; long generations stay exact."""
    path = tiny_dir / "gemma4_text"
    hf = load_hf(path)
    engine = make_engine(load_hf(path), max_batch_size=2, max_new_tokens=60)
    window, page_size = hf.config.sliding_window, 16
    window_table, full_table = (
        engine.scheduler.page_tables["sliding_attention"],
        engine.scheduler.page_tables["full_attention"],
    )
    assert window_table.n_pages < full_table.n_pages, f"{window_table.n_pages=} {full_table.n_pages=}"
    max_window_pages = -(-window // page_size) + 2
    most_pages_seen = []
    launch_decode = engine.runner.launch_decode

    def checked_launch_decode(rows, use_graph, previous=None):
        for seq in rows:
            most_pages_seen.append(window_table.num_pages_of(seq.batch_idx))
            # the full-attention pool still holds every token (and at most a page ahead)
            held = full_table.num_pages_of(seq.batch_idx)
            assert -(-seq.seq_len // page_size) <= held <= -(-(seq.seq_len + page_size) // page_size), f"{held=}"
        return launch_decode(rows, use_graph, previous)

    engine.runner.launch_decode = checked_launch_decode
    prompts = random_prompts([90, 7, 41], hf.config.vocab_size, seed=9)
    sequences = engine.generate([Sequence(input_ids=ids) for ids in prompts])
    assert most_pages_seen and max(most_pages_seen) <= max_window_pages, f"{max(most_pages_seen)=} {max_window_pages=}"
    want = hf_argmax_rollout(hf, prompts, 60, engine.end_ids)
    for i, (seq, w) in enumerate(zip(sequences, want)):
        assert seq.output_ids == w, f"prompt {i}: {seq.output_ids=} {w=}"
    assert window_table.num_used_pages == 0 and window_table.num_free_pages == window_table.n_pages - 1


def test_fused_projections_give_the_same_tokens_as_hf(case):
    engine = make_engine(load_hf(case["path"]), fuse_projections=True)
    sequences = engine.generate([Sequence(input_ids=ids) for ids in case["prompts"]])
    assert [s.output_ids for s in sequences] == case["want"]


def test_compiled_fused_decode_step_through_every_bucket_matches_hf(tiny_dir):
    """The fastest decode mode (compiled step with a symbolic batch, fused projections): at most one
    compile per kind of layer (regime, KV-shared or not, MLP width) for all layers and buckets,
    the batch shrinking through buckets 8, 4 and 2, tokens equal to HF past the window."""
    from conftest import compiled_decode_regions

    path = tiny_dir / "gemma4_text"
    hf = load_hf(path)
    engine = make_engine(load_hf(path), max_batch_size=8, compile_decode=True, fuse_projections=True)
    engine.end_ids = set()
    prompts = random_prompts([5, 30, 17, 40, 9, 60, 3], hf.config.vocab_size, seed=3)
    new_tokens = [3, 30, 7, 20, 5, 9, 16]
    layer_kinds = {
        (layer.self_attn.layer_type, layer.self_attn.is_kv_shared_layer, layer.mlp.down_proj.in_features)
        for layer in engine.runner.decoder.layers
    }
    compiled_before = compiled_decode_regions()
    sequences = engine.generate([Sequence(input_ids=ids, max_new_tokens=n) for ids, n in zip(prompts, new_tokens)])
    compiled = {region: n - compiled_before[region] for region, n in compiled_decode_regions().items()}
    # At most one compile per region kind. A region an earlier engine of this process compiled with the
    # same guards is reused (the epilogue of the same checkpoint, say), so it may compile 0 times here.
    want = {"prologue": 1, "layer": len(layer_kinds), "epilogue": 1}
    variants = compiled_decode_regions()
    assert all(compiled[region] <= want[region] <= variants[region] for region in want), (
        f"compiled per bucket or per layer: {compiled=} {want=} {variants=} {layer_kinds=}"
    )
    for seq, ids, n in zip(sequences, prompts, new_tokens):
        assert seq.output_ids == hf_argmax_rollout(hf, [ids], n, set())[0]


def captured_values(mask_mod) -> list:
    """What a mask_mod captures, through the mask_mods it wraps (None and the wrapped functions left out)."""
    values = []
    for cell in mask_mod.__closure__ or ():
        value = cell.cell_contents
        if callable(value) and getattr(value, "__closure__", None):
            values += captured_values(value)
        elif value is not None:
            values.append(value)
    return values


def test_mask_mods_capture_only_tensors_of_one_size_whatever_the_prompts(case, monkeypatch):
    """A captured int, or a captured tensor whose size varies between steps, becomes a symbol in the
    compiled kernel, which inductor's CPU flex template can corrupt (packed_block_masks' NOTE): the
    prefill and decode masks capture tensors only, the prefill masks' of one size for every packed
    row (the decode masks' are static per batch bucket, which is compiled on its own)."""
    from torch.nn.attention.flex_attention import BlockMask

    import qwen3_flex_inference

    recorded, num_decode_masks = [], [0]

    def captured_shapes(mask_mod) -> tuple:
        values = captured_values(mask_mod)
        assert all(isinstance(v, torch.Tensor) for v in values), f"a mask_mod captures {values}"
        return tuple(tuple(v.shape) for v in values)

    def recording_create_block_mask(mask_mod, *args, **kwargs):
        recorded.append(captured_shapes(mask_mod))
        return create_block_mask(mask_mod, *args, **kwargs)

    def recording_from_kv_blocks(*args, mask_mod=None, **kwargs):
        captured_shapes(mask_mod)
        num_decode_masks[0] += 1
        return from_kv_blocks(*args, mask_mod=mask_mod, **kwargs)

    create_block_mask, from_kv_blocks = qwen3_flex_inference.create_block_mask, BlockMask.from_kv_blocks
    monkeypatch.setattr(qwen3_flex_inference, "create_block_mask", recording_create_block_mask)
    monkeypatch.setattr(BlockMask, "from_kv_blocks", recording_from_kv_blocks)
    shapes = []
    for lengths in ([5, 7, 9], [150, 20, 33, 40]):  # packed rows of 128 and 256 tokens, 3 and 4 prompts
        recorded.clear()
        prompts = random_prompts(lengths, case["hf"].config.vocab_size, seed=5)
        case["engine"].generate([Sequence(input_ids=ids, max_new_tokens=2) for ids in prompts])
        shapes.append(set(recorded))
    assert shapes[0] == shapes[1] and len(shapes[0]) >= 2, f"{case['name']}: {shapes=}"
    assert num_decode_masks[0] > 0, "no decode mask was built: the decode half went untested"


# Head dims that are no multiple of 16 (inductor's CPU flex template was reported failing to compile
# them: 'cur_kvSplitSize4' was not declared), a window shorter than a page, 2 KV heads.
ODD_HEAD_DIMS = {"head_dim": 12, "global_head_dim": 24, "sliding_window": 5, "num_key_value_heads": 2}


@pytest.fixture(scope="module")
def odd_head_dims(tiny_dir):
    """The tiny Gemma-4 at ODD_HEAD_DIMS, random weights built in memory, generated once on the
    engine while every call of the compiled flex_attention is recorded: (kind, q, k, v head dims)."""
    import copy
    import json

    from transformers import AutoModelForCausalLM, Gemma4TextConfig

    import qwen3_flex_inference

    config_dict = json.loads((tiny_dir / "gemma4_text" / "config.json").read_text())
    for key in ("architectures", "model_type", "transformers_version"):
        config_dict.pop(key)
    config = Gemma4TextConfig(**{**config_dict, **ODD_HEAD_DIMS})
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    sdpa = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    sdpa.load_state_dict(hf.state_dict())
    engine = make_engine(copy.deepcopy(hf), max_batch_size=2)
    engine.end_ids = set()
    kernel_calls = []

    def recording(compiled):
        def recording_flex_attention(q, k, v, **kwargs):
            kernel_calls.append(("decode" if q.shape[2] == 1 else "prefill", q.shape[-1], k.shape[-1], v.shape[-1]))
            return compiled(q, k, v, **kwargs)

        return recording_flex_attention

    prompts = random_prompts([7, 30], config.vocab_size, seed=13)
    sequences = [Sequence(input_ids=ids, max_new_tokens=8, record_logits=True) for ids in prompts]
    with pytest.MonkeyPatch.context() as patch:
        for name in ("flex_attention_compiled", "flex_attention_compiled_packed"):  # decode's, prefill's
            patch.setattr(qwen3_flex_inference, name, recording(getattr(qwen3_flex_inference, name)))
        engine.generate(sequences)
    return dict(hf=hf, sdpa=sdpa, engine=engine, prompts=prompts, sequences=sequences, kernel_calls=kernel_calls)


def test_head_dims_12_and_24_with_window_5_match_hf_tokens_and_logits_on_compiled_flex(odd_head_dims):
    case, sequences = odd_head_dims, odd_head_dims["sequences"]
    assert {layer.self_attn.head_dim for layer in case["hf"].model.layers} == {12, 24}
    want = hf_argmax_rollout(case["hf"], case["prompts"], 8, set())
    for i, (seq, w) in enumerate(zip(sequences, want)):
        assert seq.output_ids == w, f"prompt {i}: {seq.output_ids=} {w=}"
    tolerance = logit_tolerance(case, [seq.token_ids for seq in sequences])
    for i, seq in enumerate(sequences):
        with torch.no_grad():
            want_logits = case["hf"](torch.tensor([seq.token_ids])).logits[0, len(seq.input_ids) - 1 : -1]
        err = (torch.stack(seq.output_logits) - want_logits).abs().max().item()
        assert err < tolerance, f"prompt {i}: max |logit error| {err} {tolerance=}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the padding is the CPU's")
def test_cpu_flex_kernel_and_kv_cache_see_head_dims_padded_to_multiples_of_16(odd_head_dims):
    """Head dims 12 and 24 reach the compiled flex_attention, prefill and decode, as 16 and 32
    (zero-padded q, k, v), and the KV caches are stored at 16 and 32."""
    calls = set(odd_head_dims["kernel_calls"])
    want = {(kind, d, d, d) for kind in ("prefill", "decode") for d in (16, 32)}
    assert calls == want, f"(kind, q, k, v head dims) the kernel saw: {sorted(calls)}, want {sorted(want)}"
    engine = odd_head_dims["engine"]
    for layer, cache in zip(odd_head_dims["hf"].model.layers, engine.runner.kv_caches):
        if cache is not None:
            want_dim = {12: 16, 24: 32}[layer.self_attn.head_dim]
            assert cache.k_cache.shape[-1] == cache.v_cache.shape[-1] == want_dim, (
                f"{layer.self_attn.head_dim=} {cache.k_cache.shape=} {cache.v_cache.shape=}"
            )
