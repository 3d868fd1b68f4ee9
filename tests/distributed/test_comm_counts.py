"""Invariants 1 and 4: how many collectives a step issues, on which group, and of what size.

Model: TinyTransformer wrapped with units=(Block,), i.e. 3 units: the root (tok, pos, norm, tied head) and two
blocks, every parameter trainable (one flat buffer per unit). Per micro-batch, with I = inner > 1:
* all-gathers on the inner group: each unit once in forward; with "after_forward" each block once more for its
  backward (the root is never resharded after forward): 2 per block + 1 for the root; with "after_backward" 1 each;
* reduce-scatters on the inner group: 1 per unit per backward that syncs (none while
  set_requires_gradient_sync(model, False));
and per optimizer step, however many micro-batches: 1 all-reduce per unit on the replicate group (dp x outer),
none when that group has one rank. Every record has nbytes == numel * 4 (fp32); an all-gather's numel is the unit's
padded flat buffer F (sum of its parameters' numel <= F, F % I == 0), a reduce-scatter's too, an all-reduce's F / I.
Every rank issues the same sequence of (op, numel). The totals are cross-checked with
torch.distributed.tensor.debug.CommDebugMode, which counts the c10d ops independently of shardfusion's counter; on
gloo the all-gathers within a node and the reduce-scatters over pairs of ranks run as sends and receives (comm.py,
[Note: gloo collectives as sends and receives]), which CommDebugMode does not count: a dispatch mode of this file counts
the c10d sends per group instead (G - 1 sends per all-gather over G ranks, one per reduce-scatter over a pair).
"""

from __future__ import annotations

from collections import Counter

import pytest

from harness import run_distributed

JOB_TIMEOUT_S = 240
STEPS = 2

# (name, inner, outer, reshard_policy, micro-batches, no_sync on the first K-1)
CONFIGS = [
    (f"I{i}O{o}-{policy}-K{k}{'-nosync' if ns else ''}", i, o, policy, k, ns)
    for i, o in ((2, 2), (4, 1))
    for policy in ("after_forward", "after_backward")
    for k, ns in ((1, False), (3, False), (3, True))
]

_AG_OPS = {"_allgather_base_", "allgather_", "allgather_into_tensor_coalesced_", "allgather_coalesced_"}
# On gloo shardfusion issues each reduce-scatter as an all-to-all plus a local sum (comm.reduce_scatter); the models
# counted here have no MoE, so every all-to-all is a reduce-scatter.
_RS_OPS = {"_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_", "alltoall_base_"}
_AR_OPS = {"allreduce_", "allreduce_coalesced_"}


def _debug_counts(mode) -> dict[str, int]:
    """CommDebugMode's counts folded into our op names (and 'other' for anything else)."""
    out = Counter()
    for op, n in mode.get_comm_counts().items():
        short = str(op).split(".")[-1]
        key = ("all_gather" if short in _AG_OPS else "reduce_scatter" if short in _RS_OPS
               else "all_reduce" if short in _AR_OPS else f"other:{short}")
        out[key] += n
    return dict(out)


