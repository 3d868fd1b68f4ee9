"""Fault-tolerant HSDP replica groups on torchft (``pip install 'shardfusion[ft]'``; imported only when used).

HSDP's replicas are failure domains: each holds a whole copy of the sharded model. Here each replica group (the
ranks of one outer index: a node, or several) runs as a job of its own, with its own launcher and a `Topology` of
outer degree 1, so its all-gathers and reduce-scatters stay inside it. What HSDP's outer all-reduce did, averaging
the sharded gradients over the replicas, goes through torchft (PyTorch's fault-tolerance engine: a lighthouse that
forms a quorum of the replica groups alive each step, a `torchft.Manager` per rank, live recovery from a peer) over
the replica groups of this step's quorum. Rank g of every replica group holds the same shard, so torchft's
cross-replica group of group rank g is exactly HSDP's replicate group of inner index g. With tensor parallel inside
the groups (a `Topology` with mp > 1), group rank g holds the same mp index's pieces in every group, and its flat
buffers are plain tensors of those local pieces: the same holds, with HSDP's replicate group of that (inner, mp)
index.

A step (`ReplicaGroup`):

1. `start_step` joins the quorum (torchft's ``start_quorum``, synchronous: a replica that must recover receives
   the live state here, before its forward, and takes part in this very step).
2. forward and backward as usual; the sharded gradients are final inside the replica group.
3. `sync_gradients` averages each trainable flat buffer's sharded gradient (``grad_shard``, shape (S,), whole
   buffers) over the participating replicas (SUM / number of participants: each replica's gradient is the mean over
   its own samples, so with equal batches every sample counts once), then votes: an all-reduce over the same
   replicas of a one and a had-a-gradient flag per buffer, whose first element must equal the number of
   participants, and torchft's ``should_commit`` ANDs the votes of the
   ranks of each replica group in `commit`: only then do the optimizers step (clip between the two). A failed
   collective (a replica died mid-step) fails the vote: the survivors discard the step (no optimizer step, gradients
   dropped) and retry it at the next quorum, which forms without the dead replica once its heartbeat times out.

Live recovery: every rank registers its state with torchft: the shard of every flat buffer (parameters and frozen
weights, in place), each optimizer's local state (`local_optimizer_state`: no collective, unlike a sharded model's
``optimizer.state_dict()``) and the caller's own state (`extra_state`). A replica that joins (a restart, a new node) gets it from the peer of the same group rank over the
cross-replica process group (torchft's ``PGTransport``) and then runs the same arithmetic as its peers: bitwise in
step from its first step. See docs/fault-tolerance.md for the guarantees and the limits.

DiLoCo across replica groups (semi-synchronous: a quorum only at the outer steps): `average_over_quorum` averages
the pseudo-gradients of ``shardfusion.diloco.DiLoCo(external=True)`` over the groups of the quorum that trained the
period (a group healed at that quorum sends zeros and is not counted), then votes.
"""

from __future__ import annotations

import hashlib
import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from shardfusion import comm
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


def _first_line(error: BaseException) -> str:
    """An error's message in one line; of a gRPC status from torchft's client, its message only."""
    text = str(error).strip()
    grpc = re.search(r'message: "([^"]*)"', text)
    if grpc:
        return grpc.group(1)
    return text.splitlines()[0] if text else type(error).__name__


@dataclass
class FTRecord:
    """What the fault tolerance did, for the job's summary (times in seconds, on this rank)."""

    committed: int = 0
    """Steps committed."""
    discarded: list[dict[str, Any]] = field(default_factory=list)
    """Steps whose vote failed: {"step", "participants", "at_s"}."""
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    """State received from a peer: {"step", "bytes", "seconds"} (from the start of the quorum to the state loaded)."""
    participants: list[int] = field(default_factory=list)
    """Participating replicas of each committed step."""


def local_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """This rank's optimizer state as it is in memory: each group's settings and each parameter's state (the
    fragments' tensors), in parameter order. No collective (unlike a sharded model's ``optimizer.state_dict()``,
    which builds DTensors): torchft calls it from its own thread while the peers wait for the quorum."""
    return {"groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
            "state": [[dict(optimizer.state[p]) if p in optimizer.state else {} for p in g["params"]]
                      for g in optimizer.param_groups]}


