"""Asynchronous checkpoint saves (``save_checkpoint(..., async_save=True)``, shardfusion/checkpoint/background.py)
against synchronous ones.

One W=4 job runs every layout as a sub-case: FSDP 4, HSDP 2 x 2, cp 2 x sharding 2, tensor parallel mp 2 x sharding
2 (the GPT's tensor-parallel plan), pipeline stages pp 2 x sharding 2 (each rank passes the list of its stage) and Muon's whole
matrices (owner layout, two optimizers). Each trains a small GPT with AdamW (Muon) and at each of 2 steps saves
synchronously to one root, then asynchronously to another, then trains the next step while the write is held back
(``SHARDFUSION_TEST_SAVE_DELAY_S``): the staging copy must keep the state of the save, not of the step after it. The
next synchronous save waits for the asynchronous one in flight; the last handle's ``wait()`` returns its folder.
Checked in this process: every key of both roots' checkpoints equal bitwise (``read_all``) and their ``meta`` equal,
the published folders and ``latest`` the same; loading either checkpoint gives the same model and optimizer.
``staging_bytes`` equals the bytes of the tensors written by the rank (its data file, less DCP's headers).

The staging copy made behind the loop (the parameters and optimizer state of the optimizers given), held back by a
slowed staging thread: an optimizer step right after the save (its pre-hook waits), a ``load`` right after the save
(it waits), and a change by hand after ``AsyncSave.wait_staged()`` must not reach the checkpoint: each asynchronous
checkpoint equals a synchronous save of the same state, bitwise; the copy was still held back when each began.

The call's collectives on the default group: one all-gather (``comm.all_gather_object`` with a capacity: the
arguments' check, the previous save's outcome and ``meta`` in one round), two when a rank's part does not fit; the
objects gathered equal those sent, with and without a capacity.

Failures, a ValueError on every rank with no rank left waiting: a write that fails on rank 1 (raised by the next
save, and by ``wait()``, naming rank 1; not published, the previous checkpoint stays the latest), a staging copy
that fails on rank 2 (the others' writes are not left waiting for it), a publish that fails on rank 0, a root
folder that cannot be made (a file is in the way), a bad ``SHARDFUSION_TEST_SAVE_DELAY_S``.
"""

from __future__ import annotations

import os
import time
import zlib

import pytest
import torch

from harness import raised, run_distributed
from reference import assert_bitwise

JOB_TIMEOUT_S = 240
pytestmark = pytest.mark.timeout(JOB_TIMEOUT_S + 60)

CONFIG = dict(n_layer=2, n_head=2, d_model=32, seq_len=8, tie_embeddings=False, fused_qkv=False)
LAYOUTS = {"fsdp4": dict(sharding=4), "hsdp2x2": dict(sharding=4, fsdp_outer_degree=2),
           "cp2": dict(cp=2, sharding=2), "mp2": dict(mp=2, sharding=2), "pp2": dict(pp=2, sharding=2),
           "muon": dict(sharding=4)}
SAVES = (1, 2)
DELAY_S = "0.3"
STAGING_DELAY_S = 1.0  # the staging thread's sleep before its copy: longer than a step of the small GPT


def _gpt(seed: int = 0):
    from shardfusion.models import GPT, GPTConfig
    torch.manual_seed(seed)
    return GPT(GPTConfig(**CONFIG))


def _build(name: str, topo, seed: int = 0) -> tuple[list, list]:
    """This rank's sharded models (a list) and optimizers (a list) of layout ``name``."""
    import shardfusion as sf
    from shardfusion.models import Block
    if name == "muon":
        import muon_reference as mr
        model = sf.fully_shard(_gpt(seed), topo, units=(Block,), whole_params=mr.is_block_matrix)
        return [model], mr.optimizers(model)
    if name == "pp2":
        from shardfusion.models.gpt_pipeline import split_gpt
        models = [sf.fully_shard(split_gpt(_gpt(seed), topo.pp_rank, 2), topo, units=(Block,))]
    elif name == "mp2":
        from shardfusion.models.gpt_parallel import parallelize
        models = [sf.fully_shard(parallelize(_gpt(seed), topo.get_mesh("mp")), topo, units=(Block,))]
    else:
        models = [sf.fully_shard(_gpt(seed), topo, units=(Block,))]
    return models, [torch.optim.AdamW([p for m in models for p in m.parameters()], lr=1e-2, weight_decay=0.1)]


