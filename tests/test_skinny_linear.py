"""The skinny decode GEMM: the Triton kernel of every config against an fp64 reference, and its
fused prologues / epilogues against the same computation in torch ops (triton's CPU interpreter,
in a subprocess); the skinny_linear and fused_skinny_linear ops' CPU fallbacks, eager and inside a
torch.compile(fullgraph=True) graph with a symbolic batch. The race against cuBLAS and the speed
are GPU matters: scripts/benchmarks/bench_gemv.py.
"""

import pytest
import torch
import torch._inductor.config as inductor_config
from conftest import run_triton_interpreter_check

from qwen3_flex_inference import (
    SKINNY_CHOICES,
    SKINNY_CONFIGS,
    SKINNY_MAX_ROWS,
    SkinnyFusion,
    fused_skinny_linear,
    fused_skinny_linear_reference,
    is_programmatic_launch_on,
    programmatic_launch_settings,
    skinny_linear,
)

# ||out - ref|| / ||ref|| against x.double() @ w.double().T; bf16 outputs are rounded to 8 bits.
MAX_REL_ERR = {"float32": 1e-5, "bfloat16": 1e-2}


def test_triton_kernel_of_every_config_matches_fp64_reference_in_interpreter():
    cases = run_triton_interpreter_check("tests.skinny_kernel_check")
    assert {case["config"] for case in cases} == set(range(len(SKINNY_CONFIGS))), f"{len(cases)=}"
    for case in cases:
        assert "error" not in case, f"{case=}"
        assert case["rel_err"] < MAX_REL_ERR[case["dtype"]], f"{case=}"


def test_fused_kernel_of_every_prologue_and_epilogue_matches_torch_ops_in_interpreter():
    """Each fusion, one-launch and split-K (the ticketed reduction, its counters left at 0): within
    rounding of the same ops in torch in that dtype, and (bf16) as close to float64 as they are."""
    from tests.fused_skinny_kernel_check import FUSIONS

    cases = run_triton_interpreter_check("tests.fused_skinny_kernel_check")
    assert {case["fusion"] for case in cases} == set(FUSIONS), f"{len(cases)=}"
    for case in cases:
        assert "error" not in case, f"{case=}"
        assert case["tickets_left"] == 0, f"{case=}"
        if case["dtype"] == "float32":
            assert case["rel_err"] < 2e-6, f"{case=}"
        else:
            assert case["rel_err"] < 5e-3, f"{case=}"
            assert case["rel_err_fp64"] <= 1.1 * case["ref_rel_err_fp64"] + 1e-4, f"{case=}"


def test_fused_skinny_linear_on_cpu_is_its_torch_reference_eager_and_compiled():
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(2 * 40, 96, generator=generator) / 10
    norm_weight = torch.randn(96, generator=generator) + 1

    def gate_up(x_B1K, weight, norm_weight):
        return fused_skinny_linear(x_B1K, weight, norm_weight, True, None, None, None, None, 1e-6)

    compiled = torch.compile(gate_up, fullgraph=True)
    for batch in (3, 8):
        x_B1K = torch.randn(batch, 1, 96, generator=generator)
        torch._dynamo.mark_dynamic(x_B1K, 0)
        want = fused_skinny_linear_reference(x_B1K, weight, SkinnyFusion(norm_weight, is_gated=True))
        assert want.shape == (batch, 1, 40)
        assert torch.equal(gate_up(x_B1K, weight, norm_weight), want)
        assert torch.allclose(compiled(x_B1K, weight, norm_weight), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("x_shape", [(1, 64), (3, 1, 64), (SKINNY_MAX_ROWS, 64), (SKINNY_MAX_ROWS + 1, 64), (2, 5, 64)])
def test_skinny_linear_on_cpu_is_bitwise_f_linear(x_shape):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(x_shape, generator=generator)
    weight = torch.randn(48, 64, generator=generator)
    choices_before = dict(SKINNY_CHOICES)
    got = skinny_linear(x, weight)
    want = torch.nn.functional.linear(x, weight)
    assert got.shape == want.shape and torch.equal(got, want), f"{x_shape=} {(got - want).abs().max()=}"
    assert SKINNY_CHOICES == choices_before, f"the CPU fallback raced backends: {SKINNY_CHOICES=}"


def test_skinny_linear_in_compiled_graph_with_symbolic_batch_is_f_linear_and_compiled_once():
    from conftest import compiled_variants

    def project(hidden_B1K, weight):
        return skinny_linear(hidden_B1K, weight)

    compiled = torch.compile(project, fullgraph=True)
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(40, 96, generator=generator)
    compiled_before = compiled_variants(project)
    for batch in (3, 8, 5):
        hidden_B1K = torch.randn(batch, 1, 96, generator=generator)
        torch._dynamo.mark_dynamic(hidden_B1K, 0)
        got = compiled(hidden_B1K, weight)
        want = torch.nn.functional.linear(hidden_B1K, weight)
        assert got.shape == want.shape and torch.equal(got, want), f"{batch=} {(got - want).abs().max()=}"
    assert compiled_variants(project) - compiled_before == 1, "the graph was recompiled for another batch size"


def test_programmatic_launch_is_on_only_inside_its_settings_and_yields_to_the_environment(monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_ENABLE_PDL", raising=False)
    before = inductor_config.triton.enable_pdl
    with programmatic_launch_settings():
        assert inductor_config.triton.enable_pdl
        assert not is_programmatic_launch_on(torch.device("cpu"))  # CUDA (Hopper or later) only
    assert inductor_config.triton.enable_pdl == before
    monkeypatch.setenv("TORCHINDUCTOR_ENABLE_PDL", "0")
    with programmatic_launch_settings():
        assert not inductor_config.triton.enable_pdl
