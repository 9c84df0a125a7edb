"""Run by tests/test_distributed.py under torchrun: `generate_sharded` on a gloo process group that
this script initialises itself, as a trainer's ranks would, before the engine is built.

    python -m torch.distributed.run --nproc_per_node 2 -m tests.distributed_generate SPEC_JSON   # from the repo root

SPEC_JSON holds `model_dir`, `engine` (FlexInference keyword arguments), `cases` (case name -> list
of prompts as token ids), `sampling` (case name -> SamplingParams keyword arguments, for the cases
that sample; the others are greedy) and `out_dir`. Each rank writes out_dir/rank{rank}.json, case
name -> {"gathered": [output_ids, finish_reason] of every sequence it holds after generate_sharded,
in input order; "single_process": the same from plain `engine.generate` of all the prompts, its
seeds drawn from the engine's seeds where generate_sharded's were, as one process would} or
{"error": the message of the ValueError that generate_sharded raised}.
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from qwen3_flex_inference import FlexInference, SamplingParams, Sequence, generate_sharded

# A rank left waiting in a collective fails after this instead of hanging the test.
COLLECTIVE_TIMEOUT = timedelta(seconds=60)


def main(spec_path: str) -> None:
    from transformers import AutoModelForCausalLM

    spec = json.loads(Path(spec_path).read_text())
    dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    # An explicit group, as a trainer may pass one; here it spans every rank.
    group = dist.new_group(list(range(dist.get_world_size())), timeout=COLLECTIVE_TIMEOUT)
    model = AutoModelForCausalLM.from_pretrained(
        spec["model_dir"], dtype=torch.float32, attn_implementation="eager"
    ).eval()
    engine = FlexInference(model, None, **spec["engine"])
    results = {}
    for case, prompts in spec["cases"].items():
        sampling = SamplingParams(**spec["sampling"][case]) if case in spec["sampling"] else None
        sequences = [Sequence(input_ids=ids, sampling=sampling) for ids in prompts]
        engine_seeds = engine.seeds.getstate()  # the one-process reference below starts from here too
        try:
            returned = generate_sharded(engine, sequences, group=group)
        except ValueError as error:
            results[case] = {"error": str(error)}
            continue
        assert len(returned) == len(sequences) and all(a is b for a, b in zip(returned, sequences)), (
            "generate_sharded did not return the sequences it was given, in order"
        )
        # The reference: every prompt generated here alone, with no process group involved.
        engine.seeds.setstate(engine_seeds)
        single_process = engine.generate([Sequence(input_ids=ids, sampling=sampling) for ids in prompts])
        results[case] = {
            "gathered": [[seq.output_ids, seq.finish_reason] for seq in sequences],
            "single_process": [[seq.output_ids, seq.finish_reason] for seq in single_process],
        }
    Path(spec["out_dir"], f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