def _step(models: list, optimizers: list, step: int) -> None:
    """One optimizer step on gradients drawn from (step, parameter name): the same on the replicas of a fragment
    (the parameters are this rank's fragments, plain tensors, in every layout)."""
    for m in models:
        for n, p in m.named_parameters():
            g = torch.Generator().manual_seed(1000 * step + zlib.crc32(n.encode()))
            p.grad = torch.randn(p.shape, generator=g)
    for opt in optimizers:
        opt.step()
        opt.zero_grad()


def _full(models: list, optimizers: list) -> dict:
    import shardfusion as sf
    state = {k: v for m in models for k, v in sf.full_state_dict(m).items()}
    steps = sorted({float(st["step"]) for opt in optimizers for st in opt.state.values() if "step" in st})
    return {"model": state, "steps": steps}


def _counted(copy, copies: list):
    """``copy`` (a staged value), its bytes added to ``copies`` when it is a tensor."""
    if torch.is_tensor(copy):
        copies.append(copy.numel() * copy.element_size())
    return copy


def _layout_case(name: str, root: str) -> dict:
    """Sync and async saves of layout ``name`` at SAVES, a step between them; then the loads of both. Counts the
    bytes staged (``staged``, wrapped) against ``staging_bytes``."""
    import shardfusion as sf
    from shardfusion import checkpoint as ckpt
    from shardfusion.checkpoint import background
    topo = sf.Topology(**LAYOUTS[name], timeout=60)
    models, opts = _build(name, topo)
    out: dict = {"paths": [], "handles": [], "staging": [], "staged": []}
    os.environ["SHARDFUSION_TEST_SAVE_DELAY_S"] = DELAY_S
    handle, staged = None, background.staged
    for step in SAVES:
        _step(models, opts, step)
        extra = {"step": step, "layout": name}
        out["paths"].append(ckpt.save_checkpoint(models, opts, f"{root}/{name}/sync", step, keep=2, extra=extra))
        copies: list = []
        background.staged = lambda value, into=None: _counted(staged(value, into), copies)
        handle = ckpt.save_checkpoint(models, opts, f"{root}/{name}/async", step, keep=2, extra=extra,
                                      async_save=True)
        handle.wait_staged()  # the copy behind the loop counted too
        background.staged = staged
        out["handles"].append((type(handle).__name__, handle.path))
        out["staging"].append(ckpt.staging_bytes(models, opts))
        out["staged"].append(sum(copies))
        _step(models, opts, 100 + step)  # changes every tensor saved while the write is held back
    out["done_before_wait"] = handle.done()
    out["waited"] = handle.wait()
    out["waited_again"] = handle.wait()
    os.environ.pop("SHARDFUSION_TEST_SAVE_DELAY_S")
    for kind in ("sync", "async"):
        fresh, fresh_opts = _build(name, topo, seed=1)
        ckpt.load(fresh, fresh_opts, f"{root}/{name}/{kind}/step-{SAVES[-1]}")
        out[f"loaded-{kind}"] = _full(fresh, fresh_opts)
    return out


