"""The skinny decode GEMM: the Triton kernel of every config against an fp64 reference, its split-K
ticket counters back at 0 after every launch (triton's CPU interpreter, in a subprocess), and the
skinny_linear op's CPU fallback, eager and inside a torch.compile(fullgraph=True) graph with a
symbolic batch. The race against cuBLAS and the speed are GPU matters: scripts/benchmarks/bench_gemv.py.
"""

import json

import pytest
import torch
import torch._inductor.config as inductor_config
from conftest import gemm_ops, run_triton_interpreter_check

from qwen3_flex_inference import (
    SKINNY_CHOICES,
    SKINNY_CONFIGS,
    SKINNY_MAX_ROWS,
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
        assert case["tickets_left"] == 0, f"split-K ticket counters left set: {case=}"


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


def test_skinny_linear_multiplies_a_decode_input_with_a_strided_size_one_dim_as_one_gemm():
    """A compiled decode step can hand a linear its [rows, 1, K] input with strides (K, 1, 1): F.linear
    then runs a batched GEMM with the weight broadcast (read once per row), skinny_linear one GEMM."""
    generator = torch.Generator().manual_seed(0)
    x_B1K = torch.randn(8 * 64, generator=generator).as_strided((8, 1, 64), (64, 1, 1))
    weight = torch.randn(48, 64, generator=generator)
    assert gemm_ops(lambda: torch.nn.functional.linear(x_B1K, weight)) == {"aten::bmm"}, "the input folds: no case"
    assert gemm_ops(lambda: skinny_linear(x_B1K, weight)) == {"aten::mm"}
    torch.testing.assert_close(skinny_linear(x_B1K, weight), torch.nn.functional.linear(x_B1K, weight))


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


def test_a_race_is_saved_once_and_a_later_process_reads_its_pick_without_racing(tmp_path, monkeypatch):
    """skinny_choice: the first call of a key races and writes the pick to the cache file; a later
    process (the file read afresh) gets the saved pick, marked "saved", and races nothing; another
    key races again and keeps the first. No cache folder: every call races."""
    import qwen3_flex_inference as engine

    races = []

    def race(x2d_MK, w_NK):
        races.append(tuple(w_NK.shape))
        return {"winner": len(races) - 1, "us": {"cublas": 9.0, len(races) - 1: 4.5}, "failed": {}}

    path = tmp_path / "skinny_choices_test.json"
    monkeypatch.setattr(engine, "race_skinny_backends", race)
    monkeypatch.setattr(engine, "skinny_cache_path", lambda device: path)
    monkeypatch.setattr(engine, "SKINNY_SAVED", {})
    x, w = torch.zeros(2, 8), torch.zeros(16, 8)
    first = engine.skinny_choice((16, 8, "float32", 2), x, w)
    assert first["winner"] == 0 and "saved" not in first and races == [(16, 8)]
    monkeypatch.setattr(engine, "SKINNY_SAVED", {})  # a later process
    again = engine.skinny_choice((16, 8, "float32", 2), x, w)
    assert again == {**first, "us": {"cublas": 9.0, "0": 4.5}, "saved": True} and races == [(16, 8)]
    other = engine.skinny_choice((16, 8, "float32", 4), x, w)
    assert other["winner"] == 1 and races == [(16, 8), (16, 8)]
    assert set(json.loads(path.read_text())) == {"16,8,float32,2", "16,8,float32,4"}
    assert [p.name for p in tmp_path.iterdir()] == [path.name], "a temporary file was left"
    monkeypatch.setattr(engine, "skinny_cache_path", lambda device: None)
    engine.skinny_choice((16, 8, "float32", 2), x, w)
    assert len(races) == 3, "without a cache folder every call races"


def test_the_cache_folder_comes_from_the_environment_and_empty_turns_it_off(monkeypatch, tmp_path):
    """The cache file's folder is $FLEX_INFERENCE_CACHE_DIR (empty: no cache), its name a hash of
    what can change a pick (here TF32; the GPU and software are stand-ins on the CPU)."""
    import qwen3_flex_inference as engine

    def kernel():
        pass

    monkeypatch.setattr(engine.torch.cuda, "get_device_properties", lambda device: type("P", (), {"name": "gpu"}))
    monkeypatch.setattr(engine, "triton", type("T", (), {"__version__": "0"}))
    monkeypatch.setattr(engine, "_skinny_matmul_kernel", type("K", (), {"fn": kernel}), raising=False)
    monkeypatch.setattr(engine, "is_programmatic_launch_on", lambda device: False)
    monkeypatch.setenv(engine.SKINNY_CACHE_DIR_ENV, str(tmp_path))
    path = engine.skinny_cache_path(torch.device("cuda"))
    assert path.parent == tmp_path and path.name.startswith("skinny_choices_")
    matmul = torch.backends.cuda.matmul
    allow_tf32 = matmul.allow_tf32
    matmul.allow_tf32 = not allow_tf32
    try:
        assert engine.skinny_cache_path(torch.device("cuda")) != path, "TF32 can change a pick: another file"
    finally:
        matmul.allow_tf32 = allow_tf32
    assert engine.skinny_cache_path(torch.device("cuda")) == path
    monkeypatch.setenv(engine.SKINNY_CACHE_DIR_ENV, "")
    assert engine.skinny_cache_path(torch.device("cuda")) is None


def test_a_build_only_call_builds_the_kernel_its_launch_would_run_and_launches_nothing(monkeypatch):
    """skinny_matmul_triton(build_only=True), which the race runs for every config on threads first
    (build_skinny_configs), passes Triton's warmup what the launch passes its kernel, as Triton tells
    kernels apart (each tensor's dtype and 16-byte alignment, each int's divisibility by 16 and
    being 1, the same constants), over zero-size outputs, and launches nothing."""
    import qwen3_flex_inference as engine

    if engine.triton is None:
        pytest.skip("triton is not installed")
    calls = []

    class RecordingKernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append(("launch", grid, args, kwargs))

        def warmup(self, *args, grid, **kwargs):
            calls.append(("build", grid, args, kwargs))

    def specialized(arg):
        if isinstance(arg, torch.Tensor):
            return arg.dtype, arg.data_ptr() % 16 == 0
        if isinstance(arg, int) and not isinstance(arg, bool):
            return arg % 16 == 0, arg == 1
        return arg

    monkeypatch.setattr(engine, "_skinny_matmul_kernel", RecordingKernel())
    monkeypatch.setattr(engine, "_skinny_tickets", {})
    x_MK, w_NK = torch.randn(3, 64, dtype=torch.bfloat16), torch.randn(48, 64, dtype=torch.bfloat16)
    for config in SKINNY_CONFIGS:
        calls.clear()
        assert engine.skinny_matmul_triton(x_MK, w_NK, config, build_only=True) is None
        assert engine.skinny_matmul_triton(x_MK, w_NK, config) is not None
        (build, build_grid, build_args, build_kwargs), (launch, launch_grid, launch_args, launch_kwargs) = calls
        assert (build, launch) == ("build", "launch") and build_grid == launch_grid
        assert (
            list(map(specialized, build_args)) == list(map(specialized, launch_args)) and build_kwargs == launch_kwargs
        )
        assert all(arg.numel() == 0 for arg in build_args[2:4]), "a build allocated outputs"
