"""Learning parity: TRL's GRPOTrainer with the engine's rollouts against TRL's own generation, on a
trained checkpoint, several seeds each; reward curves and the wall time to reach a reward level.

Each run is one `python -m scripts.grpo_trl` process (its own start-up: loading, and for the engine
compiling and capturing; `wall_s` counts from the start of its run) that writes TRL's metrics of
every step; a run whose file is in `--out_dir` already is skipped, so a later call resumes an earlier
one. The runs go one after another, so none shares the GPU with another.

    python -m scripts.benchmarks.bench_learning --out_dir learning --seeds 0 1 2 \\
        --runs engine hf engine_corrected -- --model_name checkpoints/trained_gpu/gemma4 --device cuda \\
        --num_prompts 8 --num_generations 8 --max_completion_length 128 --steps 30 \\
        --capture_cudagraph --compile_decode --fuse_projections --engine_weights copy
    python -m scripts.benchmarks.bench_learning --out_dir learning --summarize --plot learning.png

Runs: `engine` (the engine's rollouts), `hf` (TRL's own generation; the engine-only flags and their values are dropped),
`engine_corrected` (the engine's rollouts with TRL's importance-sampling correction on its
log-probs, `--sampler_correction`). `--bundle FILE` rewrites FILE after every run with all run files
of `--out_dir` (one file to bring back from a device call cut short); `--summarize` reads the run
files of `--out_dir`, after unpacking the bundles given to `--from_bundles` into it; `--plot` draws
the curves with matplotlib (not a project dependency: `pip install matplotlib`).
"""

import argparse
import importlib.util
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __name__ == "__main__" and importlib.util.find_spec("qwen3_flex_inference") is None:
    # NOTE: run by path, the repository root (the engine modules, scripts.*) is not on sys.path
    sys.exit(
        f"run it from the repository root ({Path(__file__).resolve().parents[2]}) as: "
        + shlex.join(["python", "-m", "scripts.benchmarks.bench_learning", *sys.argv[1:]])
    )

from scripts.grpo_trl import without_engine_flags

RUNS = {"engine": ["--backend", "engine"], "hf": ["--backend", "hf"], "engine_corrected": ["--sampler_correction"]}
LABELS = {
    "engine": "engine rollouts",
    "hf": "TRL's own generation",
    "engine_corrected": "engine rollouts + IS correction",
}


def run_file(out_dir: Path, run: str, seed: int) -> Path:
    return out_dir / f"{run}_seed{seed}.json"


def grpo_command(run: str, seed: int, grpo_args: list[str], out: Path) -> list[str]:
    args = without_engine_flags(grpo_args) if run == "hf" else list(grpo_args)
    return [sys.executable, "-m", "scripts.grpo_trl", *args, *RUNS[run], "--seed", str(seed), "--out", str(out)]


def step_records(report: dict) -> list[dict]:
    """A run's per-step logs (TRL's metrics, wall_s), in step order."""
    return [log for log in report["logs"] if log["label"].startswith("step ")]


