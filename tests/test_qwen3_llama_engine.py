"""The base engine against Hugging Face on tiny Qwen3 and Llama-3.2 checkpoints (float32, CPU)."""

import pytest
import torch
from conftest import assert_prefill_attention_compiles_once, hf_greedy, load_hf, random_prompts

from qwen3_flex_inference import FlexInference, Sequence

MAX_NEW_TOKENS = 24
# Prompt lengths spanning several 16-token pages; more prompts than batch slots.
PROMPT_LENGTHS = [5, 70, 17, 33, 48, 3, 90, 21]


def make_engine(path, **overrides):
    limits = dict(max_batch_size=4, max_seq_length=256, n_pages=64, page_size=16, max_new_tokens=MAX_NEW_TOKENS)
    limits.update(overrides)
    return FlexInference(load_hf(path), None, **limits)


def generate(engine, prompts):
    return [seq.output_ids for seq in engine.generate([Sequence(input_ids=ids) for ids in prompts])]


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def case(request, tiny_dir):
    path = tiny_dir / request.param
    hf = load_hf(path)
    engine = make_engine(path)
    prompts = random_prompts(PROMPT_LENGTHS, hf.config.vocab_size, seed=1)
    want = hf_greedy(hf, prompts, MAX_NEW_TOKENS, engine.end_ids)
    return dict(name=request.param, path=path, hf=hf, engine=engine, prompts=prompts, want=want)


def test_first_argmax_match_hf_generate_with_more_prompts_than_slots(case):
    got = generate(case["engine"], case["prompts"])
    for i, (g, w) in enumerate(zip(got, case["want"])):
        assert g == w, f"{case['name']} prompt {i}: {g=} {w=}"
    assert len({tuple(w) for w in case["want"]}) > 1, "degenerate reference: every completion is the same"


def test_same_batch_twice_and_reversed_order_give_the_same_tokens(case):
    engine, prompts = case["engine"], case["prompts"]
    assert generate(engine, prompts) == case["want"]
    assert generate(engine, prompts[::-1]) == case["want"][::-1]


