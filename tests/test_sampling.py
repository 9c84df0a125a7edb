"""Sampling for RL rollouts against Hugging Face (float32, CPU): the distribution of the sampled
tokens, their log-probs, seeds that fix the draws whatever the batch, n completions on shared
prompt pages, stop ids, and weight refreshes between rollouts."""

import dataclasses
import math

import pytest
import torch
from conftest import hf_greedy, load_hf, random_prompts
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from gemma4_flex_inference import FlexGemma4Inference
from qwen3_flex_inference import FlexInference, FlexInferenceError, SamplingParams, Sequence

MAX_NEW_TOKENS = 16


def make_engine(path, engine_class=FlexInference, model=None, **overrides):
    limits = dict(max_batch_size=8, max_seq_length=256, n_pages=64, page_size=16, max_new_tokens=MAX_NEW_TOKENS)
    return engine_class(model if model is not None else load_hf(path), None, **{**limits, **overrides})


@pytest.fixture(scope="module")
def qwen3(tiny_dir):
    path = tiny_dir / "qwen3"
    return dict(path=path, hf=load_hf(path), engine=make_engine(path))


def hf_logprobs(hf, seq: Sequence, temperature: float) -> torch.Tensor:
    """log_softmax(HF logits / T) at each generated token (T = 0: log_softmax(logits)), teacher-forced."""
    with torch.no_grad():
        logits = hf(torch.tensor([seq.token_ids])).logits[0, len(seq.input_ids) - 1 : -1]
    logprobs = torch.log_softmax(logits / (temperature or 1.0), -1)
    return logprobs.gather(1, torch.tensor(seq.output_ids)[:, None]).squeeze(1)


