"""The main job (`make run`): the Gemma-4 engine on the real unsloth/gemma-4-E2B-it where a CUDA
GPU and the Hugging Face hub are both there, otherwise on the embedded trained Gemma-4 (the CI size
of scripts/train_checkpoints.py, multimodal layout, with its LoRA adapter) on the CPU, completing
held-out standard-library functions from their headers. Extra arguments go to gemma4_flex_inference.py.

    python -m scripts.run_main [ARGS]   # from the repository root
"""

import importlib.util
import shlex
import sys
from pathlib import Path

if __name__ == "__main__" and importlib.util.find_spec("qwen3_flex_inference") is None:
    # NOTE: run by path, the repository root (the engine modules, scripts.*) is not on sys.path
    sys.exit(
        f"run it from the repository root ({Path(__file__).resolve().parents[1]}) as: "
        + shlex.join(["python", "-m", "scripts.run_main", *sys.argv[1:]])
    )

REAL_MODEL = "unsloth/gemma-4-E2B-it"


def hub_is_reachable(model_name: str) -> bool:
    try:
        from huggingface_hub import model_info

        model_info(model_name, timeout=5)
        return True
    except Exception:  # offline, DNS failure, gated: all mean "use the trained tiny checkpoint"
        return False


def main() -> None:
    import torch

    import gemma4_flex_inference
    from scripts.train_checkpoints import ensure_trained_checkpoints

    if torch.cuda.is_available() and hub_is_reachable(REAL_MODEL):
        argv = ["--model_name", REAL_MODEL, "--capture_cudagraph", "--n_prompts", "64", "--max_batch_size", "64"]
    else:
        trained = ensure_trained_checkpoints()
        argv = [
            "--model_name",
            str(trained / "gemma4"),
            "--prompts_file",
            str(trained / "prompts.jsonl"),
            "--device",
            "cpu",
            "--n_prompts",
            "8",
            "--max_batch_size",
            "4",
            "--max_seq_length",
            "512",
            "--n_pages",
            "128",
            "--page_size",
            "16",
            "--max_new_tokens",
            "96",
            "--lora_adapter",
            str(trained / "gemma4" / "lora"),
            "--verify_no_drift",
        ]
        print(
            f"no GPU with the hub in reach: running the trained Gemma-4 checkpoint {trained / 'gemma4'} on the CPU",
            file=sys.stderr,
        )
    gemma4_flex_inference.main(argv + sys.argv[1:])


if __name__ == "__main__":
    main()
