"""Pipeline parallelism over the topology's ``pp`` axis: torch's ``torch.distributed.pipelining`` stages and
schedules, each stage's parameters sharded by :func:`shardfusion.fully_shard` over the sharding group of its stage.

[Note: pipeline stages over sharded models]
A model is cut into ``num_stages`` stage modules (``num_stages`` a multiple of ``topo.pp``; stage ``s`` on the pp
rank ``s % pp``, torch's looped placement, so an interleaved schedule puts ``num_stages / pp`` stages on each pp
rank). Each stage module is passed to ``fully_shard`` with the job's one ``Topology``: the groups it uses (inner,
outer, ep, mp) are those of this rank, so they belong to its pp index; nothing is shared between stages. torch's
schedules (GPipe, 1F1B, Interleaved1F1B, LoopedBFS, ...) then drive :class:`PipelineStage`, a
``torch.distributed.pipelining.PipelineStage`` that tells the sharded stage which backward is the step's last, as
torch's own stage does for FSDP2 through its special cases:

- a backward the schedule does not mark as last runs with gradient sync off: it accumulates into the full-size
  gradient buffers, no reduce-scatter, no all-reduce (``reduce_per_microbatch=False``, the default); or, with
  ``reduce_per_microbatch=True``, reduce-scatters into the sharded gradient (one reduce-scatter per unit per
  micro-batch, no full gradient buffer kept between micro-batches), the all-reduce still waiting for the last;
- the last backward (``last_backward`` of the schedule: the stage's last micro-batch) reduce-scatters each unit once
  and hands off its outer all-reduce overlapped with the rest of that backward; the gradients are final when it
  returns (``set_is_last_backward``);
- the schedule's gradient scaling (``scale_grads=True``: divided by the number of micro-batches, so the loss is the
  mean over the step's micro-batches) then acts on the fragments' final ``.grad``.

So per optimizer step each unit issues one reduce-scatter and one outer all-reduce, whatever the schedule and the
number of micro-batches (``tests/distributed/test_pipeline.py`` counts them), and every forward all-gathers as
``reshard_policy`` says.

The stage needs its input and output shapes at construction (torch's static mode: ``input_args`` and
``output_args``, e.g. meta tensors of one micro-batch's shapes). torch's dynamic mode infers them by running a real
forward and backward of the first micro-batch, which on a sharded model would issue its collectives and accumulate
gradients outside the step; it is refused. Zero-bubble schedules split backward into an input and a weight part
(``torch.autograd.grad`` on the stage's inputs, then on its parameters); the sharded stage's backward hooks reduce
whole backwards, so those schedules are refused at their first backward.

[Note: weights tied across stages]
A weight shared by the first and the last stage (a GPT's embedding and head) is held twice, one copy per end
(`split_gpt` names them in ``tied_parameters``), each kept whole on its stage so that both ends hold the same
elements. The stage copies the first end's values into the last's at construction (a broadcast over
``Topology.get_pipeline_ends_group()``), sums the two gradients after the step's last backward (an asynchronous
all-reduce over the same group, waited for at the step boundary: an interleaved schedule still runs this rank's other
stages, which the other end waits for), and leaves the last end's copy out of the global norm (``clip.count_once``).
Identical gradients and optimizer settings then keep the copies identical. docs/pipeline.md has the costs.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage

from shardfusion import comm
from shardfusion._runtime.state import is_sharded, named_fragments, sharded_state
from shardfusion.clip import count_once

__all__ = ["SCHEDULES", "PipelineStage", "build_schedule", "stage_ranks"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "looped_bfs")
"""The schedules :func:`build_schedule` makes (torch's ``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``,
``ScheduleLoopedBFS``); the first two run one stage per pp rank, the others any number."""

_ZERO_BUBBLE = ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")


def stage_ranks(num_stages: int, pp: int) -> dict[int, list[int]]:
    """``{pp rank: [stage indices]}`` of torch's looped placement: stage ``s`` on pp rank ``s % pp``.

    Raises:
        ValueError: ``num_stages`` is not a positive multiple of ``pp``.
    """
    if not isinstance(num_stages, int) or num_stages < 1 or num_stages % pp:
        raise ValueError(f"num_stages must be a positive multiple of the pp degree {pp}, got {num_stages!r}")
    return {r: list(range(r, num_stages, pp)) for r in range(pp)}


class PipelineStage(_TorchPipelineStage):
    """One pipeline stage of a model whose stages are sharded with :func:`shardfusion.fully_shard` (see
    [Note: pipeline stages over sharded models]). Pass it to any of torch's schedules as torch's own stage.

    Args:
        submodule: this stage's module, passed to ``fully_shard`` (or a plain module: nothing sharded, no hooks).
        topo: the job's :class:`shardfusion.Topology`; P2P runs over its ``pp`` group.
        stage_index: this stage's index in ``[0, num_stages)``; it must be on this rank's pp index
            (``stage_index % topo.pp == topo.pp_rank``).
        num_stages: stages of the pipeline, a multiple of ``topo.pp`` (``num_stages / pp`` per pp rank).
        input_args: example inputs of one micro-batch (tensors or meta tensors of its shapes and dtypes; the first
            stage's are the pipeline's inputs, e.g. ``(B, T)`` int64 token ids). Activations that carry a gradient
            back to the previous stage must have ``requires_grad=True`` here (torch reads it from these examples).
        output_args: example outputs of one micro-batch (e.g. ``(B, T, C)`` activations with ``requires_grad=True``;
            logits on the last stage).
        device: the device of the stage's tensors (default: CUDA's current device if CUDA is available, else CPU).
        reduce_per_microbatch: reduce-scatter the gradients after every micro-batch's backward instead of
            accumulating full-size gradients until the last (less memory, ``M`` reduce-scatters per unit per step).
        keep_gathered: keep the units gathered from the step's first forward to its last backward, one all-gather
            per unit per step (FSDP2 under torch's stage does the same); default: when the stage was sharded with
            ``reshard_policy="after_backward"`` (under ``"after_forward"`` each micro-batch gathers again, the least
            memory).
        tied_parameters: names of this stage's parameters tied to a parameter of the other end of the pipeline (an
            embedding on the first stage and the head on the last share one weight: each end holds a copy under its
            own name, in the same order on both ends); default: ``submodule.tied_parameters`` if it has one
            (`split_gpt` sets it), else none. See [Note: weights tied across stages].

    Raises:
        ValueError: ``stage_index`` / ``num_stages`` do not fit ``topo.pp`` (the numbers named), or ``input_args`` /
            ``output_args`` are missing (on every rank: each builds its stages from the same numbers); tied
            parameters on a stage that is not an end of the pipeline, on pp 1, not in the stage, sharded (keep them
            whole), or on a stage not passed to ``fully_shard`` (on both ends). At a backward: a split (zero-bubble)
            backward on a sharded stage.
    """

    def __init__(self, submodule: nn.Module, topo, stage_index: int, num_stages: int, *,
                 input_args: Any, output_args: Any, device: Optional[torch.device] = None,
                 reduce_per_microbatch: bool = False, tied_parameters: Optional[Sequence[str]] = None,
                 keep_gathered: Optional[bool] = None) -> None:
        placement = stage_ranks(num_stages, topo.pp)
        if not isinstance(stage_index, int) or not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index must be in [0, num_stages={num_stages}), got {stage_index!r}")
        if stage_index not in placement[topo.pp_rank]:
            raise ValueError(f"stage {stage_index} of {num_stages} belongs on pp rank {stage_index % topo.pp}, but this "
                             f"rank's pp index is {topo.pp_rank} (pp {topo.pp}); build stages "
                             f"{placement[topo.pp_rank]} here")
        if input_args is None or output_args is None:
            raise ValueError("PipelineStage needs input_args and output_args (one micro-batch's shapes, meta tensors "
                             "will do): torch's shape inference would run a real forward and backward of the sharded "
                             "stage outside the step")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
                torch.device("cpu")
        super().__init__(submodule, stage_index, num_stages, device, input_args=input_args, output_args=output_args,
                         group=topo.get_group("pp"))
        self.reduce_per_microbatch = bool(reduce_per_microbatch)
        self._sharded = is_sharded(submodule)
        names = getattr(submodule, "tied_parameters", ()) if tied_parameters is None else tied_parameters
        self._tied_names = list(names)
        if names and not self._sharded:
            raise ValueError(f"tied_parameters {self._tied_names}: stage {stage_index} must be sharded with "
                             "shardfusion.fully_shard (its step boundary waits for the tied all-reduce)")
        self._tied = _tie(submodule, topo, stage_index, num_stages, self._tied_names) if names else None
        self._tie_due = False
        self._state = sharded_state(submodule) if self._sharded else None
        if keep_gathered is None:
            keep_gathered = self._sharded and not any(u.reshard_after_forward for u in self._state.units)
        self.keep_gathered = bool(keep_gathered) and self._sharded

    # torch's schedules open with a vote over the pipeline (a product of 0/1 sent stage to stage, read back with
    # .item()) on whether every stage's shapes are static. A dry run (shardfusion.dry_run: fake group, fake tensors)
    # sends the same votes, but has no value to read: its stages are built from input_args / output_args, so the
    # result is "static" (memoized on the fake tensor, where .item() reads it).
    def _warmup_backward_result(self, received_result=None):
        result = super()._warmup_backward_result(received_result=received_result)
        if comm.is_fake(self.group):
            _memoize_one(result)
        return result

    def forward_one_chunk(self, *args, **kwargs):
        if self.keep_gathered and torch.is_grad_enabled():  # a training step: gathered until its last backward
            self._state.keep_gathered = True
        return super().forward_one_chunk(*args, **kwargs)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if self._sharded:
            if backward_type != "full":
                raise ValueError(f"stage {self.stage_index}: a schedule that splits backward into input and weight "
                                 f"parts ({backward_type!r}: zero-bubble schedules) is not supported on a sharded "
                                 "stage; use GPipe, 1F1B, Interleaved1F1B or LoopedBFS")
            state = sharded_state(self.submod)
            state.requires_gradient_sync = bool(last_backward or self.reduce_per_microbatch)
            state.is_last_backward = bool(last_backward)
            state.keep_gathered = self.keep_gathered and not last_backward  # the last reshards at its end
            self._tie_due = self._tie_due or bool(last_backward)  # perform_reduce_grad sums the tied gradients
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        if self._sharded:
            sharded_state(self.submod).finish_grad_sync()  # a no-op after the last backward, which waited for it
        super().perform_reduce_grad(grad_scale_factor)
        if self._tied is not None and self._tie_due:  # after the scaling, which writes the gradients in place; only
            # after a step's last backward (not after a forward-only schedule.eval)
            self._tie_due = False
            group, fragments = self._tied
            for f in fragments:  # the sum of the two ends' gradients, on both ends (every rank reduces every unit,
                # so a fragment's gradient is never None after a backward)
                # asynchronous: an interleaved schedule still runs this rank's other stages, which the other end
                # waits for; waited for at the step boundary (finish_grad_sync: optimizer step, clipping)
                work = comm.all_reduce(f.grad, group, async_op=True)
                if work is not None:
                    what = f"the all-reduce of the tied weights {self._tied_names} over the pipeline ends"
                    self._state.step_waits.append(lambda w=work: comm.wait(w, what))


def _tie(submodule: nn.Module, topo, stage_index: int, num_stages: int, names: list[str]) -> tuple:
    """The ends group and this stage's fragments of the tied ``names``, after copying the first stage's values into
    the last's (see [Note: weights tied across stages]).

    Raises:
        ValueError: the stage is not an end of the pipeline, ``pp`` is 1, a name is not a parameter of the stage, or
            a tied parameter is sharded (keep it whole: ``replicate_filter``); the last check is the same on both
            ends, so both raise.
    """
    if topo.pp == 1 or stage_index not in (0, num_stages - 1):
        raise ValueError(f"tied_parameters {names} on stage {stage_index} of {num_stages} (pp {topo.pp}): a weight is "
                         f"tied across the first and the last stage only, on pp > 1")
    params = dict(submodule.named_parameters())
    missing = [n for n in names if n not in params]
    if missing:
        raise ValueError(f"tied_parameters {missing} are not parameters of stage {stage_index} "
                         f"(it has {sorted(params)})")
    fragments = [params[n] for n in names]
    full = {id(nf.param): nf.shape for nf in named_fragments(submodule)} if is_sharded(submodule) else {}
    for n, f in zip(names, fragments):
        shape = full.get(id(f), tuple(f.shape))
        if tuple(f.shape) != shape:
            raise ValueError(f"tied parameter {n!r} of stage {stage_index} is sharded (this rank holds {tuple(f.shape)} "
                             f"of {shape}); keep it whole on both ends: fully_shard(..., replicate_filter=lambda n, p: "
                             f"n == {n!r})")
        if stage_index == num_stages - 1:
            count_once(f)  # the first stage's copy counts in the norm
    group = topo.get_pipeline_ends_group()
    with torch.no_grad():
        for f in fragments:  # the copies start equal: the first stage's values (a meta-built head has no draw)
            comm.broadcast(f.data, group, group_src=0, what=f"the initial copy of the tied weights {names}")
    return group, fragments


def build_schedule(kind: str, stages: list[PipelineStage], n_microbatches: int, loss_fn, *,
                   scale_grads: bool = True):
    """torch's schedule ``kind`` (one of ``SCHEDULES``) over this rank's ``stages``, ``n_microbatches`` micro-batches
    per step, ``loss_fn(output, target)`` on the last stage; ``scale_grads`` divides the gradients by
    ``n_microbatches`` (the loss is then the mean over the step's micro-batches).

    Raises:
        ValueError: ``kind`` unknown or a zero-bubble schedule (its split backward is not supported on sharded
            stages); ``stages`` empty, not :class:`PipelineStage` objects, or more than one for ``gpipe`` / ``1f1b``;
            ``n_microbatches`` below 1; torch's own rules of each schedule (e.g. 1F1B needs at least as many
            micro-batches as stages) are torch's errors. Raised on every rank, before any communication.
    """
    from torch.distributed import pipelining as pl
    if kind in _ZERO_BUBBLE:
        raise ValueError(f"schedule {kind!r}: zero-bubble schedules split backward into input and weight parts, which "
                         f"sharded stages do not support; use one of {SCHEDULES}")
    classes = {"gpipe": pl.ScheduleGPipe, "1f1b": pl.Schedule1F1B, "interleaved": pl.ScheduleInterleaved1F1B,
               "looped_bfs": pl.ScheduleLoopedBFS}
    if kind not in classes:
        raise ValueError(f"unknown pipeline schedule {kind!r}; choose one of {SCHEDULES}")
    stages = list(stages)
    if not stages or not all(isinstance(s, PipelineStage) for s in stages):
        raise ValueError(f"stages must be this rank's shardfusion.pipeline.PipelineStage objects, got {stages!r}")
    single = kind in ("gpipe", "1f1b")
    if single and len(stages) != 1:
        raise ValueError(f"schedule {kind!r} runs one stage per pp rank, got {len(stages)} (stages "
                         f"{[s.stage_index for s in stages]}); use 'interleaved' or 'looped_bfs' for several")
    if not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ValueError(f"n_microbatches must be an int >= 1, got {n_microbatches!r}")
    target = stages[0] if single else stages
    return classes[kind](target, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)


def _memoize_one(vote: torch.Tensor) -> None:
    """Make a dry run's fake vote read as 1 (see ``PipelineStage._warmup_backward_result``)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(vote, FakeTensor):
        vote.item_memo = 1