def filtered_probs(logits_V: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """HF's sampling distribution: its temperature, top-k, top-p and min-p warpers, in HF's order."""
    scores = TemperatureLogitsWarper(params.temperature)(None, logits_V[None])
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    if params.min_p:
        scores = MinPLogitsWarper(params.min_p)(None, scores)
    return torch.softmax(scores[0], -1)


def chi_square_critical(dof: int, z: float = 3.09) -> float:
    """The chi-square value a right tail of ~0.001 starts at (Wilson-Hilferty)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=20),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=1.2, min_p=0.1),
        SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05),
    ],
    ids=["plain", "top_k", "top_p", "min_p", "top_k_top_p_min_p"],
)
def test_first_sampled_token_follows_hf_filtered_softmax_and_never_leaves_the_kept_set(qwen3, params):
    prompt = random_prompts([11], qwen3["hf"].config.vocab_size, seed=31)[0]
    num_draws = 2048
    engine = make_engine(qwen3["path"], model=qwen3["engine"].model, max_batch_size=64)
    groups = engine.rollouts(
        [prompt], SamplingParams(**{**vars(params), "n": num_draws, "seed": 5, "max_new_tokens": 1})
    )
    tokens = torch.tensor([seq.output_ids[0] for seq in groups[0]])
    with torch.no_grad():
        probs_V = filtered_probs(qwen3["hf"](torch.tensor([prompt])).logits[0, -1], params)
    counts_V = torch.bincount(tokens, minlength=len(probs_V)).double()
    outside = counts_V[probs_V == 0].sum().item()
    assert outside == 0, f"{outside} draws outside the kept set"
    expected_V = probs_V.double() * num_draws
    # bins expected at least 5 times; the rest merged into one
    is_big = expected_V >= 5
    observed = torch.cat([counts_V[is_big], counts_V[~is_big & (probs_V > 0)].sum()[None]])
    expected = torch.cat([expected_V[is_big], expected_V[~is_big & (probs_V > 0)].sum()[None]])
    observed, expected = observed[expected > 0], expected[expected > 0]
    chi_square = ((observed - expected) ** 2 / expected).sum().item()
    dof = len(expected) - 1
    assert dof >= 1, f"{dof=}: the kept set is a single token, the test proves nothing"
    assert chi_square < chi_square_critical(dof), f"{chi_square=:.1f} {dof=} {chi_square_critical(dof)=:.1f}"


@pytest.mark.parametrize("name", ["qwen3", "llama"])
@pytest.mark.parametrize("temperature, top_p", [(0.8, 0.9), (0.0, 1.0)], ids=["sampled", "greedy"])
def test_logprobs_equal_hf_log_softmax_of_logits_over_temperature_within_1e_4(tiny_dir, name, temperature, top_p):
    path = tiny_dir / name
    hf, engine = load_hf(path), make_engine(path)
    prompts = random_prompts([5, 40, 23], hf.config.vocab_size, seed=17)
    params = SamplingParams(temperature=temperature, top_p=top_p, n=2, seed=3, logprobs=True)
    for group in engine.rollouts(prompts, params):
        for seq in group:
            assert len(seq.output_logprobs) == len(seq.output_ids), f"{len(seq.output_logprobs)=}"
            err = (torch.tensor(seq.output_logprobs) - hf_logprobs(hf, seq, temperature)).abs().max().item()
            assert err < 1e-4, f"{name} {temperature=} {err=}"
    if temperature == 0:  # greedy with log-probs: still HF's argmax tokens
        want = hf_greedy(hf, prompts, MAX_NEW_TOKENS, engine.end_ids)
        assert [group[0].output_ids for group in engine.rollouts(prompts, params)] == want


def test_same_seed_gives_the_same_tokens_alone_in_a_full_batch_under_preemption_and_in_another_bucket(qwen3):
    hf, engine = qwen3["hf"], qwen3["engine"]
    prompts = random_prompts([30, 5, 70, 17, 48, 3, 90, 21], hf.config.vocab_size, seed=8)
    params = SamplingParams(temperature=1.0, top_k=40, top_p=0.95, seed=1234, max_new_tokens=40, ignore_eos=True)

    def run(engine, sequences, target_idx=0):
        engine.generate(sequences)
        return sequences[target_idx].output_ids

    def others(num_prompts=7):
        other_params = [SamplingParams(temperature=1.0, seed=i, max_new_tokens=40, ignore_eos=True) for i in range(7)]
        return [Sequence(input_ids=ids, sampling=p) for ids, p in zip(prompts[1 : 1 + num_prompts], other_params)]

    alone = run(engine, [Sequence(input_ids=prompts[0], sampling=params)])  # bucket 1
    in_full_batch = run(engine, [Sequence(input_ids=prompts[0], sampling=params), *others()])  # bucket 8
    # 17 pages of 16 tokens hold the 5 prompts but not 40 new tokens for each; the sequence is
    # admitted last, so it is the first to be preempted
    small_pool = make_engine(qwen3["path"], model=engine.model, n_pages=18, max_seq_length=128)
    target = Sequence(input_ids=prompts[0], sampling=params)
    under_preemption = run(small_pool, [*others(4), target], target_idx=-1)
    assert target.num_preemptions > 0, "the small pool did not preempt the sequence"
    assert alone == in_full_batch == under_preemption, f"{alone=} {in_full_batch=} {under_preemption=}"
    other_seed = run(
        engine, [Sequence(input_ids=prompts[0], sampling=SamplingParams(**{**vars(params), "seed": 1235}))]
    )
    assert other_seed != alone, "another seed drew the same tokens"


@pytest.mark.parametrize("name", ["qwen3", "gemma4_text"])
def test_n_completions_share_prompt_pages_equal_separate_sequences_and_give_the_pages_back(tiny_dir, name):
    engine_class = FlexGemma4Inference if name.startswith("gemma4") else FlexInference
    engine = make_engine(tiny_dir / name, engine_class, max_new_tokens=30)
    engine.end_ids = set()
    prompts = random_prompts([37, 16, 50], engine.config.vocab_size, seed=23)
    params = SamplingParams(temperature=1.0, top_p=0.9, n=8, seed=100, logprobs=True)
    free_before = {regime: table.num_free_pages for regime, table in engine.scheduler.page_tables.items()}
    most_used = []
    launch_decode = engine.runner.launch_decode

    def counted_launch_decode(rows, use_graph, previous=None):
        most_used.append(engine.scheduler.page_tables["full_attention"].num_used_pages)
        return launch_decode(rows, use_graph, previous)

    engine.runner.launch_decode = counted_launch_decode
    groups = engine.rollouts(prompts, params)
    shared_most, most_used[:] = max(most_used), []
    separate = [
        Sequence(
            input_ids=prompt, sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i * 8 + j, logprobs=True)
        )
        for i, prompt in enumerate(prompts)
        for j in range(8)
    ]
    engine.generate(separate)
    engine.runner.launch_decode = launch_decode
    shared = [seq for group in groups for seq in group]
    assert [seq.output_ids for seq in shared] == [seq.output_ids for seq in separate]
    assert [seq.seed for seq in groups[0]] == list(range(100, 108))
    assert len({tuple(seq.output_ids) for seq in groups[0]}) > 1, "the 8 completions are all the same"
    assert shared_most < max(most_used), f"sharing held {shared_most} pages, separate prompts {max(most_used)}"
    free_after = {regime: table.num_free_pages for regime, table in engine.scheduler.page_tables.items()}
    assert free_after == free_before, f"{free_before=} {free_after=}"


def test_stop_token_ids_add_to_the_end_ids_and_ignore_eos_ignores_the_model_s(qwen3):
    engine = qwen3["engine"]
    prompt = random_prompts([20], qwen3["hf"].config.vocab_size, seed=41)[0]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW_TOKENS)
    [free] = engine.generate([Sequence(input_ids=prompt, sampling=greedy)])
    stop_id = free.output_ids[4]
    [stopped] = engine.generate(
        [Sequence(input_ids=prompt, sampling=SamplingParams(**{**vars(greedy), "stop_token_ids": (stop_id,)}))]
    )
    assert (
        stopped.output_ids == free.output_ids[: free.output_ids.index(stop_id) + 1] and stopped.finish_reason == "stop"
    )
    end_ids = engine.end_ids
    engine.end_ids = {stop_id}  # the model's own end id, for this check
    try:
        [ignored] = engine.generate(
            [Sequence(input_ids=prompt, sampling=SamplingParams(**{**vars(greedy), "ignore_eos": True}))]
        )
        [honoured] = engine.generate([Sequence(input_ids=prompt, sampling=greedy)])
    finally:
        engine.end_ids = end_ids
    assert ignored.output_ids == free.output_ids[: len(ignored.output_ids)] and ignored.finish_reason == "length"
    assert honoured.finish_reason == "stop"


def test_load_weights_and_refresh_lora_between_rollouts_follow_the_new_weights(tiny_dir):
    from peft import PeftModel

    from qwen3_flex_inference import lora_layers

    path = tiny_dir / "qwen3"
    engine = make_engine(path, fuse_projections=True)
    prompts = random_prompts([9, 33], engine.config.vocab_size, seed=51)
    params = SamplingParams(temperature=0.9, n=2, seed=9, logprobs=True)
    before = engine.rollouts(prompts, params)
    new_weights = load_hf(path)
    with torch.no_grad():
        for param in new_weights.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    engine.load_weights(new_weights.state_dict().items())
    after = engine.rollouts(prompts, params)
    assert [s.output_ids for g in after for s in g] != [s.output_ids for g in before for s in g]
    for seq in (seq for group in after for seq in group):
        err = (torch.tensor(seq.output_logprobs) - hf_logprobs(new_weights, seq, 0.9)).abs().max().item()
        assert err < 1e-4, f"load_weights: {err=}"
    assert [g[0].output_ids for g in engine.rollouts(prompts, SamplingParams(temperature=0.0, n=1))] == hf_greedy(
        new_weights, prompts, MAX_NEW_TOKENS, engine.end_ids
    )
    with pytest.raises(FlexInferenceError, match="no weight named"):
        engine.load_weights({"model.layers.0.no_such.weight": torch.zeros(1)})

    peft_model = PeftModel.from_pretrained(load_hf(path), path / "lora")
    lora_engine = make_engine(path, model=peft_model, peft_model=peft_model)
    lora_engine.rollouts(prompts, params)
    with torch.no_grad():
        for layer in lora_layers(peft_model).values():
            layer.lora_B["default"].weight.mul_(-1.5)
    lora_engine.refresh_lora()
    reference = PeftModel.from_pretrained(load_hf(path), path / "lora")
    reference.load_state_dict({k: v for k, v in peft_model.state_dict().items() if "lora_" in k}, strict=False)
    merged = reference.merge_and_unload()
    for seq in (seq for group in lora_engine.rollouts(prompts, params) for seq in group):
        err = (torch.tensor(seq.output_logprobs) - hf_logprobs(merged, seq, 0.9)).abs().max().item()
        assert err < 1e-4, f"refresh_lora: {err=}"


def test_text_prompts_get_the_bos_token_exactly_once(tiny_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "gemma4_text")
    engine = make_engine(tiny_dir / "gemma4_text", FlexGemma4Inference)
    engine.tokenizer = tokenizer
    raw = "A train travels 180 kilometres in 2 hours."
    chat = tokenizer.apply_chat_template([{"role": "user", "content": raw}], add_generation_prompt=True, tokenize=False)
    bos = tokenizer.bos_token_id
    for text in (raw, chat):
        [[seq]] = engine.rollouts([text], SamplingParams(temperature=0.0, max_new_tokens=2))
        assert seq.input_ids[0] == bos and seq.input_ids.count(bos) == 1, f"{text[:20]!r}: {seq.input_ids[:5]}"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.5}, "temperature must be a finite number of at least 0"),
        ({"temperature": math.inf}, "temperature must be a finite number"),
        ({"temperature": math.nan}, "temperature must be a finite number"),
        ({"top_p": 0.0}, "top_p must be in"),
        ({"top_p": 1.5}, "top_p must be in"),
        ({"top_k": -1}, "top_k must be at least 0"),
        ({"min_p": 2.0}, "min_p must be in"),
        ({"n": 0}, "n must be at least 1"),
        ({"max_new_tokens": 0}, "max_tokens must be at least 1"),
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"max_tokens": 8, "max_new_tokens": 16}, "are one setting"),
        ({"logprobs": 1}, "only the sampled token's log-prob"),
        ({"logprobs": 5}, "only the sampled token's log-prob"),
        ({"logprobs": -1}, "logprobs must be None or 0"),
    ],
)
def test_bad_sampling_params_are_refused_with_one_sentence(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        SamplingParams(**kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "kwargs, max_tokens, is_logprobs",
    [
        ({"max_tokens": 16}, 16, False),
        ({"max_new_tokens": 16}, 16, False),
        ({"max_tokens": 16, "max_new_tokens": 16}, 16, False),
        ({"logprobs": 0}, None, True),
        ({"logprobs": True}, None, True),
        ({"logprobs": None}, None, False),
        ({"logprobs": False}, None, False),
    ],
)
def test_sampling_params_take_vllms_max_tokens_and_logprobs_and_hfs_max_new_tokens(kwargs, max_tokens, is_logprobs):
    params = SamplingParams(**kwargs)
    assert (params.max_tokens, params.is_logprobs) == (max_tokens, is_logprobs), f"{kwargs=} {params=}"
    copy = dataclasses.replace(params, max_tokens=4)  # TRL's adapter and rollouts copy params so
    assert (copy.max_tokens, copy.is_logprobs) == (4, is_logprobs), f"{copy=}"


def test_strings_chats_and_token_ids_go_in_as_vllm_takes_them_and_give_the_same_completion(qwen3):
    """generate takes a string (raw text), a chat (the chat template with the generation prompt) and
    token ids alike, with vLLM's SamplingParams; rollouts takes chats too."""
    from transformers import AutoTokenizer

    from qwen3_flex_inference import tokenize_prompt

    tokenizer = AutoTokenizer.from_pretrained(qwen3["path"])
    engine = make_engine(qwen3["path"], model=qwen3["engine"].model)
    engine.tokenizer = tokenizer
    chat = [{"role": "user", "content": "What is 2 + 3?"}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = tokenize_prompt(tokenizer, text)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=6, logprobs=0, ignore_eos=True)
    as_chat, as_text, as_ids = engine.generate([chat, text, ids], params)
    for name, seq in [("chat", as_chat), ("text", as_text), ("ids", as_ids)]:
        assert isinstance(seq, Sequence) and seq.input_ids == ids, f"{name}: {seq.input_ids=} {ids=}"
        assert seq.output_ids == as_ids.output_ids and len(seq.output_ids) == 6, f"{name}: {seq.output_ids=}"
        assert len(seq.output_logprobs) == 6 and seq.output_logprobs == as_ids.output_logprobs, f"{name}"
    [group] = engine.rollouts([chat], dataclasses.replace(params, n=2))
    assert group[0].input_ids == ids and group[0].output_ids == as_ids.output_ids, f"{group[0].output_ids=}"
    err = max(abs(a - b) for a, b in zip(group[0].output_logprobs, as_ids.output_logprobs))
    assert err < 1e-5, f"{err=}"  # another batch: the same draws, log-probs within rounding
    [greedy] = engine.generate(["What is 2 + 3?"])
    assert greedy.finish_reason in ("stop", "length") and greedy.output_ids and not greedy.output_logprobs


def test_a_sequence_asking_for_n_completions_is_sent_to_rollouts(qwen3):
    with pytest.raises(FlexInferenceError, match="use rollouts"):
        qwen3["engine"].generate([Sequence(input_ids=[5, 6, 7], sampling=SamplingParams(n=2))])


def test_compiled_decode_step_samples_the_eager_tokens(qwen3):
    """The sampling epilogue compiled with the step (symbolic batch, fused projections) draws the
    same tokens as the eager step."""
    prompts = random_prompts([5, 40, 23], qwen3["hf"].config.vocab_size, seed=71)
    params = SamplingParams(temperature=0.9, top_p=0.9, n=3, seed=77, logprobs=True)
    # batch slots of its own (4): the compile-count tests elsewhere in the suite see none of its graphs
    compiled = make_engine(qwen3["path"], compile_decode=True, fuse_projections=True, max_batch_size=4)
    got = [seq for group in compiled.rollouts(prompts, params) for seq in group]
    want = [seq for group in qwen3["engine"].rollouts(prompts, params) for seq in group]
    assert [seq.output_ids for seq in got] == [seq.output_ids for seq in want]
    err = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g.output_logprobs, w.output_logprobs))
    assert err < 1e-4, f"{err=}"


