"""The parallelism section of the training job's settings (`--ep`, `--expert-policy`, `--mp`, `--cp`,
`--fsdp-outer-degree`, `--max-memory-per-rank`, `--reshard-policy`, `--prefetch`, `--secondary-shard`) and its checks: this module owns
them; `shardfusion.train.config.JobConfig` composes the section and calls `check_flags` with the other sections'
checks. `shardfusion.train.parallelize` maps the resolved section to `sf.Topology` and `sf.fully_shard`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from shardfusion.plan import parse_bytes
from shardfusion.policies import EXPERT_POLICIES, RESHARD_POLICIES
from shardfusion.train import compat
from shardfusion.train.model_config import ModelConfig, is_hf
from shardfusion.train.sections import FT_SHARED_UNLESS_DEFAULT, meta

AUTO = "auto"
"""The --fsdp-outer-degree value that asks the cost model (`shardfusion.plan`) for the degree."""


def outer_degree_arg(text: str) -> int | str:
    """argparse type of --fsdp-outer-degree: an int, or `auto`.

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1 or {AUTO}, got {text!r}") from None


def memory_arg(text: str) -> int:
    """argparse type of --max-memory-per-rank: bytes, from a size such as 8GB, 512MiB or 4096
    (`shardfusion.plan.parse_bytes`).

    Raises:
        argparse.ArgumentTypeError: not such a size.
    """
    try:
        return parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


@dataclass(frozen=True, kw_only=True)
class ParallelismConfig:
    """How the ranks split the model and the batch (a section of `JobConfig`; --pp is the pipeline section's)."""

    ep: int | None = field(default=None, metadata=meta(ft_shared=True))
    """Expert-parallel degree: each layer's experts are split over this many ranks of every sharding group; it must
    divide --experts and the sharding degree (default: 2 when --experts and the world size are even, else 1)."""
    expert_policy: str = field(default="replicate", metadata=meta(resume=True, ft_shared=True))
    """How expert buffers use the HSDP outer group: replicate (sharded over moe_sharding / outer ranks, all-reduced
    over the outer group, like dense buffers) or shard (sharded over all moe_sharding ranks, no outer all-reduce)
    (default replicate)."""
    mp: int = field(default=1, metadata=meta(ft_shared=FT_SHARED_UNLESS_DEFAULT))
    """Tensor-parallel degree: each block's attention heads and (dense) MLP are split over this many ranks with torch's
    tensor parallel (shardfusion.models.gpt_parallel); they see the same samples, so the data-parallel world is the
    world size / mp. Must divide the world size and n_head (GPT only; default 1)."""
    cp: int = 1
    """Context-parallel degree: each sequence is split over this many ranks (contiguous chunks; exact attention by an
    all-gather of keys and values, shardfusion.context_parallel); they see the same samples, so the data-parallel
    world is the world size / (mp x cp). Must divide the world size and --seq-len; needs --dropout 0 (GPT only;
    default 1)."""
    fsdp_outer_degree: int | str | None = field(
        default=None, metadata=meta(parse=outer_degree_arg, metavar="INT|auto"))
    """HSDP replicas of each shard: 1 = plain FSDP; auto: chosen at start-up by the cost model (sf.plan) from a
    short bandwidth probe within and across nodes, the units' sizes and --max-memory-per-rank; the table is
    printed and the chosen int is written to config.json (default: on several nodes, inner = one node, i.e. world
    size / (pp x ranks per node) when that fits, and the run prints why; on one node 2 when the world size / pp is
    >= 4 and 2 divides world size / ep, else 1)."""
    max_memory_per_rank: int | None = field(default=None, metadata=meta(parse=memory_arg, metavar="BYTES"))
    """Memory budget of one rank, bytes with an optional suffix (80GB = 80e9, 74.5GiB, 512MiB, 4096; B, kB, MB, GB,
    TB, KiB, MiB, GiB, TiB): for --fsdp-outer-degree auto and --reshard-policy auto, without activations; with
    --dry-run each kind of rank's peak, activations included, is judged against it (fits, or does not fit by how
    much) (default: the GPU's memory; on CPU the host's memory / ranks per node; a dry run: no verdict;
    --reshard-policy auto needs it given)."""
    reshard_policy: str | None = None
    """When gathered parameters are freed: after_forward (ZeRO-3), after_backward, or auto: the blocks that fit
    --max-memory-per-rank stay gathered from forward to backward (the last ones first), the rest are freed after
    forward; the choice is printed and written to config.json (docs/design.md, "Reshard policy by budget") (default
    after_forward; with --pp > 1 after_backward: measured faster between micro-batches at the same peak,
    docs/pipeline-benchmark.md)."""
    prefetch: int = 1
    """Units all-gathered ahead of the running one, in forward and backward; 0 turns prefetching off (default 1)."""
    secondary_shard: bool = False
    """ZeRO++'s hpZ: where a sharding group spans nodes (nodes of --ranks-per-node ranks, default LOCAL_WORLD_SIZE),
    each block freed after forward keeps a copy of its gathered parameters (in --all-gather-dtype's format) sharded
    over its group's ranks on the node, so the backward's all-gather stays within the node; bitwise the same
    results, more memory (the copy), fewer bytes across nodes. Changes nothing when the groups sit within a node or
    the blocks stay gathered (--reshard-policy after_backward); see docs/secondary-shard.md (default off)."""