def moving_average(values: list[float], window: int) -> list[float]:
    return [statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def summarize(out_dir: Path, reward_level: float | None, window: int) -> dict:
    """Per run kind: the mean reward per step over seeds (and its spread), steady step time, and the
    step and wall time at which each seed's moving-average reward first reaches `reward_level`
    (default: 80% of the way from the first steps' mean reward to the lowest final one)."""
    runs: dict[str, dict[int, list[dict]]] = {}
    for path in sorted(out_dir.glob("*_seed*.json")):
        kind, seed = path.stem.rsplit("_seed", 1)
        runs.setdefault(kind, {})[int(seed)] = step_records(json.loads(path.read_text()))
    if not runs:
        raise SystemExit(f"no run files in {out_dir}")
    first = [steps[0]["reward"] for seeds in runs.values() for steps in seeds.values()]
    finals = {
        kind: statistics.fmean(statistics.fmean(s["reward"] for s in steps[-window:]) for steps in seeds.values())
        for kind, seeds in runs.items()
    }
    start_reward = statistics.fmean(first)
    if reward_level is None:
        reward_level = start_reward + 0.8 * (min(finals.values()) - start_reward)
    summary = dict(reward_level=reward_level, start_reward=start_reward, window=window, kinds={})
    for kind, seeds in runs.items():
        num_steps = min(len(steps) for steps in seeds.values())
        curves = [[s["reward"] for s in steps[:num_steps]] for steps in seeds.values()]
        reached = []
        for steps in seeds.values():
            averaged = moving_average([s["reward"] for s in steps], window)
            hit = next((i for i, value in enumerate(averaged) if value >= reward_level), None)
            reached.append(None if hit is None else dict(step=hit + 1, wall_s=steps[hit]["wall_s"]))
        walls = [r["wall_s"] for r in reached if r is not None]
        summary["kinds"][kind] = dict(
            seeds=sorted(seeds),
            mean_reward=[statistics.fmean(values) for values in zip(*curves)],
            min_reward=[min(values) for values in zip(*curves)],
            max_reward=[max(values) for values in zip(*curves)],
            per_seed={
                seed: dict(reward=[s["reward"] for s in steps], wall_s=[s["wall_s"] for s in steps])
                for seed, steps in seeds.items()
            },
            final_reward=finals[kind],
            steady_step_s=statistics.median(s["step_time"] for steps in seeds.values() for s in steps[1:]),
            first_step_wall_s=statistics.fmean(steps[0]["wall_s"] for steps in seeds.values()),
            reached=reached,
            median_wall_s_to_level=statistics.median(walls) if len(walls) == len(reached) else None,
        )
    return summary


def print_table(summary: dict) -> None:
    print(
        f"reward level {summary['reward_level']:.3f} (moving average over {summary['window']} steps; "
        f"first steps' mean reward {summary['start_reward']:.3f})"
    )
    print("| run | seeds | final reward | steady step (s) | first step done (s) | steps to level | wall s to level |")
    print("|---|---|---|---|---|---|---|")
    for kind, k in summary["kinds"].items():
        steps = ", ".join("-" if r is None else str(r["step"]) for r in k["reached"])
        walls = ", ".join("-" if r is None else f"{r['wall_s']:.0f}" for r in k["reached"])
        print(
            f"| {LABELS.get(kind, kind)} | {len(k['seeds'])} | {k['final_reward']:.3f} | {k['steady_step_s']:.2f} | "
            f"{k['first_step_wall_s']:.0f} | {steps} | {walls} |"
        )


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for kind in sorted(summary["kinds"], key=list(LABELS).index):
        k = summary["kinds"][kind]
        steps = list(range(1, len(k["mean_reward"]) + 1))
        label = f"{LABELS.get(kind, kind)} ({len(k['seeds'])} seed{'s' * (len(k['seeds']) > 1)})"
        line = by_step.plot(steps, k["mean_reward"], label=label)[0]
        by_step.fill_between(steps, k["min_reward"], k["max_reward"], color=line.get_color(), alpha=0.2)
        for run in k["per_seed"].values():  # each seed its own start-up: a mean over seeds would blur it
            by_time.plot(run["wall_s"], run["reward"], color=line.get_color(), linewidth=1)
    for axes, xlabel in ((by_step, "GRPO step"), (by_time, "wall time since start (s), start-up included")):
        axes.axhline(summary["reward_level"], color="gray", linestyle=":", linewidth=1)
        axes.set_xlabel(xlabel)
        axes.set_ylabel("mean reward (completions that parse)")
        axes.grid(alpha=0.3)
    by_step.legend(loc="lower right", fontsize=8)
    by_step.set_title("reward per step (mean over seeds, band: min-max)")
    by_time.set_title("reward against wall time (one line per seed)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    grpo_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    own_args = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--out_dir", type=Path, required=True, help="one JSON file per run, and summary.json")
    parser.add_argument("--runs", nargs="+", choices=sorted(RUNS), default=["engine", "hf"], help="run kinds")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="TRL's seeds, one run each")
    parser.add_argument("--summarize", action="store_true", help="only summarize the run files in --out_dir")
    parser.add_argument("--bundle", type=Path, default=None, help="rewritten after each run: all run files")
    parser.add_argument("--from_bundles", type=Path, nargs="*", default=[], help="bundles to unpack into --out_dir")
    parser.add_argument("--reward_level", type=float, default=None, help="the level for the time to reach it")
    parser.add_argument("--window", type=int, default=3, help="steps in the reward's moving average")
    parser.add_argument("--plot", type=Path, default=None, help="a PNG of the reward curves (needs matplotlib)")
    args = parser.parse_args(own_args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for bundle in args.from_bundles:
        for name, report in json.loads(bundle.read_text()).items():
            (args.out_dir / name).write_text(json.dumps(report, indent=1))
    if not args.summarize:
        for seed in args.seeds:  # seeds outermost: a cut-off call still has every kind's first seeds
            for run in args.runs:
                out = run_file(args.out_dir, run, seed)
                if out.exists():  # a later call resumes where an earlier one was cut off
                    continue
                start = time.perf_counter()
                print(f"== {run} seed {seed}", flush=True)
                status = subprocess.run(grpo_command(run, seed, grpo_args, out)).returncode
                print(f"== {run} seed {seed}: exit {status} after {time.perf_counter() - start:.0f} s", flush=True)
                if args.bundle:
                    runs = {
                        path.name: json.loads(path.read_text()) for path in sorted(args.out_dir.glob("*_seed*.json"))
                    }
                    args.bundle.write_text(json.dumps(runs))
    summary = summarize(args.out_dir, args.reward_level, args.window)
    (args.out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print_table(summary)
    if args.plot:
        plot(summary, args.plot)


if __name__ == "__main__":
    main()