def _staging_case(root: str) -> dict:
    """Asynchronous saves whose staging copy behind the loop is held back (the staging thread sleeps
    STAGING_DELAY_S first), each beside a synchronous save of the same state: an optimizer step right after the save,
    a load right after it, a change by hand after ``wait_staged()``. ``held_back``: the copy had not begun when the
    step, the load or ``wait_staged`` began (else the case would prove nothing)."""
    import shardfusion as sf
    from shardfusion import checkpoint as ckpt
    from shardfusion.checkpoint import background
    topo = sf.Topology(**LAYOUTS["hsdp2x2"], timeout=60)
    models, opts = _build("hsdp2x2", topo)
    behind, where, out = background._Stager._behind_loop, f"{root}/staging", {"held_back": []}

    def late(self, *args):
        time.sleep(STAGING_DELAY_S)
        return behind(self, *args)
    background._Stager._behind_loop = late

    def saved(step: int):
        ckpt.save_checkpoint(models, opts, f"{where}/sync", step)
        handle = ckpt.save_checkpoint(models, opts, f"{where}/async", step, async_save=True)
        out["held_back"].append(not handle._copied.is_set())
        return handle
    _step(models, opts, 1)
    handle = saved(1)
    _step(models, opts, 2)  # waits for the copy (the optimizers' step pre-hook)
    handle.wait()
    handle = saved(2)
    ckpt.load(models, opts, f"{where}/sync/step-1")  # waits for the copy: step 1's values must not reach step-2
    handle.wait()
    _step(models, opts, 3)
    handle = saved(3)
    handle.wait_staged()
    with torch.no_grad():
        for p in (p for m in models for p in m.parameters()):
            p.add_(1.0)
    out["waited"] = handle.wait()
    background._Stager._behind_loop = behind
    return out


def _gather_case(root: str) -> dict:
    """All-gathers on the default group (``comm._all_gather_base`` counted) of an asynchronous ``save_checkpoint``
    after another (which agrees on it), and of ``all_gather_object`` with a capacity that every rank's object fits,
    that rank 3's does not fit, and none; the objects gathered."""
    import torch.distributed as dist
    import shardfusion as sf
    from shardfusion import checkpoint as ckpt, comm
    rank, counted, out = dist.get_rank(), [], {}
    base = comm._all_gather_base

    def counting(*args, **kwargs):
        counted.append(kwargs.get("group"))
        return base(*args, **kwargs)
    models, opts = _build("fsdp4", sf.Topology(sharding=4, timeout=60))
    _step(models, opts, 1)
    ckpt.save_checkpoint(models, opts, f"{root}/gathers", 1, async_save=True)
    comm._all_gather_base = counting
    try:
        handle = ckpt.save_checkpoint(models, opts, f"{root}/gathers", 2, async_save=True)
        out["save"] = sum(1 for group in counted if group is None)
        mine = {"rank": rank, "text": "x" * (100 if rank != 3 else 5000)}
        for capacity in (10000, 1000, 0):
            counted.clear()
            out[f"objects-{capacity}"] = comm.all_gather_object(mine, None, "a test", capacity=capacity)
            out[f"gathers-{capacity}"] = len(counted)
    finally:
        comm._all_gather_base = base
    handle.wait()
    return out


def _error(fn) -> str:
    """``"<type>: <message>"`` of what ``fn()`` raises, or ``"None: None"``."""
    return "{}: {}".format(*raised(fn))