def _state_device(key: str, value: torch.Tensor, param: torch.Tensor, mine: dict, group: dict) -> torch.device:
    """Where a received optimizer-state tensor belongs on this rank: beside this rank's own tensor of that key,
    else beside the parameter, except 0-dim tensors (AdamW's ``step``), which torch's optimizers keep on the CPU
    unless the parameter group runs fused or capturable."""
    if isinstance(mine.get(key), torch.Tensor):
        return mine[key].device
    on_device = group.get("fused") or group.get("capturable")
    return torch.device("cpu") if value.dim() == 0 and not on_device else param.device


def load_local_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """Put `local_optimizer_state`'s result (a peer's, of the same shard) into ``optimizer``: copies of the tensors,
    each on this rank's device for it (`_state_device`: a transport may hand tensors over on the CPU while the
    parameters live on a GPU)."""
    if len(saved["groups"]) != len(optimizer.param_groups):
        raise RuntimeError(f"recovery: the peer's optimizer has {len(saved['groups'])} parameter groups, this one "
                           f"{len(optimizer.param_groups)}")
    for group, settings, states in zip(optimizer.param_groups, saved["groups"], saved["state"]):
        group.update(settings)
        for param, state in zip(group["params"], states):
            if state:
                mine = optimizer.state.get(param, {})
                optimizer.state[param] = {
                    k: v.to(_state_device(k, v, param, mine, group), copy=True) if isinstance(v, torch.Tensor)
                    else v
                    for k, v in state.items()}
            else:
                optimizer.state.pop(param, None)


def _nbytes(tree: Any) -> int:
    """Bytes a transport sends for ``tree``: torchft's PGTransport sends each tensor's whole storage (a view of a
    larger buffer carries all of it)."""
    if isinstance(tree, torch.Tensor):
        return tree.untyped_storage().nbytes()
    if isinstance(tree, dict):
        return sum(_nbytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_nbytes(v) for v in tree)
    return 0


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an IPv4/IPv6 address) is this machine's loopback (127.0.0.0/8, ::1,
    localhost)."""
    if host in ("localhost", "::1") or host.startswith("127."):
        return True
    try:
        return socket.gethostbyname(host).startswith("127.")
    except OSError:
        return False


def lighthouse_host(address: str) -> str:
    """The host of a lighthouse address ``http://host:port``."""
    return urllib.parse.urlsplit(address).hostname or ""


def reachable_host(lighthouse: str) -> str:
    """The address other replica groups can reach this one at, by default: this machine's address on the interface
    that routes to the lighthouse (a UDP socket 'connected' to it: no packet is sent). 127.0.0.1 for a lighthouse
    on 127.0.0.1; the veth address of a network namespace for a lighthouse across its link.

    Raises:
        ValueError: no route to the lighthouse's host.
    """
    split = urllib.parse.urlsplit(lighthouse)
    host = split.hostname or ""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, split.port or 80))
            return probe.getsockname()[0]
    except OSError as error:
        raise ValueError(f"--ft-lighthouse {lighthouse}: cannot find this machine's address towards {host!r} "
                         f"({error}); give it with --ft-host") from None


ID_BITS = 62
"""Replica ids below this are checked for duplicates (`agreement`: one bit each of an int64)."""


def agreement(replica_id: int, replicas: int, group_world: int, fingerprint: str) -> torch.Tensor:
    """What every replica group of a quorum must agree on, as 5 int64s to SUM over it (`check_agreement`):
    replicas, the group's world size, a 62-bit settings fingerprint (hex) cut in two 31-bit halves, and the bit
    1 << replica_id (0 for ids >= `ID_BITS`). Sums of n powers of two have n bits set exactly when they are
    distinct; the other sums equal n x each value exactly when all values are equal."""
    value = int(fingerprint[:16], 16) >> 2
    bit = 1 << replica_id if replica_id < ID_BITS else 0
    return torch.tensor([replicas, group_world, value >> 31, value & (2**31 - 1), bit], dtype=torch.long)


