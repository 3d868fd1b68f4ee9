"""The job's --dry-run section (shardfusion.train.dry_run_config): its checks and refusals, in one process. The
dry runs themselves: tests/integration/test_train_dry_run.py."""

from __future__ import annotations

import pytest

from shardfusion.train import dry_run_config as dc
from shardfusion.train.config import JobConfig
from shardfusion.train.job_dry_run import prepare

ON = dict(dry_run=True)


@pytest.mark.parametrize("fields, words", [
    ({"world": 64}, "--world needs --dry-run"),
    ({"latency_across": 1.0}, "--latency-across needs --dry-run"),
    ({**ON, "world": 0}, "--world 0 must be >= 1"),
    ({**ON, "bandwidth_across": "fast"}, "--bandwidth-across: "),
    ({**ON, "bandwidth_within": "0"}, "--bandwidth-within: expected a size in bytes > 0"),
    ({**ON, "latency_within": -1.0}, "--latency-within must be >= 0 microseconds, got -1.0"),
    ({**ON, "mp": 2}, "--mp 2 with --dry-run: a dry run plays the GPT under FSDP/HSDP with AdamW, ep, cp and pp"),
    ({**ON, "optimizer": "muon"}, "--optimizer muon with --dry-run"),
    ({**ON, "fsdp_outer_degree": "auto"}, "--fsdp-outer-degree auto with --dry-run"),
    ({**ON, "hf_model": "llama"}, "--hf-model llama with --dry-run"),
])
def test_check_flags_refusals(fields: dict, words: str) -> None:
    with pytest.raises(ValueError) as error:
        (JobConfig.from_flat(**fields)).check_section("dry")
    assert str(error.value).startswith(words), str(error.value)


def test_defaults_and_units() -> None:
    (JobConfig()).check_section("dry")
    (JobConfig.from_flat(**ON, world=1024, bandwidth_within="900MB", bandwidth_across="12.5GB")).check_section("dry")
    given = JobConfig.from_flat(bandwidth_within="900MB", bandwidth_across="1GiB")
    assert dc.bandwidths(given.dry) == (900e6, float(2**30))
    assert not dc.enabled(JobConfig().dry) and dc.enabled(JobConfig.from_flat(**ON).dry)


@pytest.mark.parametrize("fields, words", [
    ({"world": 64, "ranks_per_node": 6}, "--ranks-per-node 6 must divide --world 64"),
    ({"world": 64, "fsdp_outer_degree": 3}, "--fsdp-outer-degree 3 does not fit 64 ranks (--world 64)"),
    ({"world": 64, "cp": 3}, "--cp 3 must be >= 1 and divide the 64 ranks (--world 64)"),
    ({"world": 64, "pp": 2, "experts": 0, "preset": "tiny", "microbatches": 3}, "--microbatches 3 must divide"),
])
def test_layouts_checked_against_the_world(fields: dict, words: str) -> None:
    """The job's own rules (check_run) against --world, before anything is built."""
    with pytest.raises(ValueError) as error:
        prepare(JobConfig.from_flat(**ON, **fields))
    assert str(error.value).startswith(words), str(error.value)


def test_a_layout_that_fits() -> None:
    config, world, ranks_per_node = prepare(JobConfig.from_flat(**ON, world=1024, fsdp_outer_degree=128, experts=0))
    assert (world, ranks_per_node, config.fsdp_outer_degree) == (1024, 8, 128)
    assert config.global_batch_size == config.batch_size * 1024
