"""The single-process reference trainer, its sharded twin, and the helpers that compare the two.

A `Case` describes one training configuration. Two loops run it, written side by side so they cannot drift:

* `reference_train(case)`: one process, the model built under seed 42, and at every micro-batch the *global*
  batch = the concatenation, in data-parallel rank order, of what every data-parallel rank draws; loss = mean over
  that global batch; `(loss / K).backward()` for K micro-batches; the same optimizer (and clipping) as the sharded run.
  MoE models (with all experts in the one process) run once per data-parallel rank's micro-batch instead and average
  those losses, since their load-balancing loss is defined over the tokens of one rank.
* `sharded_train(case)`: runs inside a `harness.run_distributed` worker. Data-parallel rank r (ranks with equal
  `topo.data_parallel_rank` see the same samples) draws from a generator seeded `DATA_SEED + r + 1`; each rank's
  loss is the mean over its own micro-batch; the library makes the gradient that of the global mean. The global loss
  is reported through an all-reduce (mean over the world; every data-parallel rank appears `mp` times).

Both return plain dicts (per-step losses, gradients, norms, parameters) that the tests compare in the parent with
`assert_close_dicts` (fp32: rtol 1e-5, atol 1e-6, as in docs/field-cases.md). A sharded run reports *fragments* (the
local pieces, whole rows, that `model.named_parameters()` yields); `assemble` turns the fragments of one inner group
back into full tensors, and `assert_replicas_identical` checks that ranks holding the same shard hold bitwise the
same values.

`CaseJobs` runs a grid of cases as one spawned job per world size (start-up is paid once per job, docs/design.md
"Conventions"); the small helpers at the end (`rank_randn`, `global_randn`, `sgd_step`) serve the hand-written
scenarios that do not fit a `Case`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import traceback
from dataclasses import dataclass
from typing import Any, Optional

import torch

from harness import run_distributed
from models import MODEL_SEED, UNIT_CLASSES, build_model, concat_batches, expert_unit_classes, loss_fn, make_batch

DATA_SEED = 42
RTOL, ATOL = 1e-5, 1e-6


@dataclass(frozen=True)
class Case:
    """One training configuration (picklable: it crosses into the workers)."""

    name: str
    model: str = "transformer"
    world: int = 4
    sharding: int = -1
    outer: int = 1  # fsdp_outer_degree
    dp: int = 1
    mp: int = 1
    units: str = "class"  # "class": UNIT_CLASSES[model]; "experts": MoE blocks and each expert its own unit;
    # "size": comm_unit_size; "none": everything in the root
    comm_unit_size: Optional[int] = None
    reshard_policy: str = "after_forward"
    micro: int = 1  # micro-batches per step (K)
    no_sync: bool = False  # set_requires_gradient_sync(False) for the first K-1 micro-batches
    steps: int = 5
    batch: int = 4  # samples per data-parallel rank per micro-batch
    optim: str = "adamw"  # "adamw" | "adamw_groups" (weight decay by name: the training job's no_decay) | "sgd"
    lr: float = 1e-2
    clip: Optional[tuple] = None  # (max_norm, norm_type)
    replicate: tuple = ()  # names kept whole through replicate_filter
    seed_by_rank: bool = False  # F7: each rank builds its model with seed = its rank; the reference uses seed 0
    record_grads: bool = False  # call finish_grad_sync and report fragment gradients (and clipped ones)
    record_wrap: bool = False  # report full_state_dict right after wrapping
    check_resharded: bool = False  # report get_units(...).is_unsharded after every step
    merge_micro: int = 1  # draw this many micro-batches and train on their concatenation as one (F6's K=1 twin)
    count_comm: bool = False  # report the shardfusion collectives of every step (sf.comm.CommCounter)
    ep: int = 1  # expert parallel degree (MoE models)
    expert_policy: str = "replicate"  # fully_shard's expert_policy
    measure_norms: tuple = ()  # norm types measured (max_norm=inf) before clipping, every step
    param_dtype: Optional[str] = None  # mixed precision: "bfloat16" / "float16" (the reference always runs fp32)
    grad_comm_dtype: Optional[str] = None  # a torch dtype's name, or "int8" (the quantized reduce-scatter)
    outer_comm_dtype: Optional[str] = None  # fully_shard's outer_comm_dtype: "bf16" / "fp16" / "int8"
    all_gather_dtype: Optional[str] = None  # MixedPrecisionPolicy.all_gather_dtype: "int8" or a torch dtype's name
    secondary_shard: bool = False  # fully_shard's secondary_shard (hpZ)
    ranks_per_node: Optional[int] = None  # Topology's ranks_per_node (None: LOCAL_WORLD_SIZE, else one node)

    @property
    def data_parallel(self) -> int:
        """Ranks with distinct data: dp * sharding."""
        return self.world // self.mp

    @property
    def inner(self) -> int:
        sharding = self.world // (self.dp * self.mp) if self.sharding == -1 else self.sharding
        return sharding // self.outer

    def with_(self, **kw) -> "Case":
        return dataclasses.replace(self, **kw)


# --- pieces shared by both loops ----------------------------------------------------------------------------------


def make_optimizer(case: Case, named_params) -> torch.optim.Optimizer:
    """The optimizer of `case` over `named_params` ((name, parameter) pairs, fragments in a sharded run).

    "adamw_groups" splits the parameters by name with the training job's rule (`shardfusion.train.optim.no_decay`:
    biases, norms and embeddings are exempt), so the tests and the job use one rule."""
    from shardfusion.train.optim import no_decay

    named = list(named_params)
    if case.optim == "sgd":
        return torch.optim.SGD([p for _, p in named], lr=case.lr)
    if case.optim == "adamw":
        return torch.optim.AdamW([p for _, p in named], lr=case.lr, weight_decay=0.1)
    if case.optim == "adamw_groups":
        decay = [p for n, p in named if not no_decay(n)]
        nodecay = [p for n, p in named if no_decay(n)]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                  {"params": nodecay, "weight_decay": 0.0}], lr=case.lr)
    raise ValueError(f"unknown optimizer {case.optim!r}")


def forward_kwargs(case: Case, step: int) -> dict:
    """F4: layer b of the skip models runs only on odd steps."""
    if case.model.startswith("skip"):
        return {"use_b": step % 2 == 1}
    return {}


def draw_batch(case: Case, generator: torch.Generator) -> dict:
    """One micro-batch of one data-parallel rank (`merge_micro` consecutive draws concatenated)."""
    draws = [make_batch(case.model, generator, case.batch) for _ in range(case.merge_micro)]
    return draws[0] if len(draws) == 1 else concat_batches(draws)


def _snapshot(tensors: dict[str, Optional[torch.Tensor]]) -> dict[str, Optional[torch.Tensor]]:
    return {n: None if t is None else t.detach().clone() for n, t in tensors.items()}


# --- the reference ------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def reference_train(case: Case) -> dict:
    """Train `case` in one process on the global batch. Returns losses, grads, clipped grads, norms, params.

    Cached per case (a frozen Case hashes by value): treat the result as read-only.
    """
    model = build_model(case.model, seed=0 if case.seed_by_rank else MODEL_SEED)
    out: dict[str, Any] = {"init": _snapshot(dict(model.named_parameters())), "losses": [], "grads": [],
                           "clipped": [], "norms": [], "params": [], "shapes": {}, "measured": []}
    out["shapes"] = {n: tuple(p.shape) for n, p in model.named_parameters()}
    opt = make_optimizer(case, model.named_parameters())
    gens = [torch.Generator().manual_seed(DATA_SEED + r + 1) for r in range(case.data_parallel)]
    K = case.micro
    for step in range(case.steps):
        losses = []
        for _ in range(K):
            draws = [draw_batch(case, g) for g in gens]
            if case.model == "moe":
                loss = torch.stack([loss_fn(case.model, model, d) for d in draws]).mean()
            else:
                loss = loss_fn(case.model, model, concat_batches(draws), **forward_kwargs(case, step))
            (loss / K).backward()
            losses.append(loss.detach())
        out["losses"].append(torch.stack(losses).mean().item())
        out["grads"].append(_snapshot({n: p.grad for n, p in model.named_parameters()}))
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        out["measured"].append([torch.nn.utils.get_total_norm(grads, t).item() for t in case.measure_norms])
        if case.clip is not None:
            max_norm, norm_type = case.clip
            params = [p for p in model.parameters() if p.grad is not None]
            out["norms"].append(torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type).item())
            out["clipped"].append(_snapshot({n: p.grad for n, p in model.named_parameters()}))
        opt.step()
        opt.zero_grad()
        out["params"].append(_snapshot(dict(model.named_parameters())))
    out["final"] = _snapshot(model.state_dict())
    return out


# --- the sharded twin (runs in a worker) --------------------------------------------------------------------------

_TOPOLOGIES: dict[tuple, Any] = {}


def get_topology(case: Case):
    """One Topology per layout per worker (group creation is collective and not free)."""
    import shardfusion as sf

    key = (case.dp, case.sharding, case.mp, case.outer, case.ep, case.ranks_per_node)
    if key not in _TOPOLOGIES:
        _TOPOLOGIES[key] = sf.Topology(dp=case.dp, sharding=case.sharding, mp=case.mp, fsdp_outer_degree=case.outer,
                                       ep=case.ep, ranks_per_node=case.ranks_per_node)
    return _TOPOLOGIES[key]


def coordinates(topo) -> dict:
    import torch.distributed as dist

    return {"rank": topo.rank, "inner_rank": topo.inner_rank, "outer_rank": topo.outer_rank,
            "mp_rank": topo.mp_rank, "data_parallel_rank": topo.data_parallel_rank,
            "inner_ranks": tuple(dist.get_process_group_ranks(topo.get_fsdp_inner_group())),
            "replicate_ranks": tuple(dist.get_process_group_ranks(topo.get_replicate_group())),
            "debug_level": str(dist.get_debug_level())}


def wrap_kwargs(case: Case) -> dict:
    kw: dict[str, Any] = {"reshard_policy": case.reshard_policy, "expert_policy": case.expert_policy}
    dtypes = {key: getattr(torch, getattr(case, key)) for key in ("param_dtype", "grad_comm_dtype")
              if getattr(case, key) not in (None, "int8")}
    if case.grad_comm_dtype == "int8":  # the quantized reduce-scatter: a wire format, not a torch dtype
        dtypes["grad_comm_dtype"] = "int8"
    if case.all_gather_dtype is not None:
        dtypes["all_gather_dtype"] = (case.all_gather_dtype if case.all_gather_dtype == "int8"
                                      else getattr(torch, case.all_gather_dtype))
    if dtypes:
        import shardfusion as sf

        kw["mp_policy"] = sf.MixedPrecisionPolicy(**dtypes)
    if case.outer_comm_dtype is not None:
        kw["outer_comm_dtype"] = case.outer_comm_dtype
    if case.secondary_shard:
        kw["secondary_shard"] = True
    if case.units == "class":
        kw["units"] = UNIT_CLASSES[case.model]
    elif case.units == "experts":
        kw["units"] = expert_unit_classes()
    elif case.units == "size":
        kw["comm_unit_size"] = case.comm_unit_size
    if case.replicate:
        names = set(case.replicate)
        kw["replicate_filter"] = lambda name, param: name in names
    return kw


def sharded_train(case: Case) -> dict:
    """Train `case` with shardfusion on this rank. Returns fragments (params, grads), losses, norms, full state."""
    import torch.distributed as dist
    import shardfusion as sf

    topo = get_topology(case)
    model = build_model(case.model, seed=dist.get_rank() if case.seed_by_rank else MODEL_SEED,
                        ep_group=topo.get_group("ep"))
    sf.fully_shard(model, topo, **wrap_kwargs(case))
    out: dict[str, Any] = {"coords": coordinates(topo), "losses": [], "grads": [], "clipped": [], "norms": [],
                           "params": [], "unsharded_after_step": [], "measured": [], "placement": placement(model)}
    out["names"] = [n for n, _ in model.named_parameters()]
    out["units"] = [(u.name, list(u.param_names)) for u in sf.get_units(model)]
    if case.record_wrap:
        out["full_at_wrap"] = _snapshot(sf.full_state_dict(model))
    out["fragments_at_wrap"] = _snapshot(dict(model.named_parameters()))
    opt = make_optimizer(case, model.named_parameters())
    gen = torch.Generator().manual_seed(DATA_SEED + topo.data_parallel_rank + 1)
    K = case.micro
    for step in range(case.steps):
        with sf.comm.CommCounter() as counter:  # every shardfusion collective of this step
            losses = []
            for m in range(K):
                if case.no_sync:
                    sf.set_requires_gradient_sync(model, m == K - 1)
                batch = draw_batch(case, gen)
                loss = loss_fn(case.model, model, batch, **forward_kwargs(case, step))
                (loss / K).backward()
                losses.append(loss.detach())
            mean_loss = torch.stack(losses).mean()
            dist.all_reduce(mean_loss)  # not a shardfusion collective: only reports the global loss
            out["losses"].append(mean_loss.item() / dist.get_world_size())
            if case.record_grads:
                sf.finish_grad_sync(model)
                out["grads"].append(_snapshot({n: p.grad for n, p in model.named_parameters()}))
            out["measured"].append([sf.clip_grad_norm_(model, math.inf, norm_type=t).item()
                                    for t in case.measure_norms])
            if case.clip is not None:
                max_norm, norm_type = case.clip
                norm = sf.clip_grad_norm_(model, max_norm, norm_type=norm_type)
                out["norms"].append(norm.item())
                if case.record_grads:
                    out["clipped"].append(_snapshot({n: p.grad for n, p in model.named_parameters()}))
            opt.step()
            opt.zero_grad()
        if case.count_comm:
            out.setdefault("comm", []).append(counter.records)
        out["params"].append(_snapshot(dict(model.named_parameters())))
        if case.check_resharded:
            out["unsharded_after_step"].append([u.name for u in sf.get_units(model) if u.is_unsharded])
    out["full"] = _snapshot(sf.full_state_dict(model))
    return out


def placement(model) -> dict[str, tuple]:
    """{parameter name: (ranks of the group it is sharded over, this rank's shard index)}; a whole parameter has
    the group of this rank alone and index 0."""
    import torch.distributed as dist
    import shardfusion as sf

    out = {}
    for unit in sf.get_units(model):
        for g in unit.groups:
            ranks = (dist.get_rank(),) if g.shard_group is None else tuple(dist.get_process_group_ranks(g.shard_group))
            index = 0 if g.shard_group is None else dist.get_rank(g.shard_group)
            for slot in g.layout.slots:
                out[slot.name] = (ranks, index)
    return out


def run_cases(cases: list[Case], fn_name: str = "sharded_train") -> dict[str, Any]:
    """Worker body for a grid: run every case in order; {case name: result, or {"error": traceback}}.

    A case that raises on every rank (e.g. at wrap time) is recorded and the next case runs; if only some ranks
    raise, the others stop in a collective and the harness timeout reports the job.
    """
    fn = globals()[fn_name] if isinstance(fn_name, str) else fn_name
    results = {}
    for case in cases:
        try:
            results[case.name] = fn(case)
        except Exception:  # noqa: BLE001 - reported per case to the parent
            results[case.name] = {"error": traceback.format_exc()}
    return results


class CaseJobs:
    """Each world size's cases as one spawned job, run lazily (at the first test that needs it) and once.

        jobs = CaseJobs({2: w2_cases, 4: w4_cases}, env={2: DETAIL, 4: DETAIL})   # in a module-scoped fixture
        jobs.results(case)    # per-rank results of `case` (fails with the rank's traceback if the case raised)
        jobs.get(4)           # the per-rank dicts of the W=4 job: {case name: result, ...} plus what `worker` adds

    `worker(cases)` is the body of every rank (a top-level function: it is pickled by name); it returns
    {case name: result} and may add entries of its own under names no case has. A job that failed fails every test
    that needs it, without running again.
    """

    def __init__(self, cases: dict[int, list[Case]], env: Optional[dict[int, dict]] = None, worker=None,
                 timeout: float = 300) -> None:
        self.cases, self.env, self.worker, self.timeout = cases, env or {}, worker or run_cases, timeout
        self._done: dict[int, Any] = {}

    def get(self, world: int) -> list[dict]:
        if world not in self._done:
            try:
                self._done[world] = run_distributed(self.worker, world, self.cases[world], timeout=self.timeout,
                                                    env=self.env.get(world))
            except Exception as e:  # noqa: BLE001 - kept, and raised again for every test that needs this job
                self._done[world] = e
        if isinstance(self._done[world], Exception):
            raise self._done[world]
        return self._done[world]

    def results(self, case: Case) -> list[dict]:
        return case_results(self.get(case.world), case.name)

    def case(self, name: str) -> Case:
        """The case called `name`, whatever its world size."""
        return next(c for cases in self.cases.values() for c in cases if c.name == name)

    def names(self, prefix: str) -> list[str]:
        """Names of the cases that start with `prefix`, in the order given."""
        return [c.name for cases in self.cases.values() for c in cases if c.name.startswith(prefix)]

    def assert_under_detail(self, world: int) -> None:
        """Every rank of the W=`world` job ran under TORCH_DISTRIBUTED_DEBUG=DETAIL (else invariant 1 of
        docs/design.md is not checked by c10d)."""
        for r in self.results(self.cases[world][0]):
            assert r["coords"]["debug_level"] == "DebugLevel.DETAIL", r["coords"]


# --- comparing --------------------------------------------------------------------------------------------------


def case_results(per_rank: list[dict], name: str) -> list[dict]:
    """The per-rank results of case `name`; fails with the first rank's traceback if the case raised."""
    rs = [r[name] for r in per_rank]
    for rank, r in enumerate(rs):
        if "error" in r:
            raise AssertionError(f"case {name!r} raised on rank {rank}:\n{r['error']}")
    return rs


def assemble(fragments: list[Optional[torch.Tensor]], shape: tuple, name: str = "?") -> Optional[torch.Tensor]:
    """Full tensor of `shape` from one inner group's fragments (in inner-rank order).

    A parameter kept whole has its full numel on every rank: then the first copy is the tensor.
    """
    if all(f is None for f in fragments):
        return None
    numel = math.prod(shape)
    frags = [torch.zeros(0) if f is None else f.reshape(-1) for f in fragments]
    sizes = [f.numel() for f in frags]
    if sum(sizes) == numel:
        return torch.cat(frags).reshape(shape)
    if all(s == numel for s in sizes):
        return frags[0].reshape(shape)
    raise AssertionError(f"{name}: fragments of sizes {sizes} do not tile a tensor of shape {shape} "
                         f"(numel {numel}) and are not whole copies")


def holders(rs: list[dict], name: str) -> list[dict]:
    """The ranks whose shards of `name` tile it: the shard group of the lowest rank holding `name` (expert parameters
    exist only on the ranks of their ep index), in shard-index order."""
    owner = min((r for r in rs if name in r["placement"]), key=lambda r: r["coords"]["rank"])
    ranks, _ = owner["placement"][name]
    by_rank = {r["coords"]["rank"]: r for r in rs}
    return sorted((by_rank[q] for q in ranks), key=lambda r: r["placement"][name][1])


def assemble_all(rs: list[dict], key: str, step: int, shapes: dict[str, tuple]) -> dict[str, Optional[torch.Tensor]]:
    out = {}
    for name, shape in shapes.items():
        frags = [r[key][step].get(name) for r in holders(rs, name)]
        out[name] = assemble(frags, shape, name)
    return out


def assert_close_dicts(actual: dict, expected: dict, what: str, rtol: float = RTOL, atol: float = ATOL,
                       names=None, none_is_zero: bool = False) -> None:
    """Every tensor of `expected` (or of `names`) is close to the one in `actual`; None must match None.

    A zero-element expected tensor also matches None (an empty fragment need not carry a gradient). With
    `none_is_zero`, an expected None (no gradient this step) also matches an all-zero actual gradient.
    """
    names = list(expected) if names is None else names
    for n in names:
        a, e = actual.get(n, "missing"), expected[n]
        if isinstance(a, str):
            raise AssertionError(f"{what}: {n} missing from the sharded result (has {sorted(actual)})")
        if a is None and e is not None and e.numel() == 0:
            continue
        if e is None and a is not None and none_is_zero:
            assert not a.any(), f"{what}: {n}: reference has no gradient, sharded run has a non-zero one"
            continue
        if e is None or a is None:
            assert a is None and e is None, f"{what}: {n}: sharded {'None' if a is None else 'a tensor'}, " \
                                            f"reference {'None' if e is None else 'a tensor'}"
            continue
        assert tuple(a.shape) == tuple(e.shape), f"{what}: {n}: shape {tuple(a.shape)} != {tuple(e.shape)}"
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {n}: {m}")


def train_adamw(model: torch.nn.Module, loss_fn, steps: int, lr: float, max_norm: float) -> dict:
    """``steps`` AdamW steps (weight decay 0.1) with clipping by global norm (shardfusion's on a sharded model,
    torch's otherwise): per step ``loss_fn(step)`` (runs forward and backward, returns the loss to record) and the
    norm before clipping. Returns ``{"losses", "norms"}``, lists of floats."""
    import shardfusion as sf
    from shardfusion._runtime.state import is_sharded

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    losses, norms = [], []
    for step in range(steps):
        losses.append(float(loss_fn(step)))
        clip = sf.clip_grad_norm_ if is_sharded(model) else torch.nn.utils.clip_grad_norm_
        norms.append(float(clip(model if is_sharded(model) else model.parameters(), max_norm)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"losses": losses, "norms": norms}


def assert_run_matches(got: dict, want: dict, what: str, param_atol: float) -> None:
    """A run's per-step ``losses`` and ``norms`` (lists of floats; rtol RTOL, atol ATOL) and its final ``params``
    (``{name: full tensor}``, the same names; rtol RTOL, atol ``param_atol``) against the reference's."""
    for key in ("losses", "norms"):
        torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(want[key]), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{what}: {key}: {m}")
    assert sorted(got["params"]) == sorted(want["params"]), what
    assert_close_dicts(got["params"], want["params"], what, atol=param_atol)


def assert_losses_match(rs: list[dict], ref: dict, case_name: str) -> None:
    for r in rs:
        torch.testing.assert_close(torch.tensor(r["losses"], dtype=torch.float64),
                                   torch.tensor(ref["losses"], dtype=torch.float64), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{case_name}: losses per step, rank {r['coords']['rank']}: {m}")


def assert_replicas_identical(rs: list[dict], key: str = "params", case_name: str = "") -> None:
    """Invariant 3: ranks holding the same fragment (same parameter, same shard index, same mp rank) hold bitwise
    equal values after every step."""
    by_fragment: dict[tuple, list[dict]] = {}
    for r in rs:
        for name, (_, index) in r["placement"].items():
            by_fragment.setdefault((name, index, r["coords"]["mp_rank"]), []).append(r)
    for (n, index, mp_rank), members in by_fragment.items():
        first = members[0]
        for other in members[1:]:
            for step, (fa, fb) in enumerate(zip(first[key], other[key])):
                a, b = fa.get(n), fb.get(n)
                if a is None and b is None:
                    continue
                assert a is not None and b is not None and torch.equal(a, b), (
                    f"{case_name}: {key} of {n} after step {step} differ between replicas rank "
                    f"{first['coords']['rank']} and rank {other['coords']['rank']} (shard {index}, mp {mp_rank})")


def assert_full_state_matches(rs: list[dict], ref: dict, case_name: str) -> None:
    """full_state_dict on every rank: original shapes, equal to the reference's final parameters."""
    for r in rs:
        full = r["full"]
        for n, shape in ref["shapes"].items():
            assert n in full, f"{case_name}: rank {r['coords']['rank']}: {n} missing from full_state_dict"
        common = [n for n in full if n in ref["final"]]
        assert_close_dicts(full, ref["final"], f"{case_name}: full_state_dict on rank {r['coords']['rank']}",
                           names=common)


def assert_measured_norms_match(rs: list[dict], ref: dict, case_name: str) -> None:
    """The norms of `Case.measure_norms`: the same bits on every rank, equal to the reference's full-gradient norm."""
    _assert_norms(rs, ref, "measured", f"{case_name}: measured norms differ:",
                  f"{case_name}: measured norms vs reference")


def _assert_norms(rs: list[dict], ref: dict, key: str, differ: str, versus: str) -> None:
    """`key` (a list of norms per rank): bitwise the same on every rank and equal to the reference's (rtol)."""
    for r in rs:
        assert r[key] == rs[0][key], f"{differ} rank 0 {rs[0][key]} vs rank {r['coords']['rank']} {r[key]}"
    torch.testing.assert_close(torch.tensor(rs[0][key], dtype=torch.float64),
                               torch.tensor(ref[key], dtype=torch.float64), rtol=RTOL, atol=0,
                               msg=lambda m: f"{versus}: {m}")


def check_parity(rs: list[dict], ref: dict, case_name: str, steps_params: bool = True) -> None:
    """Losses every step, parameters (assembled from fragments) after every step, full_state_dict, replicas, and the
    norms measured before clipping (if any)."""
    assert_losses_match(rs, ref, case_name)
    assert_measured_norms_match(rs, ref, case_name)
    if steps_params:
        for step in range(len(ref["params"])):
            got = assemble_all(rs, "params", step, ref["shapes"])
            assert_close_dicts(got, ref["params"][step], f"{case_name}: params after step {step}")
    assert_full_state_matches(rs, ref, case_name)
    assert_replicas_identical(rs, "params", case_name)


def check_clipped_run(rs: list[dict], case: Case, ref: Optional[dict] = None, small: float = 0.05) -> dict:
    """A run that clips every step: the returned norm equals the reference's (rtol 1e-5) and is bitwise the same on
    every rank; gradients before and after clipping (if recorded) and the parameters equal the reference.
    With max_norm <= `small` clipping must have acted on the reference (else the test proves less)."""
    ref = reference_train(case) if ref is None else ref
    max_norm, norm_type = case.clip
    _assert_norms(rs, ref, "norms", f"{case.name}: norms differ across ranks:",
                  f"{case.name}: returned norm vs reference")
    if max_norm <= small:
        assert min(ref["norms"]) > 2 * max_norm, f"{case.name}: clipping did not act: {ref['norms']}"
    if case.record_grads:
        for step in range(case.steps):
            got = assemble_all(rs, "grads", step, ref["shapes"])
            assert_close_dicts(got, ref["grads"][step], f"{case.name}: gradient before clipping, step {step}")
            got = assemble_all(rs, "clipped", step, ref["shapes"])
            assert_close_dicts(got, ref["clipped"][step], f"{case.name}: clipped gradient, step {step}")
    check_parity(rs, ref, case.name)
    return ref


def assert_bitwise(a: dict, b: dict, what: str) -> None:
    """The same keys, and every tensor of the same shape, dtype and values (bitwise)."""
    assert a.keys() == b.keys(), f"{what}: keys differ: {sorted(a.keys() ^ b.keys())}"
    for k in a:
        assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype, f"{what}: {k} {a[k].shape} vs {b[k].shape}"
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


# --- hand-written scenarios: per-rank data, SGD by hand -------------------------------------------------------------


def rank_randn(tag: int, step: int, rank: int, *shape: int) -> torch.Tensor:
    """Data of data-parallel rank `rank` at `step` for scenario `tag` (the same in a worker and in the reference)."""
    g = torch.Generator().manual_seed(100_000 * tag + 100 * step + rank)
    return torch.randn(*shape, generator=g)


def global_randn(tag: int, step: int, world: int, *shape: int) -> torch.Tensor:
    """The reference's batch: every data-parallel rank's `rank_randn`, concatenated in rank order."""
    return torch.cat([rank_randn(tag, step, r, *shape) for r in range(world)])


def sgd_step(model: torch.nn.Module, lr: float) -> None:
    """p -= lr * p.grad for every parameter with a gradient, then zero_grad(set_to_none=True)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    model.zero_grad(set_to_none=True)


def seeded(factory, seed: int = 0) -> torch.nn.Module:
    """`factory()` under torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    return factory()


def state_snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of model.state_dict()."""
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def token_batch(seed: int, rows: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A global batch of byte tokens drawn from ``seed``: (rows, seq) inputs and next-token targets, int64."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (rows, seq + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy in fp32 of logits (B, T, V) against targets (B, T): a pipeline schedule's ``loss_fn``."""
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def rows_of(batch: tuple[torch.Tensor, ...], dp_world: int, dp_rank: int) -> tuple[torch.Tensor, ...]:
    """Data-parallel rank ``dp_rank``'s contiguous rows of each tensor of ``batch`` (rows divisible by dp_world)."""
    per_rank = batch[0].shape[0] // dp_world
    return tuple(t[dp_rank * per_rank:(dp_rank + 1) * per_rank] for t in batch)


def sliced_loss_fn(model: torch.nn.Module, slice_fn, dp_world: int):
    """For one process: ``loss_fn(step)`` running forward and backward on each of the ``dp_world`` slices
    ``slice_fn(step, dp_world, r)`` of the global batch, each loss divided by ``dp_world`` (the gradient of the mean
    of the ranks' losses; a MoE routes each slice by itself, as each rank does); returns that mean."""
    def loss_fn(step: int) -> float:
        total = 0.0
        for r in range(dp_world):
            loss = model(*slice_fn(step, dp_world, r))[1] / dp_world
            loss.backward()
            total += float(loss.detach())
        return total

    return loss_fn


def rank_loss_fn(model: torch.nn.Module, slice_fn, topo):
    """For a sharded run: ``loss_fn(step)`` running forward and backward on this data-parallel rank's slice
    ``slice_fn(step, dp_world, dp_rank)``; returns the mean loss over the data-parallel ranks (one all-reduce)."""
    import torch.distributed as dist
    dp_world, dp_rank = topo.dp * topo.sharding, topo.data_parallel_rank

    def loss_fn(step: int) -> float:
        loss = model(*slice_fn(step, dp_world, dp_rank))[1]
        loss.backward()
        t = loss.detach().clone()
        dist.all_reduce(t, group=topo.get_data_parallel_group())
        return float(t) / dp_world

    return loss_fn