def check_flags(parallelism: ParallelismConfig, model: ModelConfig) -> None:
    """The section's flags on their own and against the model section (experts to split; a Hugging Face model's
    own modules take no ep, mp or cp).

    Raises:
        ValueError: one line naming the flag to change and the numbers.
    """
    p = parallelism
    if is_hf(model):
        mode, what = ("hf", f"--hf-model {model.hf_model}") if model.init_from is None else (
            "init_from", f"--init-from {model.init_from}")
        compat.refuse_first(mode, what, [  # the pairs of modes: shardfusion.train.compat's reasons
            ("ep", "--ep", p.ep, p.ep is not None and p.ep != 1), ("mp", "--mp", p.mp, p.mp != 1),
            ("cp", "--cp", p.cp, p.cp != 1)])
    if p.ep is not None:
        if p.ep < 1:
            raise ValueError(f"--ep must be >= 1, got {p.ep}")
        if p.ep > 1 and not model.experts:
            raise ValueError(f"--ep {p.ep} needs experts to split; use --experts > 0 or --ep 1")
        if model.experts % p.ep:
            raise ValueError(f"--ep {p.ep} must divide --experts {model.experts} (each ep rank holds "
                             f"experts / ep of them); {model.experts} % {p.ep} = {model.experts % p.ep}")
    if p.expert_policy not in EXPERT_POLICIES:
        raise ValueError(f"--expert-policy must be {' or '.join(EXPERT_POLICIES)}, got {p.expert_policy!r}")
    if p.prefetch < 0:
        raise ValueError(f"--prefetch must be >= 0, got {p.prefetch}")
    outer = p.fsdp_outer_degree
    if outer is not None and outer != AUTO and (isinstance(outer, bool) or not isinstance(outer, int)):
        raise ValueError(f"--fsdp-outer-degree must be an int >= 1 or {AUTO}, got {outer!r}")
    budget = p.max_memory_per_rank
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise ValueError(f"--max-memory-per-rank must be a size in bytes > 0 (e.g. 8GB, 512MiB), got {budget!r}")
    if p.reshard_policy is not None and p.reshard_policy not in RESHARD_POLICIES:
        raise ValueError(f"--reshard-policy must be {', '.join(RESHARD_POLICIES)}, got {p.reshard_policy!r}")
    if p.reshard_policy == "auto" and budget is None:
        raise ValueError("--reshard-policy auto needs --max-memory-per-rank (bytes per rank, e.g. 40GB: the blocks "
                         "kept gathered from forward to backward must fit it)")


def data_parallel_size(pp: int, mp: int, cp: int, world_size: int) -> int:
    """The data-parallel world size of the job at world_size ranks: the ranks that take distinct slices of the
    global batch, `topo.dp * topo.sharding` = world_size / (pp x mp x cp) (ep ranks take distinct slices too; the
    mp and cp ranks of one data-parallel rank share its slice: cp ranks take parts of its sequences; every pipeline
    stage has its own data-parallel ranks, which take the same slices). world_size itself when pp x mp x cp does
    not divide it (`shardfusion.train.config.check_run` reports that)."""
    split = max(1, pp) * max(1, mp) * max(1, cp)
    return world_size // split if world_size % split == 0 else world_size
