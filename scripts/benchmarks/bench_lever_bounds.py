"""The most two unbuilt decode fusions could save: the fastest mode's decode step with the work
each would fold away removed, against the whole step, on one model in one process.

- `no_ple`: every decoder layer without its per-layer-input (PLE) block (gate GEMM, activation times
  the layer's PLE slice, projection GEMM, norm, residual add): the bound on "the PLE path in one or
  two kernels", which would still pay one small GEMM's floor a layer.
- `no_combine`: the paged decode attention without its split-KV combine kernel (the splits' partial
  outputs are left uncombined): the bound on "the split combine folded into the attention kernel",
  which would still do the combine's arithmetic in the attention kernel's last split.

The outputs of a removed variant are wrong by design; only its step time is read. Each variant
runs bench_rollouts' engine (`engine_fused_compiled_graph`: fused projections, compiled step,
CUDA graphs, skinny GEMMs) on the same prompts: a warm-up round, then a timed one.

    python -m scripts.benchmarks.bench_lever_bounds --batch_sizes 1 64 256 --out bounds.json
"""

import argparse
import contextlib
import importlib.util
import json
import shlex
import sys
from pathlib import Path

if __name__ == "__main__" and importlib.util.find_spec("qwen3_flex_inference") is None:
    # NOTE: run by path, the repository root (the engine modules, scripts.*) is not on sys.path
    sys.exit(
        f"run it from the repository root ({Path(__file__).resolve().parents[2]}) as: "
        + shlex.join(["python", "-m", "scripts.benchmarks.bench_lever_bounds", *sys.argv[1:]])
    )

import torch

import qwen3_flex_inference as engine_module
from scripts.benchmarks.bench_rollouts import build_model, command_line, run_engine

VARIANTS = ("whole", "no_ple", "no_combine")


class _NoLaunch:
    """Stands in for a Triton kernel: `kernel[grid](...)` launches nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def removed(variant: str, model):
    """The model and engine module with `variant`'s work removed, restored on exit."""
    if variant == "no_ple":
        layers = model.model.layers
        ple_dims = [layer.hidden_size_per_layer_input for layer in layers]
        for layer in layers:  # HF's layer forward skips the block when this is 0
            layer.hidden_size_per_layer_input = 0
        try:
            yield
        finally:
            for layer, ple_dim in zip(layers, ple_dims):
                layer.hidden_size_per_layer_input = ple_dim
    elif variant == "no_combine":
        kernel = engine_module._paged_decode_combine_kernel
        engine_module._paged_decode_combine_kernel = _NoLaunch()
        try:
            yield
        finally:
            engine_module._paged_decode_combine_kernel = kernel
    else:
        yield


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="unsloth__gemma-4-E2B-it", help="preset name under scripts/presets")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS, help="variants to run")
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 64, 256], help="decode batch sizes")
    parser.add_argument("--prompt_len", type=int, default=128, help="prompt tokens per sequence")
    parser.add_argument("--new_tokens", type=int, default=512, help="new tokens per sequence (end ids ignored)")
    parser.add_argument("--dtype", default="bfloat16", help="model dtype")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_lever_bounds times CUDA graphs: it needs a CUDA device")
    device = torch.device("cuda")
    model = build_model(args.preset, device, getattr(torch, args.dtype))
    if "no_ple" in args.variants and not getattr(model.config, "hidden_size_per_layer_input", 0):
        raise SystemExit(f"--variants no_ple needs a model with per-layer inputs (Gemma-4): {args.preset} has none")
    rows = []
    for batch_size in args.batch_sizes:
        generator = torch.Generator().manual_seed(batch_size)
        prompts = torch.randint(3, model.config.vocab_size, (batch_size, args.prompt_len), generator=generator).tolist()
        for variant in args.variants:
            with removed(variant, model):
                result, engine = run_engine(
                    model, prompts, args.new_tokens, use_graph=True, compile_decode=True, fuse_projections=True
                )
                del engine
            row = {"variant": variant, "batch_size": batch_size, "ms_per_step": result["ms_per_step"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    whole = {row["batch_size"]: row["ms_per_step"] for row in rows if row["variant"] == "whole"}
    print("\n| variant | batch | ms a step | saved against the whole step |")
    print("|---|---|---|---|")
    for row in rows:
        base = whole.get(row["batch_size"])
        saved = f"{base - row['ms_per_step']:.3f} ms ({1 - row['ms_per_step'] / base:.1%})" if base else "-"
        print(f"| {row['variant']} | {row['batch_size']} | {row['ms_per_step']:.3f} | {saved} |")
    if args.out:
        setup = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "command": command_line("bench_lever_bounds"),
        }
        Path(args.out).write_text(json.dumps({"setup": setup, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