def _failure_cases(root: str) -> dict:
    """A write failing on rank 1, a staging copy failing on rank 2, a publish failing on rank 0, a bad delay."""
    import torch.distributed as dist
    import shardfusion as sf
    from shardfusion import checkpoint as ckpt
    from shardfusion.checkpoint import background
    rank, out = dist.get_rank(), {}
    topo = sf.Topology(sharding=4, timeout=60)
    models, opts = _build("fsdp4", topo)
    _step(models, opts, 1)
    where = f"{root}/failures"
    ckpt.save_checkpoint(models, opts, where, 1, async_save=True)
    writer, staged, publish = background._Writer.write_data, background.staged, background.publish

    def no_space(self, plan, planner):  # on rank 1, the write of step 2 only (the thread calls it later)
        if str(self.path).endswith("tmp-step-2"):
            raise OSError(28, "No space left on device (injected)")
        return writer(self, plan, planner)
    if rank == 1:
        background._Writer.write_data = no_space
    handle = ckpt.save_checkpoint(models, opts, where, 2, async_save=True)  # agrees on step 1: published
    out["next_save"] = _error(lambda: ckpt.save_checkpoint(models, opts, where, 3, async_save=True))
    out["wait"] = _error(handle.wait)
    out["latest"] = ckpt.latest_checkpoint(where)
    out["listing"] = sorted(os.listdir(where))
    background._Writer.write_data = writer

    def out_of_memory(value, into=None):
        raise MemoryError("staging copy (injected)")
    if rank == 2:
        background.staged = out_of_memory
    out["staging_failed"] = _error(ckpt.save_checkpoint(models, opts, where, 4, async_save=True).wait)
    background.staged = staged

    def not_allowed(root, step, keep):
        raise PermissionError(13, "Permission denied (injected)", root)
    background.publish = not_allowed
    out["publish_failed"] = _error(ckpt.save_checkpoint(models, opts, where, 5, async_save=True).wait)
    background.publish = publish
    out["latest_after"] = ckpt.latest_checkpoint(where)
    blocked = f"{root}/blocked"
    if rank == 0:
        open(blocked, "w").close()  # a file where the root folder must go: no rank can make tmp-step-1 there
    dist.barrier()
    out["unwritable"] = _error(ckpt.save_checkpoint(models, opts, blocked, 1, async_save=True).wait)
    os.environ["SHARDFUSION_TEST_SAVE_DELAY_S"] = "soon"
    out["bad_delay"] = _error(lambda: ckpt.save_checkpoint(models, opts, where, 6, async_save=True))
    os.environ.pop("SHARDFUSION_TEST_SAVE_DELAY_S")
    out["after_failures"] = ckpt.save_checkpoint(models, opts, where, 7, async_save=True).wait()
    return out


def async_job(root: str) -> dict:
    out = {name: _layout_case(name, root) for name in LAYOUTS}
    out["staging"] = _staging_case(root)
    out["gathers"] = _gather_case(root)
    out["failures"] = _failure_cases(root)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list]:
    root = str(tmp_path_factory.mktemp("async"))
    return root, run_distributed(async_job, 4, root, timeout=JOB_TIMEOUT_S)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_async_save_equals_sync_save(runs, name: str) -> None:
    from shardfusion.checkpoint import latest_checkpoint, read_all, read_meta
    root, results = runs
    kept = [f"step-{s}" for s in SAVES]  # keep=2
    for kind in ("sync", "async"):
        assert sorted(d for d in os.listdir(f"{root}/{name}/{kind}") if d.startswith("step-")) == kept
        assert latest_checkpoint(f"{root}/{name}/{kind}") == f"{root}/{name}/{kind}/step-{SAVES[-1]}"
    for step in SAVES:
        sync, asynchronous = (read_all(f"{root}/{name}/{kind}/step-{step}") for kind in ("sync", "async"))
        assert sync.keys() == asynchronous.keys() and any("/exp_avg" in k or "momentum" in k for k in sync)
        for key in sync:
            assert torch.equal(sync[key], asynchronous[key]), (name, step, key)
        assert read_meta(f"{root}/{name}/sync/step-{step}") == read_meta(f"{root}/{name}/async/step-{step}")
    for rank, r in enumerate(results):
        r = r[name]
        assert r["handles"] == [("AsyncSave", f"{root}/{name}/async/step-{s}") for s in SAVES]
        assert r["paths"] == [f"{root}/{name}/sync/step-{s}" for s in SAVES]
        assert r["waited"] == r["waited_again"] == f"{root}/{name}/async/step-{SAVES[-1]}"
        assert_bitwise(r["loaded-async"]["model"], r["loaded-sync"]["model"], f"{name} rank {rank}")
        assert r["loaded-async"]["steps"] == r["loaded-sync"]["steps"] == [2.0 * SAVES[-1] - 1]  # a step between saves


