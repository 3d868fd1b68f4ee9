"""DiLoCo in the training job (--outer-sync diloco): the outer step after the inner ones, and the per-rank state a
checkpoint needs for an exact resume. `shardfusion.train.job` builds an `OuterRun` after the optimizers, passes
`OuterRun.rank_tensors` to every save and `OuterRun.placeholders` to the restore, then calls `OuterRun.restored`,
and calls `OuterRun.step` after every optimizer step. The engine is `shardfusion.diloco`; the flags
`shardfusion.train.outer_config`; docs/slow-links.md the whole story.

Why per-rank state: between two outer steps the replicas differ (their parameters and their AdamW moments), while a
checkpoint stores a replicated shard once (replica 0's). So each rank also saves, under ``rank/<rank>/diloco/...``:
its own shards, the outer snapshot and momentum, and its AdamW state. A resume loads them back over replica 0's
copy: the continuation is the run that was saved, mid-period too. That needs the saved layout and world size; a
checkpoint without DiLoCo state (an every-step run) starts a new period from the loaded parameters.

With pipeline stages (--pp > 1) ``model`` is this rank's list of stages: one `DiLoCo` over them, so each stage's
buffers have their own snapshot and momentum and are averaged over that stage's replicas, at the same steps on every
rank; the per-rank state above is then this rank's stages' (the buffers numbered over them in stage order).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

import shardfusion as sf
from shardfusion.diloco import DiLoCo
from shardfusion.train import dtype_flags
from shardfusion.train.dtype_flags import PrecisionConfig
from shardfusion.train.outer_config import OuterConfig

PREFIX = "diloco/"
ADAMW_KEYS = ("step", "exp_avg", "exp_avg_sq")


class OuterRun:
    """This rank's DiLoCo (see the module docstring): ``outer`` the outer-sync section, ``precision`` its wire
    format (--outer-comm-dtype), ``steps`` the run's last step (a period ends there too), ``external``: fault-tolerant
    replica groups are the replicas (`DiLoCo`'s)."""

    def __init__(self, outer: OuterConfig, precision: PrecisionConfig, steps: int,
                 model: nn.Module | Sequence[nn.Module], topo: sf.Topology, optimizers: Sequence[torch.optim.Optimizer], *, external: bool = False) -> None:
        self.steps = steps
        self.optimizers = list(optimizers)
        self.diloco = DiLoCo(model, topo, every=outer.outer_every, lr=outer.outer_lr,
                             momentum=outer.outer_momentum, comm_dtype=dtype_flags.outer_comm_dtype(precision),
                             fragments=outer.outer_fragments, external=external)
        self.replica_group = self.diloco.replica_group

    def _params(self) -> list[tuple[str, torch.Tensor]]:
        return [(f"{o}/{j}", p) for o, opt in enumerate(self.optimizers)
                for j, p in enumerate(p for g in opt.param_groups for p in g["params"])]

    def rank_tensors(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of this rank (the live tensors; the save copies them)."""
        tensors = {f"{PREFIX}shard/{i}": b.shard for i, b in enumerate(self.diloco.buffers)}
        for key, value in self.diloco.state_dict().items():
            if isinstance(value, torch.Tensor):
                tensors[PREFIX + key] = value
        tensors[PREFIX + "outer_steps"] = torch.tensor(self.diloco.outer_steps, dtype=torch.long)
        for name, p in self._params():
            for key, value in self.optimizers[int(name.split("/")[0])].state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{PREFIX}opt/{name}/{key}"] = value
        return tensors

    def placeholders(self) -> dict[str, torch.Tensor]:
        """Keys a restore may find, as empty tensors (the checkpoint's own shapes come back): never the live
        ones, which the same load also fills from replica 0's copy."""
        keys = [f"{PREFIX}shard/{i}" for i in range(len(self.diloco.buffers))]
        keys += [f"{PREFIX}{k}/{i}" for k in ("snapshot", "momentum") for i in range(len(self.diloco.buffers))]
        keys += [PREFIX + "outer_steps"]
        keys += [f"{PREFIX}opt/{name}/{key}" for name, _ in self._params() for key in ADAMW_KEYS]
        return {key: torch.empty(0) for key in keys}

    def restored(self, loaded: dict[str, torch.Tensor], start: int) -> str | None:
        """Put the per-rank state of a restore back (``loaded``: what `placeholders` became); ``start``: the
        step resumed at. Returns a note when the checkpoint had no DiLoCo state (a new period starts; the next
        outer step comes at the next multiple of --outer-every, so the schedule follows the global step).
        Collective: every rank takes the same branch, or every rank raises.

        Raises:
            ValueError: on every rank: the saved per-rank state does not fit this run (another world size, layout
                or model): some ranks have it and others not, or its shapes differ.
        """
        d = self.diloco
        has = f"{PREFIX}snapshot/0" in loaded
        seen = torch.tensor([int(has), int(not has)], dtype=torch.long, device=d.buffers[0].shard.device
                            if d.buffers else None)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        if bool(seen[0]) and bool(seen[1]):
            raise ValueError("the checkpoint's DiLoCo state was saved at another world size (some ranks have it, "
                             "others not); resume a DiLoCo run at the world size and layout it was saved with")
        if not has:
            d.reset()
            d.inner_steps = start
            return "the checkpoint has no DiLoCo state (an every-step run): a new outer period starts here"
        problem = None
        try:
            self._put_back(loaded, start)
        except ValueError as error:
            problem = str(error)
        flag = torch.tensor([int(problem is not None)], dtype=torch.long, device=seen.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag):
            raise ValueError(problem or "the checkpoint's DiLoCo state does not fit this layout on another rank; "
                             "resume a DiLoCo run with the layout and world size it was saved with")
        return None

    def _put_back(self, loaded: dict[str, torch.Tensor], start: int) -> None:
        d = self.diloco
        state: dict[str, Any] = {"inner_steps": start, "outer_steps": loaded[PREFIX + "outer_steps"].tolist()}
        state.update({key[len(PREFIX):]: value for key, value in loaded.items()
                      if key.startswith((PREFIX + "snapshot/", PREFIX + "momentum/"))})
        d.load_state_dict(state)
        with torch.no_grad():
            for i, b in enumerate(d.buffers):
                saved = loaded.get(f"{PREFIX}shard/{i}")
                if saved is None or saved.shape != b.shard.shape:
                    raise ValueError(f"DiLoCo state: shard {i} of this rank was saved with another layout; resume a "
                                     f"DiLoCo run with the layout and world size it was saved with")
                b.shard.copy_(saved)
            for name, p in self._params():
                opt_state = self.optimizers[int(name.split("/")[0])].state.get(p, {})
                for key in ADAMW_KEYS:
                    saved = loaded.get(f"{PREFIX}opt/{name}/{key}")
                    mine = opt_state.get(key)
                    if saved is None or not isinstance(mine, torch.Tensor):
                        continue
                    if saved.shape != mine.shape:
                        raise ValueError(f"DiLoCo state: AdamW {key} of parameter {name} was saved with another "
                                         f"layout; resume with the saved layout")
                    mine.copy_(saved)

    def due_at(self, done: int) -> list[int]:
        """The fragments whose outer step follows inner step ``done`` (1-based): those due then
        (`shardfusion.diloco.DiLoCo.due`), and every fragment at the run's last step (--steps). What `step` runs;
        for the outer steps a caller runs itself (fault tolerance: `job_outer_ft`)."""
        if done == self.steps:
            return list(range(len(self.diloco.fragments)))
        return self.diloco.due(done)

    def recovery_state(self) -> dict[str, Any]:
        """The outer state a replica group that joins receives from a live peer (fault tolerance,
        `shardfusion.ft.ReplicaGroup`'s ``extra_state``): the snapshot and momentum of every trainable flat buffer
        ((S,) each, the live tensors) and the outer step counts. No collective."""
        d = self.diloco
        return {"snapshot": d.snapshot, "momentum": d.momentum_buffers, "outer_steps": list(d.outer_steps)}

    def load_recovery_state(self, state: dict[str, Any]) -> None:
        """Put a peer's `recovery_state` in (its shapes are this group's: the shards were checked first)."""
        d = self.diloco
        with torch.no_grad():
            for mine, theirs in zip(d.snapshot + d.momentum_buffers, state["snapshot"] + state["momentum"]):
                mine.copy_(theirs)
        d.outer_steps = [int(x) for x in state["outer_steps"]]

    def step(self, done: int) -> list[int]:
        """After inner optimizer step ``done`` (1-based): the outer step of each fragment now due (`DiLoCo.step`);
        at the run's last step (--steps) of every fragment, so the run ends as one model (`DiLoCo.finish`)."""
        synced = self.diloco.step()
        if done == self.steps:
            synced = sorted(synced + self.diloco.finish())
        return synced
