"""The training job's pipeline section in one process (shardfusion/train/pipeline_config.py): its flags generated
with the others from `JobConfig`, the run-time defaults (stages per rank, micro-batches; the data-parallel world,
ep and outer degree per stage), and the bubble in theory. Whole runs and every usage error are in
tests/integration/test_train_pp.py."""

from __future__ import annotations

import pytest

from shardfusion.train.config import JobConfig, build_parser, data_parallel_size, parse_args, resolve
from shardfusion.train.pipeline_config import bubble_fraction, default_microbatches, num_stages


def test_pipeline_flags_are_generated_from_their_section() -> None:
    help_text = " ".join(build_parser().format_help().split())
    for flag in ("--pp INT", "--pp-schedule STR", "--stages-per-rank INT", "--microbatches INT",
                 "--no-tie-embeddings"):
        assert flag in help_text
    assert "Pipeline-parallel degree: the GPT's blocks are cut into consecutive stages" in help_text  # its docstring
    # the section's flags come after JobConfig's own
    assert help_text.index("--pp INT Pipeline") > help_text.index("--progress, --no-progress")
    config = parse_args(["--pp", "2", "--no-tie-embeddings", "--pp-schedule", "gpipe", "--microbatches", "4"])
    pipe = config.pipeline
    assert (pipe.pp, pipe.pp_schedule, pipe.microbatches, config.model.tie_embeddings) == (2, "gpipe", 4, False)
    assert config.model_config().tie_embeddings is False and JobConfig().model_config().tie_embeddings is True
    assert parse_args([]) == JobConfig() and JobConfig().pipeline.pp == 1


def test_defaults_per_stage() -> None:
    def resolved(world: int, **fields) -> JobConfig:
        return resolve(JobConfig.from_flat(preset="tiny", tie_embeddings=False, **fields), device="cpu", world_size=world)

    moe = resolved(4, pp=2)  # the default GPT-MoE: each stage's 2 ranks are its sharding group, ep 2 inside it
    assert (moe.pipeline.stages_per_rank, moe.pipeline.microbatches) == (1, 2)
    assert (moe.parallelism.ep, moe.parallelism.fsdp_outer_degree) == (2, 1)
    assert (moe.schedule.batch_size, moe.schedule.global_batch_size) == (16, 32)  # a stage's data-parallel world: 2
    dense = resolved(8, pp=2, experts=0)  # 4 ranks per stage: HSDP 2 x 2 inside each
    assert (dense.parallelism.ep, dense.parallelism.fsdp_outer_degree, data_parallel_size(dense, 8)) == (1, 2, 4)
    assert resolved(4, pp=2, experts=0).parallelism.fsdp_outer_degree == 1  # 2 ranks per stage: plain FSDP
    interleaved = resolved(4, pp=2, n_layer=4, pp_schedule="interleaved", grad_accum=3)
    assert (interleaved.pipeline.stages_per_rank, interleaved.pipeline.microbatches) == (2, 6)
    plain = resolved(4)
    assert (plain.pipeline.stages_per_rank, plain.pipeline.microbatches) == (None, None)
    assert data_parallel_size(plain, 4) == 4


@pytest.mark.parametrize("pp, schedule, per_rank, accum, want", [
    (2, "1f1b", 1, 1, 2), (2, "1f1b", 1, 3, 3), (4, "gpipe", 1, 2, 4), (4, "1f1b", 1, 3, 6),
    (2, "interleaved", 2, 1, 4), (2, "interleaved", 2, 3, 6),
    (2, "interleaved", 2, 5, 10),  # 5: Interleaved1F1B's max(1, 5 // 2) = 2 rounds do not divide it
])
def test_default_microbatches(pp: int, schedule: str, per_rank: int, accum: int, want: int) -> None:
    config = JobConfig.from_flat(pp=pp, pp_schedule=schedule, stages_per_rank=per_rank, tie_embeddings=False)
    assert default_microbatches(config.pipeline, accum) == want >= num_stages(config.pipeline)
    assert want % accum == 0


def test_bubble_in_theory() -> None:
    assert bubble_fraction("gpipe", 2, 1, 2) == bubble_fraction("1f1b", 2, 1, 2) == 1 / 3
    assert bubble_fraction("1f1b", 4, 1, 12) == 3 / 15
    assert bubble_fraction("interleaved", 4, 2, 12) == 3 / 27  # v = 2 stages per rank: v m in the denominator
    assert bubble_fraction("1f1b", 1, 1, 8) == 0.0