@pytest.mark.parametrize("vocab_size", [448, 1000, 997])  # 64 chunks of 7, 8 of 125, one chunk
@pytest.mark.parametrize("is_filtered", [False, True], ids=["plain", "filtered"])
def test_sample_tokens_log_probs_equal_log_softmax_and_greedy_rows_take_the_first_maximum(vocab_size, is_filtered):
    """The chunked log-normaliser equals log_softmax's (a chunk of -inf included), and greedy rows
    among sampled ones take argmax's first index; compiled alike (one case: compiles are slow)."""
    from qwen3_flex_inference import sample_tokens

    generator = torch.Generator().manual_seed(vocab_size)
    logits_BV = torch.randn(4, vocab_size, generator=generator) * 4
    logits_BV[0, [5, vocab_size - 3]] = 50.0  # a greedy row with a tie across chunks: the first wins
    logits_BV[1, :250] = -torch.inf  # whole chunks of -inf
    float_params_B3 = torch.tensor([[0.0, 1.0, 0.0], [0.7, 0.9, 0.0], [1.0, 1.0, 0.05], [1.3, 0.8, 0.0]])
    int_params_B2 = torch.tensor([[0, 1], [20, 2], [0, 3], [0, 4]])
    position_B = torch.tensor([10, 11, 12, 13])
    want_logprobs_BV = torch.log_softmax(logits_BV / torch.tensor([1.0, 0.7, 1.0, 1.3])[:, None], -1)
    inputs = (logits_BV, float_params_B3, int_params_B2, position_B, is_filtered)
    results = [sample_tokens(*inputs)]
    if vocab_size == 1000 and not is_filtered:
        results.append(torch.compile(sample_tokens, fullgraph=True, dynamic=False)(*inputs))
    eager_tokens_B = results[0][0]
    for tokens_B, logprobs_B in results:
        assert tokens_B[0].item() == 5
        assert torch.equal(tokens_B, eager_tokens_B)
        assert logits_BV.gather(1, tokens_B[:, None]).isfinite().all()
        want_B = want_logprobs_BV.gather(1, tokens_B[:, None]).squeeze(1)
        assert (logprobs_B - want_B).abs().max().item() < 1e-5, f"{logprobs_B=} {want_B=}"
