"""torch.compile of a sharded model: Inductor compiles the modules' compute, shardfusion's hooks run eagerly.

The hooks are excluded from tracing (``torch.compiler.disable``): Dynamo breaks the graph at each of them, so each
unit's compute between two hooks is one compiled graph, and the all-gathers, reshards and reduce-scatters run as
without compile. Checked against the single-process eager reference: W=4 HSDP (inner 2 x outer 2), SGD, 3 steps.

The ranks of the harness import ``torch._dynamo`` before shardfusion, so their hooks carry ``torch.compiler.disable``
itself. A process that imports shardfusion first gets the lazy form (``shardfusion/_runtime/compile_disable.py``):
checked in a fresh process of one rank, whose Dynamo must compile the same frames and graphs, with the same graph
breaks, as a process that imported Dynamo first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from harness import run_distributed
from models import MLP, MODEL_SEED, TinyTransformer

STEPS, BATCH, LR = 3, 8, 0.1
JOB_TIMEOUT_S = 420  # Inductor compiles each unit's forward and backward on every rank: slow on two cores


def _batch(kind: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    if kind == "mlp":
        return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)
    tokens = torch.randint(0, 16, (BATCH, 6), generator=g)
    return tokens, tokens


def _loss(kind: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if kind == "mlp":
        return F.mse_loss(out, target)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def _build(kind: str) -> nn.Module:
    torch.manual_seed(MODEL_SEED)
    return MLP() if kind == "mlp" else TinyTransformer()


def _reference(kind: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _build(kind)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = _batch(kind, step)
        opt.zero_grad()
        loss = _loss(kind, model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _compiled_run(kind: str, units: tuple, reshard_policy: str) -> dict:
    import torch.distributed as dist

    import shardfusion as sf

    rank, world = dist.get_rank(), dist.get_world_size()
    model = sf.fully_shard(_build(kind), sf.Topology(sharding=-1, fsdp_outer_degree=2), units=units,
                           reshard_policy=reshard_policy)
    compiled = torch.compile(model, backend="inductor")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = _batch(kind, step)
        opt.zero_grad()
        loss = _loss(kind, compiled(x.chunk(world)[rank]), y.chunk(world)[rank])
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return {"losses": losses, "full": sf.full_state_dict(model)}


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_inductor_compiled_model_matches_eager_reference() -> None:
    from models import Block

    cases = [("mlp", (nn.Linear,), "after_forward"), ("tiny", (Block,), "after_backward")]
    for kind, units, policy in cases:
        ref_losses, ref_state = _reference(kind)
        results = run_distributed(_compiled_run, 4, kind, units, policy, timeout=JOB_TIMEOUT_S / 2)
        for r in results:
            assert r["losses"] == pytest.approx(ref_losses, rel=1e-5), kind
            assert set(r["full"]) <= set(ref_state)  # a tied parameter appears once, under its first name
            for name, value in r["full"].items():
                torch.testing.assert_close(value, ref_state[name], rtol=1e-5, atol=1e-6, msg=f"{kind} {name}")



def _one_rank_compiled_run(reference: bool) -> None:
    """In a fresh process: `_compiled_run`'s training of the MLP (two Linear units) on one gloo rank (backend "eager":
    Dynamo's graphs run uncompiled, fast), its hooks decorated by ``compile_disable`` in a process that imports
    shardfusion before ``torch._dynamo``, or with ``reference`` by ``torch.compiler.disable`` itself. Prints one JSON
    line: the losses, the full state, Dynamo's counts and whether ``import shardfusion`` and ``fully_shard`` left
    ``torch._dynamo`` unimported."""
    import importlib
    import tempfile

    import torch.distributed as dist

    if reference:  # the scheduler imports the decorator by name: replaced before it is imported
        importlib.import_module("shardfusion._runtime.compile_disable").compile_disable = torch.compiler.disable
    import shardfusion as sf
    loaded = {"after_import": "torch._dynamo" in sys.modules}
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        model = sf.fully_shard(_build("mlp"), sf.Topology(sharding=-1), units=(nn.Linear,))
        loaded["after_fully_shard"] = "torch._dynamo" in sys.modules
        compiled = torch.compile(model, backend="eager")
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        losses = []
        for step in range(STEPS):
            x, y = _batch("mlp", step)
            opt.zero_grad()
            loss = _loss("mlp", compiled(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        full = {k: v.tolist() for k, v in sf.full_state_dict(model).items()}
        dist.destroy_process_group()
    from torch._dynamo.utils import counters

    counts = {"frames": dict(counters["frames"]), "graphs": counters["stats"]["unique_graphs"],
              "calls_captured": counters["stats"]["calls_captured"],
              "graph_breaks": sum(counters["graph_break"].values())}
    print(json.dumps({"losses": losses, "full": full, "counts": counts, "dynamo_loaded": loaded}))


def _start_fresh(reference: bool) -> subprocess.Popen:
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(tests), tests, os.path.dirname(__file__)]),
           "OMP_NUM_THREADS": "1"}
    code = f"import test_compile; test_compile._one_rank_compiled_run({reference})"
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _result(process: subprocess.Popen) -> dict:
    try:
        out, err = process.communicate(timeout=240)
    finally:
        process.kill()
    assert process.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.timeout(540)
def test_hooks_of_a_model_sharded_before_dynamo_is_imported_are_not_traced() -> None:
    """``import shardfusion`` and ``fully_shard`` do not import ``torch._dynamo``; once ``torch.compile`` has, the
    hooks decorated before are excluded from tracing as ``torch.compiler.disable``'d ones are: Dynamo compiles the
    same frames and graphs, capturing the same calls, with the same graph breaks as with hooks decorated by
    ``torch.compiler.disable`` (a hook traced, or a hook's own frame compiled, would change them), and the training
    matches the eager reference."""
    lazy, reference = [_result(p) for p in [_start_fresh(reference=False), _start_fresh(reference=True)]]
    assert lazy["dynamo_loaded"] == {"after_import": False, "after_fully_shard": False}
    assert lazy["counts"] == reference["counts"]
    assert reference["counts"]["graph_breaks"] == 2  # the graph breaks at fc1's and fc2's pre-forward hooks
    ref_losses, ref_state = _reference("mlp")
    for run in (lazy, reference):
        assert run["losses"] == pytest.approx(ref_losses, rel=1e-5)
        for name, value in run["full"].items():
            torch.testing.assert_close(torch.tensor(value), ref_state[name], rtol=1e-5, atol=1e-6, msg=name)