def test_the_staging_copy_behind_the_loop_is_waited_for(runs) -> None:
    """An optimizer step, a load, a change by hand after wait_staged(): none reaches the checkpoint of the
    asynchronous save before it (bitwise equal to the synchronous save of the same state)."""
    from shardfusion.checkpoint import read_all
    root, results = runs
    for rank, r in enumerate(results):
        assert r["staging"]["held_back"] == [True, True, True], (rank, r["staging"])
        assert r["staging"]["waited"] == f"{root}/staging/async/step-3"
    for step in (1, 2, 3):
        sync, asynchronous = (read_all(f"{root}/staging/{kind}/step-{step}") for kind in ("sync", "async"))
        assert sync.keys() == asynchronous.keys()
        for key in sync:
            assert torch.equal(sync[key], asynchronous[key]), (step, key)


def test_a_save_gathers_in_one_round(runs) -> None:
    """An asynchronous save makes one all-gather on the default group (after its arrival check), the previous
    save's agreement included; all_gather_object with a capacity: one round when every object fits, two otherwise,
    the same objects as without."""
    _, results = runs
    sent = [{"rank": r, "text": "x" * (100 if r != 3 else 5000)} for r in range(4)]
    for rank, r in enumerate(results):
        g = r["gathers"]
        assert g["save"] == 1, (rank, g["save"])
        assert g["objects-10000"] == g["objects-1000"] == g["objects-0"] == sent, rank
        assert (g["gathers-10000"], g["gathers-1000"], g["gathers-0"]) == (1, 2, 2), (rank, g)


def test_staging_bytes_are_the_staged_tensors(runs) -> None:
    """staging_bytes (what the dry run reports) is what the staging copy of each save held, on every rank and
    layout (replicas of HSDP and cp ranks stage only scalars and buffers)."""
    _, results = runs
    for name in LAYOUTS:
        for rank, r in enumerate(results):
            assert r[name]["staging"] == r[name]["staged"], (name, rank, r[name]["staging"], r[name]["staged"])
            assert all(b > 0 for b in r[name]["staged"]), (name, rank)
    hsdp = [r["hsdp2x2"]["staged"][-1] for r in results]
    assert hsdp[2] < hsdp[0] / 10 and hsdp[3] < hsdp[1] / 10, hsdp  # outer replica 1 writes no fragments


def test_a_failed_background_write_raises_on_every_rank(runs) -> None:
    root, results = runs
    where = f"{root}/failures"
    for r in (r["failures"] for r in results):
        assert r["next_save"].startswith(f"ValueError: asynchronous save of {where}/step-2 failed: ranks 0-3: "
                                         f"checkpoint '{where}/tmp-step-2' cannot be written: rank 1: OSError: "
                                         "[Errno 28] No space left on device (injected)"), r["next_save"]
        assert r["wait"] == r["next_save"]
        assert r["latest"] == f"{where}/step-1" and r["listing"] == ["latest", "step-1", "tmp-step-2"], r
        assert r["staging_failed"].startswith(f"ValueError: asynchronous save of {where}/step-4 failed: ranks 0-3: "
                                              "checkpoint") and \
            "rank 2: MemoryError: staging copy (injected)" in r["staging_failed"], r["staging_failed"]
        assert r["publish_failed"] == (f"ValueError: asynchronous save of {where}/step-5 failed: rank 0: cannot "
                                       f"publish '{where}/tmp-step-5' as '{where}/step-5': PermissionError: [Errno "
                                       f"13] Permission denied (injected): '{where}'"), r["publish_failed"]
        assert r["latest_after"] == f"{where}/step-1"
        assert r["unwritable"].startswith(f"ValueError: asynchronous save of {root}/blocked/step-1 failed: ranks 0-3: "
                                          f"checkpoint '{root}/blocked/tmp-step-1' cannot be written: ranks 0, 1, "
                                          "2, 3: NotADirectoryError"), r["unwritable"]
        assert r["bad_delay"] == ("ValueError: SHARDFUSION_TEST_SAVE_DELAY_S must be a number of seconds >= 0, got "
                                  "'soon'"), r["bad_delay"]
        assert r["after_failures"] == f"{where}/step-7"