def _agree_in_group(problem: Optional[str], device: torch.device) -> Optional[str]:
    """The first non-None ``problem`` of this replica group's ranks, on every rank (one all-gather of the messages
    over the group's default process group): so all of its ranks stop together, or none."""
    flag = torch.tensor([0 if problem is None else 1], dtype=torch.long, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not int(flag):
        return None
    problems = comm.all_gather_object(problem, None, "the replica group's problems (fault tolerance)")
    return next(p for p in problems if p is not None)


def check_agreement(mine: torch.Tensor, summed: torch.Tensor, maxed: torch.Tensor, participants: int
                    ) -> Optional[str]:
    """None if the quorum's groups agree, else what differs (one line). ``mine``: this group's `agreement`;
    ``summed`` and ``maxed``: its SUM and MAX over the ``participants`` groups. n values are all equal exactly when
    their sum is n x their max; every group sees the same sums and maxima, so every group reaches the same
    verdict."""
    n = participants

    def differ(i: int) -> bool:
        return int(summed[i]) != n * int(maxed[i])

    if differ(0):
        return f"the {n} replica groups in the quorum differ in --ft-replicas (this one {int(mine[0])})"
    if differ(1):
        return (f"the {n} replica groups in the quorum have different numbers of ranks (this one {int(mine[1])}, "
                f"at most {int(maxed[1])}); start each with the same --nproc")
    if differ(2) or differ(3):
        return ("the replica groups in the quorum were started with different settings (model, --mp, data, batch, "
                "optimizer or schedule); start every group with the same flags but --ft-replica-id")
    if int(mine[0]) <= ID_BITS and bin(int(summed[4])).count("1") != n:  # every id sets a bit
        return (f"two replica groups in the quorum use the same --ft-replica-id (this one "
                f"{int(mine[4]).bit_length() - 1}); each group needs its own")
    return None


class FTError(RuntimeError):
    """A replica group cannot go on (the quorum did not form in time, too many steps discarded in a row, the
    groups disagree on their settings); its message is one line naming the flag to look at. Raised on every rank
    of the group."""


class ReplicaGroup:
    """This rank's part of one fault-tolerant replica group (see the module docstring).

    models: the sharded model, or a list of sharded models (pipeline stages), of a job whose Topology has
    fsdp_outer_degree 1 (any mp: tensor parallel stays inside the group). optimizers: the optimizers stepped at
    each committed step. extra_state: () -> dict and dict -> None, the caller's own state sent with a recovery
    (plain Python values and tensors).

    lighthouse: ``http://host:port`` of the torchft lighthouse; replica_id: this group's id, an int in
    0 .. replicas - 1, the same on its ranks; replicas: the groups the run is planned for; min_replicas: a step
    commits only with at least this many replicas (else it is discarded and the group waits, saying so);
    timeout: the failure-detection bound of a collective (a hung peer) and of torchft's RPCs; quorum_timeout: how
    long a quorum may take to form before `start_step` raises `FTError`; max_discards: consecutive steps
    discarded with enough replicas after which `commit` raises `FTError` (None: never); host: the address the other
    replica groups reach this one at (its store and manager server; default `reachable_host`); fingerprint: a hex
    digest of the settings every group must share (`agreement`, checked at each new quorum, before any gradient
    is exchanged).

    Raises:
        ValueError: torchft missing, no lighthouse at ``lighthouse``, min_replicas < 1, replica_id outside
            0 .. replicas - 1.
    """

    def __init__(self, models: nn.Module | Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer], *,
                 lighthouse: str, replica_id: int, replicas: int, min_replicas: int = 1,
                 timeout: timedelta = timedelta(seconds=10), quorum_timeout: timedelta = timedelta(seconds=120),
                 max_discards: Optional[int] = 20, host: Optional[str] = None, fingerprint: str = "0" * 16,
                 extra_state: Optional[tuple[Callable[[], dict], Callable[[dict], None]]] = None,
                 device: Optional[torch.device] = None) -> None:
        if min_replicas < 1:
            raise ValueError(f"min_replicas must be >= 1, got {min_replicas}")
        if not 0 <= replica_id < replicas:
            raise ValueError(f"replica_id {replica_id} must be in 0 .. {replicas - 1} (replicas {replicas})")
        torchft = import_torchft()
        self.models = [models] if isinstance(models, nn.Module) else list(models)
        self.optimizers = list(optimizers)
        self.min_replicas = min_replicas
        self.replica_id = replica_id
        self.max_discards = max_discards
        self.quorum_timeout = quorum_timeout
        self.lighthouse = lighthouse
        self.extra_state = extra_state
        self.record = FTRecord()
        self.device = device or torch.device("cpu")
        self.host = host or reachable_host(lighthouse)
        rank, world = dist.get_rank(), dist.get_world_size()
        self._agreement = agreement(replica_id, replicas, world, fingerprint)
        self._discards_in_a_row = 0
        self._checked_quorum: Any = None
        store = None
        port = torch.zeros(1, dtype=torch.long, device=self.device)  # on the device: NCCL's default group
        if rank == 0:  # the group's own store for torchft, reachable by the other replica groups at `host`
            store = dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False, timeout=quorum_timeout)
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
                rank=rank, world_size=world, store_addr=self.host, store_port=int(port[0]),
                lighthouse_addr=lighthouse, replica_id=f"replica_{replica_id}", hostname=self.host,
                checkpoint_transport=transport)
        except RuntimeError as error:
            raise ValueError(f"--ft-lighthouse {lighthouse}: cannot join the lighthouse: {_first_line(error)}") \
                from None

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
            raise FTError(f"recovery: the peer sent {len(state['shards'])} flat buffers, this model has "
                          f"{len(shards)}: the replica groups do not train the same model; start every group with "
                          f"the same flags")
        for i, (buffer, shard) in enumerate(zip(shards, state["shards"])):
            if shard.shape != buffer.shard.shape:
                raise FTError(f"recovery: flat buffer {i} of the peer has {shard.numel()} elements on this group "
                              f"rank, this model's {buffer.shard.numel()}: the replica groups do not train the same "
                              f"model and layout; start every group with the same flags and --nproc")
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
        """Join this step's quorum (blocking; a replica behind the others recovers here).

        Raises:
            FTError: no quorum within quorum_timeout (the lighthouse is gone, or a peer that still sends heartbeats
                no longer takes part: with two groups, one alone is not a majority), the quorum's groups disagree
                on their settings (`check_agreement`; raised on every rank of every group), or the state received
                from a peer does not fit this model (another model or layout; raised on this group only). In one
                line, on every rank of this group alike (the ranks agree on it first: one small all-reduce per
                step over the group).
        """
        self._quorum_started = time.perf_counter()
        problem = None
        try:
            self.manager.start_quorum()
        except FTError as error:  # a recovery that cannot fit this model (`_load`)
            problem = str(error)
        except Exception as error:  # torchft raises RuntimeError or TimeoutError from its RPC client
            problem = (f"no quorum within --ft-quorum-timeout {self.quorum_timeout.total_seconds():g} s "
                       f"(lighthouse {self.lighthouse}): {_first_line(error)}; is the lighthouse up, and does every "
                       f"replica group in it still train? (docs/fault-tolerance.md)")
        quorum = getattr(self.manager, "_quorum_id", None)  # torchft 0.2 keeps it private; a new one: check
        if problem is None and (quorum is None or quorum != self._checked_quorum):
            summed, maxed = self._agreement.clone(), self._agreement.clone()
            self.manager.allreduce(summed, reduce_op=dist.ReduceOp.SUM).wait()
            self.manager.allreduce(maxed, reduce_op=dist.ReduceOp.MAX).wait()
            if self.manager.errored() is None:  # else the step is discarded and the next quorum checks again
                problem = check_agreement(self._agreement, summed, maxed, self.participants())
                self._checked_quorum = quorum if problem is None else None
        problem = _agree_in_group(problem, self.device)  # every rank of the group stops, or none
        if problem is not None:
            raise FTError(problem)

    def participants(self) -> int:
        """Replica groups taking part in this step."""
        return self.manager.num_participants()

    def sync_gradients(self, figures: Optional[torch.Tensor] = None) -> None:
        """Average each trainable flat buffer's sharded gradient ((S,), whole buffers, in place) over this step's
        participating replicas (SUM / participants), and ``figures`` (any float tensor, e.g. the step's loss
        already averaged inside the replica group) likewise; then vote. A failed collective or vote marks the step
        failed (torchft's ``report_error``); `commit` then discards it. Clip after this, before `commit`.

        The vote is one int64 SUM over the same replicas of [1, had-a-gradient per buffer]: its first element must
        equal the number of participants, and a buffer that had no gradient in this group takes the average only
        where some group had one (so every group attaches the same gradients, also an all-zero average).
        """
        works, empty = [], []
        buffers = self._buffers(trainable_only=True)
        had = torch.zeros(len(buffers), dtype=torch.long)
        for i, buffer in enumerate(buffers):
            grad = buffer.grad_shard
            if grad is None or all(f.grad is None for f in buffer.fragments):
                # no gradient here this step: still join the collective; the vote says whether a peer had one
                grad = torch.zeros_like(buffer.shard)
                empty.append((i, buffer, grad))
            else:
                had[i] = 1
            works.append(self.manager.allreduce(grad))  # SUM / participants, in place
        if figures is not None:
            works.append(self.manager.allreduce(figures))
        vote = torch.cat([torch.ones(1, dtype=torch.long), had])
        works.append(self.manager.allreduce(vote, reduce_op=dist.ReduceOp.SUM))
        for work in works:
            work.wait()
        self._participants = self.participants()
        if self.manager.errored() is not None:
            return  # a collective failed: the vote is void, commit discards the step
        if int(vote[0]) != self._participants:
            self.manager.report_error(RuntimeError(f"vote {int(vote[0])} of {self._participants} replicas"))
            return
        for i, buffer, grad in empty:
            if int(vote[1 + i]) > 0:
                buffer.grad_shard = grad
                buffer._attach_fragment_grads()

    def average_over_quorum(self, tensors: Sequence[torch.Tensor], contributes: bool) -> Optional[int]:
        """The mean of each tensor over this quorum's contributing replica groups, in place (float tensors of any
        shape, the same list on every group), then the vote and torchft's ``should_commit``: DiLoCo's outer step
        across replica groups (``shardfusion.diloco.DiLoCo(external=True)``; call `start_step` first). A group
        that does not contribute (``contributes`` False: it joined at this quorum, its state copied from a peer,
        and has no change of its own) sends zeros and is not counted, so the mean is that of the groups that
        trained: SUM over the quorum, divided by their number (a division by one is skipped: a lone group's mean
        is its own tensor, bitwise).

        Returns the number of contributing groups when every rank of every participating group voted yes (0: no
        group contributed, the tensors are zeros); None when the quorum did not commit (a collective failed, a
        group left during it, fewer than min_replicas): the tensors are then undefined, nothing is recorded as
        done; join a new quorum (`start_step`) and run it again.

        Raises:
            FTError: more than max_discards quorums in a row did not commit with enough replicas.
        """
        works = []
        for tensor in tensors:
            if not contributes:
                tensor.zero_()
            works.append(self.manager.allreduce(tensor, reduce_op=dist.ReduceOp.SUM))
        vote = torch.tensor([1, int(contributes)], dtype=torch.long)  # groups voting, groups contributing
        works.append(self.manager.allreduce(vote, reduce_op=dist.ReduceOp.SUM))
        for work in works:
            work.wait()
        participants = self._participants = self.participants()
        if self.manager.errored() is None and int(vote[0]) != participants:
            self.manager.report_error(RuntimeError(f"vote {int(vote[0])} of {participants} replicas"))
        if not self._decide(participants):
            return None
        contributing = int(vote[1])
        if contributing > 1:
            for tensor in tensors:
                tensor.div_(contributing)
        return contributing

    def _decide(self, participants: int, step: Callable[[], None] = lambda: None) -> bool:
        """torchft's ``should_commit``; on yes run ``step``; record either way (`FTRecord`); raise `FTError` after
        more than max_discards noes in a row with at least min_replicas participants."""
        started = time.perf_counter()
        ok = self.manager.should_commit()
        if ok:
            step()
            self.record.committed += 1
            self.record.participants.append(participants)
            self._discards_in_a_row = 0
        else:
            self.record.discarded.append({"step": self.step, "participants": participants, "at_s": started})
            if participants >= self.min_replicas:
                self._discards_in_a_row += 1
        if self.max_discards is not None and self._discards_in_a_row > self.max_discards:
            raise FTError(f"{self._discards_in_a_row} steps in a row discarded with {participants} replica groups "
                          f"in the quorum (--ft-max-discards {self.max_discards}): the collectives between the "
                          f"groups fail; can every group reach this one at --ft-host {self.host}?")
        return ok

    def commit(self) -> bool:
        """Step the optimizers if every rank of every participating replica voted yes (torchft's
        ``should_commit``, which also needs min_replicas participants); returns whether the step committed. A
        discarded step leaves parameters and optimizer state as they were. Gradients are dropped either way."""
        def step() -> None:
            for optimizer in self.optimizers:
                optimizer.step()

        try:
            return self._decide(self._participants, step)
        finally:
            for optimizer in self.optimizers:
                optimizer.zero_grad(set_to_none=True)

    def state_digest(self, optimizers: bool = True) -> str:
        """Hex SHA-256 of this rank's training state as a recovery sends it (every flat buffer's shard, each
        optimizer's state tensors, in order; ``optimizers`` False: the shards only, the parameters, which DiLoCo's
        outer step makes equal while each group keeps its own AdamW state): equal on the same group rank of two
        replica groups exactly when their states are bitwise equal. No collective."""
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
        add([state["shards"], state["optimizers"]] if optimizers else [state["shards"]])
        return digest.hexdigest()

    def shutdown(self) -> None:
        """Stop this rank's torchft manager (its server and quorum thread) without waiting for them. Local."""
        self.manager.shutdown(wait=False)
