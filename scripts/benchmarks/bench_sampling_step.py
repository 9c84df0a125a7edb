"""The token choice alone: the compiled greedy argmax against the compiled sampling step (temperature
1 with log-probs; and with top-k 50 + top-p 0.9 on top), per batch size, over E2B's vocabulary.

    python -m scripts.benchmarks.bench_sampling_step --out sampling_step.json
"""

import argparse
import importlib.util
import json
import shlex
import sys
import time
from pathlib import Path

if __name__ == "__main__" and importlib.util.find_spec("qwen3_flex_inference") is None:
    # NOTE: run by path, the repository root (the engine modules, scripts.*) is not on sys.path
    sys.exit(
        f"run it from the repository root ({Path(__file__).resolve().parents[2]}) as: "
        + shlex.join(["python", "-m", "scripts.benchmarks.bench_sampling_step", *sys.argv[1:]])
    )

import torch

from qwen3_flex_inference import first_argmax, sample_tokens


def time_ms(fn, *args, repeats: int = 20) -> float:
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 64, 256], help="rows")
    parser.add_argument("--vocab_size", type=int, default=262144, help="vocabulary (E2B's by default)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    greedy = torch.compile(first_argmax, fullgraph=True, dynamic=False)
    sample = torch.compile(sample_tokens, fullgraph=True, dynamic=False)
    results = []
    for B in args.batch_sizes:
        generator = torch.Generator(device="cuda").manual_seed(B)
        logits_BV = torch.randn(B, args.vocab_size, device="cuda", generator=generator) * 3
        float_params_B3 = torch.tensor([[1.0, 0.9, 0.0]] * B, device="cuda")  # temperature, top_p, min_p
        int_params_B2 = torch.tensor([[50, i] for i in range(B)], device="cuda")  # top_k, seed
        position_B = torch.full((B,), 100, device="cuda")
        row = {"batch": B, "greedy_ms": time_ms(greedy, logits_BV)}
        for name, is_filtered in (("sample_ms", False), ("top_k_top_p_ms", True)):
            row[name] = time_ms(sample, logits_BV, float_params_B3, int_params_B2, position_B, is_filtered)
        print(json.dumps(row), flush=True)
        results.append(row)
    if args.out:
        Path(args.out).write_text(json.dumps({"setup": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
