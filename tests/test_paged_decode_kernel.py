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
