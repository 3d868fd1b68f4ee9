"""Fault-tolerant HSDP replica groups on torchft (``pip install 'shardfusion[ft]'``; imported only when used).

HSDP's replicas are failure domains: each holds a whole copy of the sharded model. Here each replica group (the
ranks of one outer index: a node, or several) runs as a job of its own, with its own launcher and a `Topology` of
outer degree 1, so its all-gathers and reduce-scatters stay inside it. What HSDP's outer all-reduce did, averaging
the sharded gradients over the replicas, goes through torchft (PyTorch's fault-tolerance engine: a lighthouse that
forms a quorum of the replica groups alive each step, a `torchft.Manager` per rank, live recovery from a peer) over
the replica groups of this step's quorum. Rank g of every replica group holds the same shard, so torchft's
cross-replica group of group rank g is exactly HSDP's replicate group of inner index g.

A step (`ReplicaGroup`):

1. `start_step` joins the quorum (torchft's ``start_quorum``, synchronous: a replica that must recover receives
   the live state here, before its forward, and takes part in this very step).
2. forward and backward as usual; the sharded gradients are final inside the replica group.
3. `sync_gradients` averages each trainable flat buffer's sharded gradient (``grad_shard``, shape (S,), whole
   buffers) over the participating replicas (SUM / number of participants: each replica's gradient is the mean over
   its own samples, so with equal batches every sample counts once), then votes: a 1-element all-reduce of ones over
   the same replicas must equal the number of participants, and torchft's ``should_commit`` ANDs the votes of the
   ranks of each replica group in `commit`: only then do the optimizers step (clip between the two). A failed
   collective (a replica died mid-step) fails the vote: the survivors discard the step (no optimizer step, gradients
   dropped) and retry it at the next quorum, which forms without the dead replica once its heartbeat times out.

Live recovery: every rank registers its state with torchft: the shard of every flat buffer (parameters and frozen
weights, in place), each optimizer's local state (`local_optimizer_state`: no collective, unlike a sharded model's
``optimizer.state_dict()``) and the caller's own state (`extra_state`). A replica that joins (a restart, a new node) gets it from the peer of the same group rank over the
cross-replica process group (torchft's ``PGTransport``) and then runs the same arithmetic as its peers: bitwise in
step from its first step. See docs/fault-tolerance.md for the guarantees and the limits.
"""

from __future__ import annotations

import hashlib
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from shardfusion._runtime.state import flat_buffers

INSTALL_HINT = "pip install 'shardfusion[ft]'"


def import_torchft() -> Any:
    """The torchft module; ValueError naming `INSTALL_HINT` when it is missing."""
    try:
        import torchft
        import torchft.checkpointing.pg_transport  # noqa: F401
        import torchft.process_group  # noqa: F401
    except ImportError as error:
        raise ValueError(f"fault tolerance needs the torchft package ({INSTALL_HINT}): {error}") from None
    return torchft


def check_lighthouse(address: str, timeout_s: float = 5.0) -> None:
    """Raise ValueError (one line) when no lighthouse answers at ``address`` (``http://host:port``) within
    timeout_s seconds: its HTTP status page is read once."""
    if not address.startswith(("http://", "https://")):
        raise ValueError(f"--ft-lighthouse {address!r} must be an http://host:port address")
    try:
        with urllib.request.urlopen(address.rstrip("/") + "/status", timeout=timeout_s) as reply:
            reply.read(1)
    except (urllib.error.URLError, OSError, ValueError) as error:
        reason = getattr(error, "reason", error)
        raise ValueError(f"--ft-lighthouse {address}: no lighthouse answers there ({reason}); start one with "
                         f"`torchft_lighthouse --min_replicas 1 --bind HOST:PORT` (docs/fault-tolerance.md)") from None


@dataclass
class FTRecord:
    """What the fault tolerance did, for the job's summary (times in seconds, on this rank)."""

    committed: int = 0
    """Steps committed."""
    discarded: list[dict[str, Any]] = field(default_factory=list)
    """Steps whose vote failed: {"step", "participants", "at_s"}."""
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    """State received from a peer: {"step", "bytes", "seconds"} (from the start of the quorum to the state loaded)."""
    waits: list[dict[str, Any]] = field(default_factory=list)
    """Quorums below min_replicas: {"step", "participants", "seconds"}."""
    participants: list[int] = field(default_factory=list)
    """Participating replicas of each committed step."""


