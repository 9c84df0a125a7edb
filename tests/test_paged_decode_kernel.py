"""The Triton paged decode attention kernel (the engine's decode attention on CUDA) against an
fp64 reference over the same pages, in triton's CPU interpreter (a subprocess): GQA groups,
head_dims 64-512 and one that is no power of two, sliding windows whose left edge trims whole
pages, rows of one position, one split and several (with splits a short row never reaches);
and the engine's eager decode with the kernel as its decode attention, in the interpreter too,
against HF's greedy tokens. Its speed against flex_attention's decode kernel, and the compiled
step under CUDA graphs with it, are GPU matters: scripts/benchmarks/bench_decode_attention.py and
tests/test_gpu.py.
"""

from conftest import run_triton_interpreter_check

from tests.paged_decode_kernel_check import CASES

# ||out - ref|| / ||ref|| per row; bf16: the output and the probabilities fed to the PV product
# are rounded to 8 bits, as in flex_attention's kernel.
MAX_REL_ERR = {"float32": 1e-5, "bfloat16": 1e-2}


def test_paged_decode_kernel_matches_fp64_reference_in_interpreter():
    cases = run_triton_interpreter_check("tests.paged_decode_kernel_check")
    assert len(cases) == len(CASES)
    for case in cases:
        assert "error" not in case, f"{case=}"
        assert case["rel_err"] < MAX_REL_ERR[case["dtype"]], f"{case=}"


def test_engine_decode_through_the_paged_kernel_gives_hf_tokens_in_interpreter():
    cases = run_triton_interpreter_check("tests.paged_decode_engine_check")
    assert {case["checkpoint"] for case in cases} == {"qwen3", "gemma4_text"}
    for case in cases:
        assert case["num_calls"] > 0, f"the kernel never ran: {case=}"
        assert case["equal"], f"{case=}"


def test_recorded_launches_write_nothing_and_tell_kernel_variants_apart():
    """Inside recording_triton_launches the paged kernel and its combine are recorded, not launched
    (on the CPU, without the interpreter, a launch would fail); triton_variant tells the launches' kernels apart by what
    Triton builds per variant: a batch of other size is the same kernel, another split count not."""
    import torch

    from qwen3_flex_inference import paged_decode_attention_triton, recording_triton_launches, triton_variant

    def launches(num_rows: int, num_splits: int) -> list:
        q = torch.randn(num_rows, 4, 1, 64)
        k_cache, v_cache = torch.randn(2, 1, 2, 64, 64).unbind(0)
        pages_BP, input_pos_B = torch.ones(num_rows, 4, dtype=torch.int32), torch.full((num_rows,), 40)
        with recording_triton_launches() as recorded:
            paged_decode_attention_triton(q, k_cache, v_cache, pages_BP, input_pos_B, 16, None, 0.125, num_splits)
        return recorded

    two_rows = launches(2, 4)
    names = [kernel.__name__ for kernel, *_ in two_rows]
    assert names == ["_paged_decode_attention_kernel", "_paged_decode_combine_kernel"]
    assert [grid for _, grid, *_ in two_rows] == [(2, 2, 4), (2, 4)]
    assert list(map(triton_variant, launches(3, 4))) == list(map(triton_variant, two_rows))
    one_split = launches(2, 1)
    assert len(one_split) == 1 and triton_variant(one_split[0]) != triton_variant(two_rows[0])
