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
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn

from shardfusion._runtime.state import is_sharded, sharded_state

try:  # torch.distributed.pipelining is part of torch; imported lazily by users of this module only
    from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage
except ImportError as e:  # pragma: no cover - a torch without pipelining
    raise ImportError("shardfusion.pipeline needs torch.distributed.pipelining (torch >= 2.4)") from e

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

    Raises:
        ValueError: ``stage_index`` / ``num_stages`` do not fit ``topo.pp`` (the numbers named), or ``input_args`` /
            ``output_args`` are missing (on every rank: each builds its stages from the same numbers).
    """

    def __init__(self, submodule: nn.Module, topo, stage_index: int, num_stages: int, *,
                 input_args: Any, output_args: Any, device: Optional[torch.device] = None,
                 reduce_per_microbatch: bool = False) -> None:
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

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if self._sharded:
            if backward_type != "full":
                raise ValueError(f"stage {self.stage_index}: a schedule that splits backward into input and weight "
                                 f"parts ({backward_type!r}: zero-bubble schedules) is not supported on a sharded "
                                 "stage; use GPipe, 1F1B, Interleaved1F1B or LoopedBFS")
            state = sharded_state(self.submod)
            state.requires_gradient_sync = bool(last_backward or self.reduce_per_microbatch)
            state.is_last_backward = bool(last_backward)
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        if self._sharded:
            sharded_state(self.submod).finish_grad_sync()  # a no-op after the last backward, which waited for it
        super().perform_reduce_grad(grad_scale_factor)


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