def local_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """This rank's optimizer state as it is in memory: each group's settings and each parameter's state (the
    fragments' tensors), in parameter order. No collective (unlike a sharded model's ``optimizer.state_dict()``,
    which builds DTensors): torchft calls it from its own thread while the peers wait for the quorum."""
    return {"groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
            "state": [[dict(optimizer.state[p]) if p in optimizer.state else {} for p in g["params"]]
                      for g in optimizer.param_groups]}


def load_local_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """Put `local_optimizer_state`'s result (a peer's, of the same shard) into ``optimizer``: copies of the tensors."""
    if len(saved["groups"]) != len(optimizer.param_groups):
        raise RuntimeError(f"recovery: the peer's optimizer has {len(saved['groups'])} parameter groups, this one "
                           f"{len(optimizer.param_groups)}")
    for group, settings, states in zip(optimizer.param_groups, saved["groups"], saved["state"]):
        group.update(settings)
        for param, state in zip(group["params"], states):
            if state:
                optimizer.state[param] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                                          for k, v in state.items()}
            else:
                optimizer.state.pop(param, None)


def _nbytes(tree: Any) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_nbytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_nbytes(v) for v in tree)
    return 0


class ReplicaGroup:
    """This rank's part of one fault-tolerant replica group (see the module docstring).

    models: the sharded model, or a list of sharded models (pipeline stages), of a job whose Topology has
    fsdp_outer_degree 1. optimizers: the optimizers stepped at each committed step. extra_state: () -> dict and
    dict -> None, the caller's own state sent with a recovery (plain Python values and tensors).

    lighthouse: ``http://host:port`` of the torchft lighthouse; replica_id: this group's id, an int, the same on
    its ranks; min_replicas: a step commits only with at least this many replicas (else it is discarded and the
    group waits, saying so); timeout: the failure-detection bound of a collective (a hung peer) and of torchft's
    RPCs; quorum_timeout: how long a quorum may take to form before `start_step` raises; host: the address other
    replica groups reach this one at (its store and manager server).

    Raises:
        ValueError: torchft missing, no lighthouse at ``lighthouse``, min_replicas < 1.
    """

    def __init__(self, models: nn.Module | Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer], *,
                 lighthouse: str, replica_id: int, min_replicas: int = 1, timeout: timedelta = timedelta(seconds=10),
                 quorum_timeout: timedelta = timedelta(seconds=120), host: str = "127.0.0.1",
                 extra_state: Optional[tuple[Callable[[], dict], Callable[[dict], None]]] = None,
                 device: Optional[torch.device] = None) -> None:
        if min_replicas < 1:
            raise ValueError(f"min_replicas must be >= 1, got {min_replicas}")
        torchft = import_torchft()
        self.models = [models] if isinstance(models, nn.Module) else list(models)
        self.optimizers = list(optimizers)
        self.min_replicas = min_replicas
        self.replica_id = replica_id
        self.extra_state = extra_state
        self.record = FTRecord()
        self.device = device or torch.device("cpu")
        rank, world = dist.get_rank(), dist.get_world_size()
        store = None
        port = torch.zeros(1, dtype=torch.long)
        if rank == 0:  # the group's own store for torchft, reachable by the other replica groups at `host`
            store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=quorum_timeout)
            port[0] = store.port
        dist.broadcast(port, 0)
        self._store = store  # kept alive for the manager
        self.pg = torchft.process_group.ProcessGroupGloo(timeout=timeout)
        transport = torchft.checkpointing.pg_transport.PGTransport(self.pg, timeout=timeout, device=self.device,
                                                                   state_dict=None)
        self._quorum_started = 0.0
        self._participants = 0
        try:
            self.manager = torchft.Manager(
                pg=self.pg, load_state_dict=self._load, state_dict=self._state, min_replica_size=min_replicas,
                use_async_quorum=False, timeout=timeout, quorum_timeout=quorum_timeout, connect_timeout=timeout,
                rank=rank, world_size=world, store_addr=host, store_port=int(port[0]),
                lighthouse_addr=lighthouse, replica_id=f"replica_{replica_id}", hostname=host,
                checkpoint_transport=transport)
        except RuntimeError as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ValueError(f"--ft-lighthouse {lighthouse}: cannot join the lighthouse: {first}") from None

    # ---- the state a recovering replica receives -----------------------------------------------------------
    def _buffers(self, trainable_only: bool = False) -> list:
        return [b for m in self.models for b in flat_buffers(m, trainable_only)]

    def _state(self) -> dict:
        return {"shards": [b.shard for b in self._buffers()],
                "optimizers": [local_optimizer_state(o) for o in self.optimizers],
                "extra": self.extra_state[0]() if self.extra_state else {}}

    def _load(self, state: dict) -> None:
        shards = self._buffers()
        if len(state["shards"]) != len(shards):
            raise RuntimeError(f"recovery: the peer sent {len(state['shards'])} flat buffers, this model has "
                               f"{len(shards)}: the replica groups do not train the same model")
        with torch.no_grad():
            for buffer, shard in zip(shards, state["shards"]):
                buffer.shard.copy_(shard)
        for optimizer, saved in zip(self.optimizers, state["optimizers"]):
            load_local_optimizer_state(optimizer, saved)
        if self.extra_state:
            self.extra_state[1](state["extra"])
        self.record.recoveries.append({"step": self.manager.current_step() if hasattr(self, "manager") else None,
                                       "bytes": _nbytes(state),
                                       "seconds": time.perf_counter() - self._quorum_started})

    # ---- a step --------------------------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Steps committed by the quorum so far (a recovered replica takes its peer's)."""
        return self.manager.current_step()

    def start_step(self) -> None:
        """Join this step's quorum (blocking; a replica behind the others recovers here)."""
        self._quorum_started = time.perf_counter()
        self.manager.start_quorum()

    def participants(self) -> int:
        """Replica groups taking part in this step."""
        return self.manager.num_participants()

    def sync_gradients(self, figures: Optional[torch.Tensor] = None) -> None:
        """Average each trainable flat buffer's sharded gradient ((S,), whole buffers, in place) over this step's
        participating replicas (SUM / participants), and ``figures`` (any float tensor, e.g. the step's loss
        already averaged inside the replica group) likewise; then vote: a 1-element SUM of ones over the same
        replicas must equal the number of participants. A failed collective or vote marks the step failed
        (torchft's ``report_error``); `commit` then discards it. Clip after this, before `commit`."""
        works, empty = [], []
        for buffer in self._buffers(trainable_only=True):
            grad = buffer.grad_shard
            if grad is None or all(f.grad is None for f in buffer.fragments):
                # no gradient here this step: still join the collective; keep the result only if a peer had one
                grad = torch.zeros_like(buffer.shard)
                empty.append((buffer, grad))
            works.append(self.manager.allreduce(grad))  # SUM / participants, in place
        if figures is not None:
            works.append(self.manager.allreduce(figures))
        for work in works:
            work.wait()
        for buffer, grad in empty:
            if grad.any():
                buffer.grad_shard = grad
                buffer._attach_fragment_grads()
        vote = torch.ones(1)
        self.manager.allreduce(vote, reduce_op=dist.ReduceOp.SUM).wait()
        self._participants = self.participants()
        if int(vote.item()) != self._participants:
            self.manager.report_error(RuntimeError(f"vote {int(vote.item())} of {self._participants} replicas"))

    def commit(self) -> bool:
        """Step the optimizers if every rank of every participating replica voted yes (torchft's
        ``should_commit``, which also needs min_replicas participants); returns whether the step committed. A
        discarded step leaves parameters and optimizer state as they were. Gradients are dropped either way."""
        participants = self._participants
        started = time.perf_counter()
        ok = self.manager.should_commit()
        if ok:
            for optimizer in self.optimizers:
                optimizer.step()
            self.record.committed += 1
            self.record.participants.append(participants)
        else:
            self.record.discarded.append({"step": self.step, "participants": participants, "at_s": started})
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        return ok

    def state_digest(self) -> str:
        """Hex SHA-256 of this rank's training state as a recovery sends it (every flat buffer's shard, each
        optimizer's state tensors, in order): equal on the same group rank of two replica groups exactly when their
        states are bitwise equal. No collective."""
        digest = hashlib.sha256()

        def add(tree: Any) -> None:
            if isinstance(tree, torch.Tensor):
                digest.update(tree.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
            elif isinstance(tree, dict):
                for key in sorted(tree, key=str):
                    digest.update(str(key).encode())
                    add(tree[key])
            elif isinstance(tree, (list, tuple)):
                for item in tree:
                    add(item)
            else:
                digest.update(repr(tree).encode())
        state = self._state()
        add([state["shards"], state["optimizers"]])
        return digest.hexdigest()

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
