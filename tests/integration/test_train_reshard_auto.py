"""--reshard-policy auto in the training job: a GPT-MoE of 6 blocks at ep 2 under HSDP 2 x 2 with DiLoCo outer
steps, 4 gloo ranks. The budget is the cost model's need with one block kept (`sf.plan` on the job's units,
`parallelize.unit_sizes_per_rank`): the run keeps that block (the last one), prints the choice and writes it to
config.json, and trains bitwise as the same run under after_forward (the policy moves no value): every step's loss
and gradient norm, the validation loss, the final checkpoint. The policy's choice itself (extremes, budget, every
rank alike) is tested in tests/unit/test_reshard_auto.py and tests/distributed/test_reshard_auto_ranks.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness import TRAIN_TIMEOUT_S, run_trains
from shardfusion.checkpoint import read_all

FLAGS = ["--preset", "tiny", "--n-layer", "6", "--experts", "4", "--top-k", "2", "--ep", "2",
         "--fsdp-outer-degree", "2", "--nproc", "4", "--batch-size", "2", "--data-bytes", "300000",
         "--sample-tokens", "0", "--no-progress", "--steps", "4", "--eval-every", "4", "--eval-batches", "2",
         "--save-every", "4", "--outer-sync", "diloco", "--outer-every", "2"]


def planned_needs(flags: list[str], world: int) -> tuple:
    """The cost model's memory need per rank (bytes) of the job ``flags`` at ``world`` ranks with the first k blocks
    of the policy's order kept, k = 0 .. blocks (`ReshardChoice.needs` of the planned candidate)."""
    import shardfusion as sf
    from shardfusion.train import dtype_flags, parallelize
    from shardfusion.train.config import JobConfig, build_parser, resolve

    argv = [f for f in flags if f != "--no-progress"] + ["--reshard-policy", "auto", "--max-memory-per-rank", "1"]
    config = JobConfig.from_flat(**vars(build_parser().parse_args(argv)))
    job = resolve(config, device="cpu", world_size=world, world=f"--nproc {world}")
    mp = dtype_flags.mixed_precision(job.precision)
    plan = sf.plan(parallelize.unit_sizes_per_rank(job, torch.device("cpu")), world_size=world,
                   local_world_size=world, bandwidth=sf.Bandwidth(within=1e9, across=1e9), max_memory_per_rank=2**62,
                   ep=job.ep, prefetch=job.parallelism.prefetch, param_dtype=mp.param_dtype, grad_comm_dtype=mp.grad_comm_dtype,
                   reshard_policy="auto", outer_degrees=[job.fsdp_outer_degree])
    return plan.chosen.reshard.needs


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(3 * TRAIN_TIMEOUT_S)
def test_in_between_choice_equals_after_forward_bitwise(tmp_path: Path) -> None:
    needs = planned_needs(FLAGS, 4)
    assert needs[0] < needs[1] < needs[-1], needs  # one block kept is in between: neither extreme
    auto, plain = tmp_path / "auto", tmp_path / "after_forward"
    result, reference = run_trains([*FLAGS, "--reshard-policy", "auto", "--max-memory-per-rank", str(needs[1]),
                                    "--async-save", "--out", str(auto)],  # its checkpoints written in the background
                                   [*FLAGS, "--out", str(plain)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "reshard policy auto: 1 of 6 units kept gathered from forward to backward (blocks.5)" in result.stdout, \
        result.stdout[-3000:]
    choice = json.loads((auto / "config.json").read_text())["reshard_choice"]
    assert choice["kept"] == ["blocks.5"] and choice["fits"] and choice["memory_bytes"] <= choice["budget"]
    assert tuple(choice["needs"]) == needs  # the wrap's estimate is the cost model's, on the real layout
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert "reshard policy auto" not in reference.stdout
    ours, theirs = _records(auto), _records(plain)
    keys = ("step", "loss", "grad_norm", "outer_synced", "val_loss")
    assert [{k: r.get(k) for k in keys} for r in ours] == [{k: r.get(k) for k in keys} for r in theirs]
    assert any(r.get("outer_synced") for r in ours)
    a, b = read_all(str(auto / "checkpoints" / "step-4")), read_all(str(plain / "checkpoints" / "step-4"))
    assert a.keys() == b.keys() and any(k.startswith("model/") for k in a)
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