def _send_counter(gather_group, reduce_group):
    """A dispatch mode counting the c10d sends on the inner gather group and the inner reduce group, read back as
    collectives (``.counts()``): an all-gather over G ranks of one node sends G - 1 pieces (one per peer), a
    reduce-scatter over a pair one (over larger groups it runs as an all-to-all, which CommDebugMode counts)."""
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    assert gather_group.group_name != reduce_group.group_name  # the sends are told apart by their group

    def unboxed(group):
        return dist.ProcessGroup.unbox(group) if hasattr(dist.ProcessGroup, "unbox") else group

    class SendCounter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sends = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.c10d.send.default:  # (tensors, process group, peer's group rank, tag)
                name = unboxed(args[1]).group_name
                kind = ("all_gather" if name == gather_group.group_name else
                        "reduce_scatter" if name == reduce_group.group_name else f"other_send:{name}")
                self.sends[kind] += 1
            return func(*args, **(kwargs or {}))

        def counts(self) -> dict[str, int]:
            peers = dist.get_world_size(gather_group) - 1  # pieces one all-gather sends
            return {k: n // peers if k == "all_gather" else n for k, n in self.sends.items()}

    return SendCounter()


def _merged(*counts: dict) -> dict:
    out = Counter()
    for c in counts:
        out.update(c)
    return {k: n for k, n in out.items() if n}


class _NoModuleTracking:
    """Stands in for CommDebugMode's module tracker, which we do not need (we only read the total counts).

    The tracker registers forward hooks keyed by module name and loses handles when a module runs more than once in
    one `with` block; the leaked hooks then pop its parent list past empty (IndexError) in a later forward. Without
    it, CommDebugMode is just a TorchDispatchMode that counts c10d collective ops.
    """

    name = "Global"
    is_bw = False
    activation_checkpointing = False
    module_parents_dict = {"Global": set()}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _comm_debug_mode():
    from torch.distributed.tensor.debug import CommDebugMode

    mode = CommDebugMode()
    mode.advanced_module_tracker = _NoModuleTracking()
    return mode


class _CountingStore:
    """The default group's store, counting the calls made to it through ``_get_default_store`` (where shardfusion's
    arrival checks reach it)."""

    def __init__(self, store) -> None:
        self.store, self.ops = store, 0

    def __getattr__(self, name: str):
        attr = getattr(self.store, name)
        if not callable(attr):
            return attr

        def counted(*args, **kwargs):
            self.ops += 1
            return attr(*args, **kwargs)

        return counted


def count_job(configs: list) -> dict:
    """Worker: for each config, wrap a fresh model and record every collective of STEPS optimizer steps, and the
    store operations of each step."""
    import torch
    import torch.distributed as dist
    import shardfusion as sf
    from models import build_model, loss_fn, make_batch, Block

    store = _CountingStore(dist.distributed_c10d._get_default_store())
    dist.distributed_c10d._get_default_store = lambda: store
    results = {}
    topos = {}
    for name, inner, outer, policy, K, no_sync in configs:
        key = (inner, outer)
        if key not in topos:
            topos[key] = sf.Topology(sharding=inner * outer, fsdp_outer_degree=outer)
        topo = topos[key]
        model = sf.fully_shard(build_model("transformer"), topo, units=(Block,), reshard_policy=policy)
        shapes = {n: p.numel() for n, p in build_model("transformer").named_parameters()}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(43 + topo.data_parallel_rank)
        steps = []
        for _ in range(STEPS):
            micro = []
            handed_off = model._sf_state.handed_off_syncs
            mode_checks, store_ops = topo.forward_mode_checks, store.ops
            sends = _send_counter(topo.get_fsdp_inner_group(), topo.get_fsdp_inner_reduce_group())
            with sf.comm.CommCounter() as step_cc, _comm_debug_mode() as mode, sends:
                for m in range(K):
                    if no_sync:
                        sf.set_requires_gradient_sync(model, m == K - 1)
                    batch = make_batch("transformer", gen)
                    with sf.comm.CommCounter() as fwd:
                        loss = loss_fn("transformer", model, batch)
                    with sf.comm.CommCounter() as bwd:
                        (loss / K).backward()
                    micro.append({"fwd": fwd.records, "bwd": bwd.records})
                with sf.comm.CommCounter() as opt_cc:
                    opt.step()
                opt.zero_grad()
            steps.append({"records": step_cc.records, "micro": micro, "opt": opt_cc.records,
                          "debug": _merged(_debug_counts(mode), sends.counts()),
                          "handed_off": model._sf_state.handed_off_syncs - handed_off,
                          "mode_checks": topo.forward_mode_checks - mode_checks,
                          "store_ops": store.ops - store_ops,
                          "unsharded": [u.name for u in sf.get_units(model) if u.is_unsharded]})
        results[name] = {
            "rank": dist.get_rank(),
            "inner_ranks": tuple(dist.get_process_group_ranks(topo.get_fsdp_inner_group())),
            "replicate_ranks": tuple(dist.get_process_group_ranks(topo.get_replicate_group())),
            "units": [(u.name, sum(shapes[n] for n in u.param_names)) for u in sf.get_units(model)],
            "steps": steps,
        }
    return results


@pytest.fixture(scope="module")
def counts():
    return run_distributed(count_job, 4, CONFIGS, timeout=JOB_TIMEOUT_S)


def _size_class(numel: int, unit_sizes: set[int], inner: int) -> int:
    """The parameter count of the unit(s) whose padded flat buffer can have `numel` elements.

    Units are told apart by size (the two blocks are the same size, and are counted together): a buffer of F elements
    belongs to units of n parameters with n <= F <= n + _SLACK + inner (alignment and padding slack).
    """
    hits = [n for n in unit_sizes if n <= numel <= n + _SLACK + inner]
    assert len(hits) == 1, f"buffer of {numel} elements matches unit sizes {hits} of {sorted(unit_sizes)}"
    return hits[0]


_SLACK = 64  # alignment padding of up to 8 parameters x 8 elements


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c[0])
def test_counts_per_step(counts, config):
    name, inner, outer, policy, K, no_sync = config
    per_rank = [c[name] for c in counts]
    units = per_rank[0]["units"]
    assert len(units) == 3 and units[0][0] == "", f"expected the root and 2 blocks, got {units}"
    root_n = units[0][1]
    mult = Counter(n for _, n in units)  # units per size class: {root: 1, block: 2}
    sizes_sorted = sorted(mult)
    assert all(a + _SLACK + inner < b for a, b in zip(sizes_sorted, sizes_sorted[1:])), units

    def cls(x) -> int:
        return _size_class(x.numel * (inner if x.op == "all_reduce" else 1), set(mult), inner)

    for r in per_rank:
        rank = r["rank"]
        for step, s in enumerate(r["steps"]):
            where = f"{name}, rank {rank}, step {step}"
            recs = s["records"]
            assert {x.op for x in recs} <= {"all_gather", "reduce_scatter", "all_reduce"}, (
                f"{where}: unexpected ops {Counter(x.op for x in recs)}")
            for x in recs:
                assert x.nbytes == x.numel * 4, f"{where}: {x}"
                want = r["replicate_ranks"] if x.op == "all_reduce" else r["inner_ranks"]
                assert x.group_ranks == want, f"{where}: {x.op} on {x.group_ranks}, expected group {want}"
                if x.op != "all_reduce":
                    assert x.numel % inner == 0, f"{where}: {x} not a multiple of inner {inner}"

            # per unit per step (blocks counted together: they have the same size)
            ag = Counter(cls(x) for x in recs if x.op == "all_gather")
            rs = Counter(cls(x) for x in recs if x.op == "reduce_scatter")
            ar = Counter(cls(x) for x in recs if x.op == "all_reduce")
            n_ag = {n: m * K * (1 if n == root_n or policy == "after_backward" else 2) for n, m in mult.items()}
            n_rs = {n: m * (1 if no_sync else K) for n, m in mult.items()}
            # Gradients are final when the step's last backward returns; in the first step nothing predicts which one
            # that is, so each reducing backward ends with the all-reduce (K of them unless no_sync); then one per step.
            k_ar = K if step == 0 and not no_sync else 1
            n_ar = {n: m * k_ar for n, m in mult.items()} if outer > 1 else {}
            legend = f"(units by parameter count: {dict(mult)}, root {root_n})"
            assert dict(ag) == n_ag, f"{where}: all-gathers {dict(ag)}, expected {n_ag} {legend}"
            assert dict(rs) == n_rs, f"{where}: reduce-scatters {dict(rs)}, expected {n_rs} {legend}"
            assert dict(ar) == n_ar, (
                f"{where}: all-reduces {dict(ar)}, expected {n_ar}: exactly one per unit per step {legend}")

            # one buffer size per unit size class: all-gathers, reduce-scatters and I x all-reduces agree
            full_sizes: dict[int, set] = {}
            for x in recs:
                full_sizes.setdefault(cls(x), set()).add(x.numel * (inner if x.op == "all_reduce" else 1))
            assert all(len(v) == 1 for v in full_sizes.values()), f"{where}: buffer sizes {full_sizes}"

            # per micro-batch: every unit gathered once in forward; no reduction while sync is off
            for m, mc in enumerate(s["micro"]):
                fwd_ag = Counter(cls(x) for x in mc["fwd"] if x.op == "all_gather")
                assert dict(fwd_ag) == dict(mult), f"{where}, micro {m}: forward all-gathers {dict(fwd_ag)} {legend}"
                assert not [x for x in mc["fwd"] if x.op != "all_gather"], f"{where}, micro {m}: reduction in forward"
                if no_sync and m < K - 1:
                    reductions = [x for x in mc["bwd"] if x.op != "all_gather"]
                    assert not reductions, f"{where}, micro {m} (sync off): {reductions}"

            # no full buffer is alive after the optimizer step
            assert s["unsharded"] == [], f"{where}: units still unsharded after the step: {s['unsharded']}"

            # cross-check with CommDebugMode (independent of shardfusion's counter). It is a dispatch mode, which is
            # thread-local: the all-reduces overlapped with backward run on the replicate-sync worker thread (CPU)
            # and only shardfusion's counter sees them
            # The forward-mode agreement (Topology.check_forward_mode: an arrival check through the store, no
            # collective) runs at the first forward only: every forward here trains. An ordinary step touches no
            # store and issues no collective beyond the step's own (those CommDebugMode counts)
            assert s["mode_checks"] == (1 if step == 0 else 0), f"{where}: {s['mode_checks']} forward-mode checks"
            assert (s["store_ops"] > 0) == (step == 0), f"{where}: {s['store_ops']} store operations"
            ours = Counter(x.op for x in recs)
            ours["all_reduce"] -= s["handed_off"]
            ours = {op: n for op, n in ours.items() if n}
            assert s["debug"] == ours, f"{where}: CommDebugMode counts {s['debug']} != CommCounter {ours}"

    # invariant 1: every rank issues the same sequence of (op, numel) on each group (groups are independent; the
    # overlapped all-reduces are issued from another thread, so the records of different groups interleave by timing)
    def per_group(records):
        out = {}
        for x in records:
            out.setdefault(x.label, []).append((x.op, x.numel))
        return out

    seqs = {r["rank"]: [per_group(s["records"]) for s in r["steps"]] for r in per_rank}
    for rank, seq in seqs.items():
        assert seq == seqs[0], f"{name}: rank {rank}'s collective sequence differs from rank 0's"


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_outer_all_reduce_only_at_step(counts):
    """The all-reduces are issued overlapped with the last backward (or inside optimizer.step()), never before the
    last micro-batch, from the second step on. In the first step, with gradient sync on in every micro-batch,
    each backward ends with them (nothing predicts the last one yet; see docs/pytorch-habits.md)."""
    for name, inner, outer, policy, K, no_sync in CONFIGS:
        if outer == 1:
            continue
        for r in (c[name] for c in counts):
            for step, s in enumerate(r["steps"]):
                if step == 0 and not no_sync:
                    continue
                for m, mc in enumerate(s["micro"][:-1]):
                    early = [x for x in mc["fwd"] + mc["bwd"] if x.op == "all_reduce"]
                    assert not early, f"{name}, rank {r['rank']}, step {step}: all-reduce in micro-batch {m}: {early}"


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_records_categories_and_wire_bytes(counts):
    """The accounting fields of the same records (see [Note: communication accounting] in accounting.py): every
    all-gather and reduce-scatter is in its inner category, every all-reduce (no clipping here) in the replicate
    one, and the bytes on the wire follow the ring formulas: (G-1)/G x bytes, 2(G-1)/G x bytes for an all-reduce."""
    want = {"all_gather": "inner_all_gather", "reduce_scatter": "inner_reduce_scatter",
            "all_reduce": "replicate_all_reduce"}
    for name, *_ in CONFIGS:
        for r in (c[name] for c in counts):
            for step, s in enumerate(r["steps"]):
                for x in s["records"]:
                    where = f"{name}, rank {r['rank']}, step {step}: {x}"
                    assert x.category == want[x.op] and x.rank == r["rank"], where
                    g = len(x.group_ranks)
                    assert x.wire_bytes == (2 if x.op == "all_reduce" else 1) * (g - 1) * x.nbytes / g, where
                    assert x.wait_s > 0, where