def test_decode_time_by_bucket_adds_up_to_the_run(case):
    """timings["decode_by_bucket"]: every decode step read is counted once, under the bucket its rows
    were padded to; its rows are the tokens decode steps took, and its seconds the decode time
    (less the first steps' queueing)."""
    engine = case["engine"]
    generate(engine, case["prompts"])
    timings = engine.timings
    bands = timings["decode_by_bucket"]
    assert set(bands) <= set(engine.runner.buckets) and bands, f"{bands=}"
    assert sum(band["rows"] for band in bands.values()) == timings["num_decode_tokens"]
    assert all(0 < band["rows"] <= band["steps"] * bucket for bucket, band in bands.items()), f"{bands=}"
    assert all(band["rows"] > band["steps"] * (bucket // 2) or bucket == min(bands) for bucket, band in bands.items())
    assert sum(band["seconds"] for band in bands.values()) <= timings["decode_s"]


def test_forced_preemption_still_matches_hf(case):
    # 17 usable pages of 16 tokens for up to 4 sequences of up to 114 tokens: the pool runs dry.
    engine = make_engine(case["path"], n_pages=18, max_seq_length=128)
    sequences = engine.generate([Sequence(input_ids=ids) for ids in case["prompts"]])
    assert sum(seq.num_preemptions for seq in sequences) > 0, "the pool was large enough: no preemption"
    for i, (seq, w) in enumerate(zip(sequences, case["want"])):
        assert seq.output_ids == w, f"prompt {i}: {seq.output_ids=} {w=}"
    assert (
        engine.scheduler.page_tables["full_attention"].num_used_pages == 0
        and engine.scheduler.page_tables["full_attention"].num_free_pages == 17
    )


def test_teacher_forced_logits_within_1e_4_of_hf(case):
    tokens = [p + w for p, w in zip(case["prompts"], case["want"])]
    got = case["engine"].score(tokens)
    for i, ids in enumerate(tokens):
        with torch.no_grad():
            want = case["hf"](torch.tensor([ids])).logits[0]
        err = (got[i] - want).abs().max().item()
        assert err < 1e-4, f"prompt {i}: max |logit error| {err}"


def test_decode_step_logits_within_1e_4_of_hf(case):
    engine = case["engine"]
    sequences = [Sequence(input_ids=ids, record_logits=True) for ids in case["prompts"][:3]]
    engine.generate(sequences)
    for seq in sequences:
        with torch.no_grad():
            want = case["hf"](torch.tensor([seq.token_ids])).logits[0, len(seq.input_ids) - 1 : -1]
        got = torch.stack(seq.output_logits)
        err = (got - want).abs().max().item()
        assert err < 1e-4, f"max |logit error| {err}"


def test_every_end_id_of_the_generation_config_stops(case):
    engine = case["engine"]
    gen_ids = case["hf"].generation_config.eos_token_id
    assert isinstance(gen_ids, list) and len(gen_ids) >= 2 and set(gen_ids) <= engine.end_ids
    # Make one end id the model's favourite token: generation must stop right after it.
    prompts = case["prompts"][:2]
    first = generate(engine, prompts)
    stop_id = first[0][2]
    engine.end_ids = {stop_id}
    try:
        stopped = engine.generate([Sequence(input_ids=ids) for ids in prompts])
    finally:
        engine.end_ids = set(gen_ids) | {case["hf"].config.eos_token_id} - {None}
    assert stopped[0].output_ids == first[0][:3] and stopped[0].finish_reason == "stop"


def test_chained_decode_steps_stop_on_end_ids_and_match_hf(case):
    """Most decode steps are queued before the previous one's tokens are read; a row that hits an
    end id inside such a chain rides along one step and its extra token is dropped."""
    engine, prompts = case["engine"], case["prompts"]
    stop_id = case["want"][1][5]  # an end id in the middle of a completion
    want = hf_greedy(case["hf"], prompts, MAX_NEW_TOKENS, {stop_id})
    assert any(len(w) < MAX_NEW_TOKENS for w in want), "no completion stops early"
    launch_decode, end_ids = engine.runner.launch_decode, engine.end_ids
    num_launches = {"fresh": 0, "chained": 0}

    def counted_launch_decode(rows, use_graph, previous=None):
        num_launches["fresh" if previous is None else "chained"] += 1
        return launch_decode(rows, use_graph, previous)

    engine.runner.launch_decode, engine.end_ids = counted_launch_decode, {stop_id}
    try:
        sequences = engine.generate([Sequence(input_ids=ids) for ids in prompts])
    finally:
        engine.runner.launch_decode, engine.end_ids = launch_decode, end_ids
    for i, (seq, w) in enumerate(zip(sequences, want)):
        assert seq.output_ids == w, f"prompt {i}: {seq.output_ids=} {w=}"
        assert seq.finish_reason == ("stop" if len(w) < MAX_NEW_TOKENS else "length"), (
            f"prompt {i}: {seq.finish_reason=}"
        )
    assert num_launches["chained"] > num_launches["fresh"], f"{num_launches=}"
    assert engine.scheduler.page_tables["full_attention"].num_used_pages == 0


def test_sequences_come_back_complete_in_input_order_as_the_same_objects(case):
    engine = case["engine"]
    sequences = [Sequence(input_ids=ids, max_new_tokens=n) for ids, n in zip(case["prompts"], [3, 9, 1, 5, 7, 2, 4, 6])]
    returned = engine.generate(sequences)
    assert len(returned) == len(sequences) and all(a is b for a, b in zip(returned, sequences))
    for seq, n in zip(sequences, [3, 9, 1, 5, 7, 2, 4, 6]):
        assert seq.finished and (len(seq.output_ids) == n or seq.finish_reason == "stop")


def test_prompt_longer_than_max_seq_length_is_refused(case):
    with pytest.raises(ValueError, match="max_seq_length"):
        case["engine"].generate([Sequence(input_ids=[5] * 300)])


def test_text_sequences_are_tokenized_when_a_tokenizer_is_given(case, tiny_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(case["path"])
    engine = case["engine"]
    engine.tokenizer = tokenizer
    try:
        text = "A train travels 180 kilometres in 2 hours."
        [seq] = engine.generate([Sequence(text=text, max_new_tokens=5)])
    finally:
        engine.tokenizer = None
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert seq.input_ids == ids
    assert seq.output_ids == hf_greedy(case["hf"], [ids], 5, engine.end_ids)[0]


def test_compiled_decode_step_is_compiled_once_for_all_buckets_and_layers_and_matches_hf(tiny_dir, monkeypatch):
    """Sequences of different lengths shrink the batch through buckets 8, 4 and 2; the layers
    (all of one kind) share one compiled graph, also with an unmerged adapter, whose A and B differ
    from layer to layer. Every decode call reaches flex_attention in one dispatch state (its compiled
    frame guards the inputs' dispatch keys: two states compiled each decode kernel twice)."""
    from conftest import compiled_decode_regions
    from peft import PeftModel

    import qwen3_flex_inference

    flex_attention_compiled = qwen3_flex_inference.flex_attention_compiled
    decode_dispatch_states = set()

    def recording_flex_attention(q, *args, **kwargs):
        if q.shape[2] == 1:  # one query token a row: decode
            decode_dispatch_states.add(
                torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.ADInplaceOrView)
            )
        return flex_attention_compiled(q, *args, **kwargs)

    monkeypatch.setattr(qwen3_flex_inference, "flex_attention_compiled", recording_flex_attention)

    path = tiny_dir / "qwen3"
    hf = PeftModel.from_pretrained(load_hf(path), path / "lora").eval()
    engine = make_engine(path, max_batch_size=8, compile_decode=True, peft_model=hf, merge_lora=False)
    assert engine.unmerged_lora, "no unmerged adapter: the test would not cover the adapter's patches"
    engine.end_ids = set()
    prompts = random_prompts([5, 40, 70, 12, 33, 9, 21], hf.config.vocab_size, seed=11)
    new_tokens = [3, 24, 7, 16, 2, 11, 20]
    compiled_before = compiled_decode_regions()
    sequences = engine.generate([Sequence(input_ids=ids, max_new_tokens=n) for ids, n in zip(prompts, new_tokens)])
    assert engine.runner.buckets == [2, 4, 8]
    compiled = {region: n - compiled_before[region] for region, n in compiled_decode_regions().items()}
    assert compiled == {"prologue": 1, "layer": 1, "epilogue": 1}, f"compiled per bucket or per layer: {compiled}"
    assert len(decode_dispatch_states) == 1, "decode reached flex_attention in two dispatch states"
    for seq, ids, n in zip(sequences, prompts, new_tokens):
        assert seq.output_ids == hf_greedy(hf, [ids], n, set())[0]


def test_prefill_attention_compiles_once_for_every_packed_length(tiny_dir):
    """The packed prefill row's length is symbolic from the first compile: prefills of 256, 384 and
    512 tokens compile flex_attention once (before, the second length compiled every prefill kernel
    again: on the GPU a slow GRPO step). Tokens equal HF's at every length."""
    assert_prefill_attention_compiles_once(tiny_dir / "qwen3", "cpu")


def test_fused_projections_give_the_same_tokens_as_hf(case):
    engine = make_engine(case["path"], fuse_projections=True)
    attn = engine.runner.decoder.layers[0].self_attn
    assert attn.q_proj.weight.data_ptr() == attn.fused_qkv_weight.data_ptr(), "q_proj is not a view of the fused weight"
    assert generate(engine, case["prompts"]) == case["want"]


def test_an_error_mid_generate_leaves_no_slot_or_page_held(case):
    engine = make_engine(case["path"])
    launch_decode = engine.runner.launch_decode
    calls = []

    def failing_launch_decode(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return launch_decode(*args)

    engine.runner.launch_decode = failing_launch_decode
    with pytest.raises(KeyboardInterrupt):
        generate(engine, case["prompts"])
    table, slots = engine.scheduler.page_tables["full_attention"], engine.scheduler.slots
    assert table.num_used_pages == 0 and slots.num_free == slots.num_slots - 1
    engine.runner.launch_decode = launch_decode
    assert generate(engine, case["prompts"]) == case["want"]


@pytest.mark.parametrize("vocab_size", [448, 151936, 262144])
def test_first_argmax_equal_argmax_with_ties_eager_and_compiled(vocab_size):
    from qwen3_flex_inference import first_argmax

    generator = torch.Generator().manual_seed(vocab_size)
    logits_BV = torch.randn(5, vocab_size, generator=generator)
    logits_BV[1, [7, vocab_size // 2, vocab_size - 1]] = 100.0  # a tie across chunks: the first wins
    logits_BV[2, [3, 4]] = 100.0  # a tie inside one chunk
    logits_BV[3, -1] = 100.0  # the very last entry
    want = logits_BV.argmax(-1)
    assert torch.equal(first_argmax(logits_BV), want)
    assert torch.equal(torch.compile(first_argmax, fullgraph=True, dynamic=False)(logits_BV), want)


def test_head_dim_not_a_multiple_of_16_compiles_on_cpu_and_matches_hf(tiny_dir):
    """Inductor's C++ flex kernel was reported failing to compile at head_dim 12 ("cur_kvSplitSize4
    was not declared"); with torch 2.13 it compiles, prefill and decode, and the tokens equal HF's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_dir / "qwen3", head_dim=12)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    engine = FlexInference(
        AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval(), None, max_batch_size=2,
        max_seq_length=128, n_pages=32, page_size=16, max_new_tokens=8,
    )  # fmt: skip
    engine.runner.causal_lm.load_state_dict(hf.state_dict())
    engine.end_ids = set()
    prompts = random_prompts([5, 40, 23], config.vocab_size, seed=12)
    got = [seq.output_ids for seq in engine.generate([Sequence(input_ids=ids) for ids in prompts])]
    assert got == hf_greedy(hf, prompts, 8, set()), f"{got=}"


@pytest.mark.parametrize("name", ["qwen3", "gemma4_text"])
def test_the_model_given_to_the_engine_still_runs_hf_forward_with_the_same_logits(tiny_dir, name):
    """The engine patches the inference model's attention (and fuses its projections), but called
    outside the engine the model is HF's own: same logits before, after building and after generating."""
    from gemma4_flex_inference import FlexGemma4Inference

    path = tiny_dir / name
    model = load_hf(path)
    ids = torch.tensor(random_prompts([40], model.config.vocab_size, seed=5))
    with torch.no_grad():
        before = model(ids).logits
    engine_class = FlexGemma4Inference if name.startswith("gemma4") else FlexInference
    engine = engine_class(
        model, None, max_batch_size=2, max_seq_length=128, n_pages=32, page_size=16, max_new_tokens=4,
        fuse_projections=True,
    )  # fmt: skip
    engine.generate([Sequence(input_ids=ids[0].tolist())])
    with torch.no_grad():
        after = model(ids).logits
    assert (after - before).abs().max().item() < 1e-5
    # HF generate (with its own KV cache) on the patched model: a fresh model's tokens
    want = load_hf(path).generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False), want)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on the CPU only")
def test_cuda_graphs_on_the_cpu_raise_a_value_error_a_trainer_can_catch(case):
    from qwen3_flex_inference import FlexInferenceError

    with pytest.raises(FlexInferenceError, match="^CUDA graphs need a CUDA device$") as info:
        case["engine"].generate([Sequence(input_ids=case["prompts"][0])], capture_cudagraph=True)
    assert isinstance(info.value, ValueError)
