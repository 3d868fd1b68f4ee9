"""DiLoCo on HSDP (shardfusion/diloco.py), W=4 gloo ranks as outer 2 x inner 2, against a single-process reference.

The reference keeps one whole copy of the model per replica, each with its own optimizer, trained on the samples
that replica's two ranks draw (the same generators); every H steps it applies the outer step to whole tensors:
delta = mean_r (snapshot - p_r), m = mu m + delta, snapshot -= lr (delta + mu m), every p_r = snapshot. The sharded
run must match it (every replica's full parameters after every step, fp32 rounding), its replicas must be bitwise
equal after each outer step and differ between them, and its inner steps must send nothing over the replicate group.
With H = 1, plain SGD inside and an outer SGD of lr 1 without momentum it must equal synchronous HSDP with that SGD.
Streaming (fragments at staggered steps) is checked against the reference's streaming variant: each fragment's own
outer step, on its own parameters, at its own steps; the losses of every step too.
"""

from __future__ import annotations

import pytest
import torch

from harness import raised, run_distributed
from models import UNIT_CLASSES, build_model, loss_fn, make_batch

JOB_TIMEOUT_S = 120
W, KIND, DATA_SEED = 4, "transformer", 7


def _optimizer(name: str, params):
    return torch.optim.SGD(params, lr=0.2) if name == "sgd" else torch.optim.AdamW(params, lr=3e-2)


def sharded_run(steps: int, every: int | None, *, inner: str = "adamw", lr: float = 0.7, momentum: float = 0.9,
                comm_dtype=None, fragments: int = 1, clip: float | None = None, finish: bool = False,
                whole: tuple[str, ...] = ()) -> dict:
    """HSDP 2 x 2 with DiLoCo (every=None: synchronous HSDP). Returns per step the full parameters (this rank's
    replica), this rank's loss, the replicate all-reduce bytes of the step, the fragments synchronised and the clip
    norm. finish: `DiLoCo.finish` after the last step (its parameters replace the last step's). whole: name
    prefixes of the parameters kept whole (``replicate_filter``, as a pipeline keeps a weight tied across its
    ends)."""
    import torch.distributed as dist
    import shardfusion as sf

    topo = sf.Topology(sharding=4, fsdp_outer_degree=2)
    model = build_model(KIND)
    sf.fully_shard(model, topo, units=UNIT_CLASSES[KIND],
                   replicate_filter=(lambda n, p: n.startswith(whole)) if whole else None)
    opt = _optimizer(inner, model.parameters())
    diloco = (sf.DiLoCo(model, topo, every=every, lr=lr, momentum=momentum, comm_dtype=comm_dtype,
                        fragments=fragments) if every is not None else None)
    gen = torch.Generator().manual_seed(DATA_SEED + topo.data_parallel_rank)
    out = {"params": [], "losses": [], "outer_bytes": [], "synced": [], "norms": [], "outer_rank": topo.outer_rank}
    for step in range(steps):
        with sf.comm.CommCounter() as counter:
            loss = loss_fn(KIND, model, make_batch(KIND, gen))
            loss.backward()
            out["losses"].append(loss.item())
            if clip is not None:
                out["norms"].append(float(sf.clip_grad_norm_(model, clip)))
            opt.step()
            opt.zero_grad()
            out["synced"].append(diloco.step() if diloco is not None else None)
            if finish and step == steps - 1:
                out["finished"] = diloco.finish()
        out["outer_bytes"].append(sum(r.wire_bytes for r in counter.records if r.category == "replicate_all_reduce"))
        out["params"].append({k: v.clone() for k, v in sf.full_state_dict(model, buffers=False).items()})
    if diloco is not None:
        out["state_keys"] = sorted(diloco.state_dict())
    dist.barrier()
    return out


def reference_run(steps: int, every: int, *, inner: str = "adamw", lr: float = 0.7, momentum: float = 0.9,
                  clip: float | None = None, fragments: tuple[tuple[str, ...], ...] | None = None,
                  finish: bool = False) -> dict:
    """The single-process DiLoCo: {"params": per replica, per step, the full parameters; "losses": per replica,
    per step, the loss of its samples (the mean of its two ranks' micro-batch losses)}.

    Streaming (Douillard et al., 2025): ``fragments`` lists per fragment the name prefixes of its parameters
    (None: one fragment of all); fragment f has its own outer step at the steps t with (t + f H // F) % H == 0,
    on its parameters only. finish: after the last step, the outer step of every fragment not due then."""
    from models import concat_batches

    replicas = [build_model(KIND) for _ in range(2)]
    opts = [_optimizer(inner, m.parameters()) for m in replicas]
    gens = [torch.Generator().manual_seed(DATA_SEED + r) for r in range(W)]  # data_parallel_rank r
    snapshot = {k: v.detach().clone() for k, v in replicas[0].named_parameters()}
    mom = {k: torch.zeros_like(v) for k, v in snapshot.items()}
    fragments = fragments or (("",),)
    members = [[k for k in snapshot if k.startswith(prefixes)] for prefixes in fragments]
    assert sorted(sum(members, [])) == sorted(snapshot), members  # every parameter in one fragment

    def outer_step(names: list[str]) -> None:
        params = [dict(m.named_parameters()) for m in replicas]
        for k in names:
            delta = sum(snapshot[k] - p[k] for p in params) / 2
            mom[k].mul_(momentum).add_(delta)
            snapshot[k] -= lr * (delta + momentum * mom[k])
            for p in params:
                p[k].copy_(snapshot[k])

    out: dict = {"params": [[], []], "losses": [[], []]}
    for step in range(1, steps + 1):
        batches = [make_batch(KIND, g) for g in gens]  # every rank draws its micro-batch, in rank order
        for r, (model, opt) in enumerate(zip(replicas, opts)):
            loss = loss_fn(KIND, model, concat_batches(batches[2 * r:2 * r + 2]))
            loss.backward()
            out["losses"][r].append(loss.item())
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            due = [(step + f * every // len(fragments)) % every == 0 for f in range(len(fragments))]
            for f, names in enumerate(members):
                if due[f] or (finish and step == steps):
                    outer_step(names)
        for r, model in enumerate(replicas):
            out["params"][r].append({k: v.detach().clone() for k, v in model.named_parameters()})
    return out


def _close(a: dict, b: dict, tol: float) -> float:
    worst = 0.0
    for k in b:  # the reference's named_parameters: a tied weight under its first name
        worst = max(worst, float((a[k] - b[k]).abs().max() / (b[k].abs().max() + 1e-12)))
    assert worst <= tol, worst
    return worst


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_diloco_matches_the_single_process_reference_and_replicas_agree_after_each_outer_step() -> None:
    steps, every = 7, 3
    ranks = run_distributed(sharded_run, W, steps, every, clip=0.5, timeout=JOB_TIMEOUT_S)
    ref = reference_run(steps, every, clip=0.5)
    for rank in range(W):
        replica = ranks[rank]["outer_rank"]
        for step in range(steps):
            _close(ranks[rank]["params"][step], ref["params"][replica][step], 2e-5)
    for step in range(steps):
        synced = (step + 1) % every == 0
        a, b = ranks[0]["params"][step], ranks[2]["params"][step]  # replica 0 and replica 1
        same = all(torch.equal(a[k], b[k]) for k in a)
        assert same == synced, (step, synced)
        assert ranks[0]["synced"][step] == ([0] if synced else [])
        # nothing crosses the replicate group in an inner step; the pseudo-gradients do at an outer step
        assert (ranks[0]["outer_bytes"][step] > 0) == synced, ranks[0]["outer_bytes"]
    assert ranks[0]["norms"] != ranks[2]["norms"]  # each replica clips by its own norm
    assert "snapshot/0" in ranks[0]["state_keys"] and "momentum/0" in ranks[0]["state_keys"]


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_a_parameter_kept_whole_matches_the_reference() -> None:
    """The token embedding kept whole on every rank (as pipeline stages keep a weight tied across their ends): in
    an inner step its gradient is averaged over the replica's two ranks only, counted once per replica in its clip
    norm, and the outer step averages it over the replicas: the same reference as the sharded parameters'."""
    steps, every = 5, 2
    ranks = run_distributed(sharded_run, W, steps, every, clip=0.5, whole=("tok.",), timeout=JOB_TIMEOUT_S)
    ref = reference_run(steps, every, clip=0.5)
    for rank in range(W):
        for step in range(steps):
            _close(ranks[rank]["params"][step], ref["params"][ranks[rank]["outer_rank"]][step], 2e-5)
    a, b = ranks[0]["params"][0], ranks[2]["params"][0]  # after step 1: the replicas differ, the embedding too
    assert not torch.equal(a["tok.weight"], b["tok.weight"])
    assert ranks[0]["norms"] == ranks[1]["norms"] != ranks[2]["norms"]  # one norm per replica


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_h1_sgd_with_an_outer_sgd_of_lr1_is_synchronous_hsdp() -> None:
    steps = 4
    diloco = run_distributed(sharded_run, W, steps, 1, inner="sgd", lr=1.0, momentum=0.0, timeout=JOB_TIMEOUT_S)
    sync = run_distributed(sharded_run, W, steps, None, inner="sgd", timeout=JOB_TIMEOUT_S)
    for rank in range(W):
        for step in range(steps):
            _close(diloco[rank]["params"][step], sync[rank]["params"][step], 1e-6)
    # the bytes: the same sharded all-reduce of every buffer, once per step either way
    assert diloco[0]["outer_bytes"] == sync[0]["outer_bytes"]


@pytest.mark.timeout(JOB_TIMEOUT_S)
@pytest.mark.parametrize("comm_dtype, tol", [("int8", 3e-2), (torch.bfloat16, 1e-2)])
def test_compressed_outer_steps(comm_dtype, tol: float) -> None:
    """The replicas are still bitwise equal after each outer step, near the exact reference."""
    steps, every = 8, 4
    ranks = run_distributed(sharded_run, W, steps, every, comm_dtype=comm_dtype, timeout=JOB_TIMEOUT_S)
    ref = reference_run(steps, every)
    for step in (3, 7):
        a, b = ranks[0]["params"][step], ranks[2]["params"][step]
        assert all(torch.equal(a[k], b[k]) for k in a), step
        _close(ranks[0]["params"][step], ref["params"][0][step], tol)


STREAMING_FRAGMENTS = (("tok.", "pos", "norm.", "blocks.0."), ("blocks.1.",))
"""The transformer's 2 fragments by the documented rule: the flat buffers in unit order (the root unit first: tok,
pos, norm, 192 elements; then blocks.0 and blocks.1, 296 each) cut into runs of about equal size: the first run
ends at the buffer that reaches half of the 784 elements."""


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_streaming_matches_the_single_process_reference() -> None:
    """Streaming with 2 fragments at H = 4 (fragment 0 at steps 4, 8; fragment 1 at steps 2, 6; `finish` after
    step 8 syncs fragment 1): every replica's loss and full parameters after every step equal the single-process
    streaming DiLoCo's (each fragment with its own outer step on its own parameters), the replicas end as one model;
    each step carries only its fragment's bytes, and the two together make a full outer step's bytes."""
    steps, every = 8, 4
    model = build_model(KIND)
    sizes = {prefix: sum(p.numel() for k, p in model.named_parameters() if k.startswith(prefix))
             for prefix in ("blocks.0.", "blocks.1.")}
    assert sizes == {"blocks.0.": 296, "blocks.1.": 296} and sum(p.numel() for p in model.parameters()) == 784
    ranks = run_distributed(sharded_run, W, steps, every, fragments=2, finish=True, timeout=JOB_TIMEOUT_S)
    ref = reference_run(steps, every, fragments=STREAMING_FRAGMENTS, finish=True)
    for step in range(steps):
        for replica in (0, 1):
            mine = [r for r in ranks if r["outer_rank"] == replica]
            loss = sum(r["losses"][step] for r in mine) / len(mine)
            assert abs(loss - ref["losses"][replica][step]) <= 1e-5 * abs(loss), (step, replica, loss)
            for r in mine:
                _close(r["params"][step], ref["params"][replica][step], 2e-5)
    a, b = ref["params"][0][2], ref["params"][1][2]  # after step 3: the replicas differ between outer steps
    assert not all(torch.equal(a[k], b[k]) for k in a)
    a, b = ranks[0]["params"][-1], ranks[2]["params"][-1]
    assert all(torch.equal(a[k], b[k]) for k in a) and ranks[0]["finished"] == [1]
    synced = ranks[0]["synced"]
    assert synced == [[], [1], [], [0], [], [1], [], [0]], synced
    bytes_ = ranks[0]["outer_bytes"]
    assert bytes_[1] > 0 and bytes_[3] > 0 and all(bytes_[i] == 0 for i in (0, 2, 4, 6))
    whole = run_distributed(sharded_run, W, 4, 4, timeout=JOB_TIMEOUT_S)[0]["outer_bytes"][3]
    assert bytes_[1] + bytes_[3] == whole and max(bytes_[1], bytes_[3]) < 0.8 * whole, (bytes_, whole)


def refusals() -> list:
    import shardfusion as sf

    flat = sf.Topology(sharding=4)  # outer 1: no replicas
    hsdp = sf.Topology(sharding=4, fsdp_outer_degree=2)
    model = build_model(KIND)
    sf.fully_shard(model, hsdp, units=UNIT_CLASSES[KIND])
    other = build_model(KIND)
    sf.fully_shard(other, flat, units=UNIT_CLASSES[KIND])
    return [raised(lambda: sf.DiLoCo(model, hsdp, every=0)), raised(lambda: sf.DiLoCo(model, hsdp, lr=0.0)),
            raised(lambda: sf.DiLoCo(model, hsdp, momentum=1.0)),
            raised(lambda: sf.DiLoCo(model, hsdp, every=2, fragments=3)),
            raised(lambda: sf.DiLoCo(other, flat))]


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_refusals_are_clear_errors_on_every_rank() -> None:
    for rank in run_distributed(refusals, W, timeout=JOB_TIMEOUT_S):
        kinds = [k for k, _ in rank]
        texts = [t for _, t in rank]
        assert kinds == ["ValueError"] * 5, rank
        assert "every (H, inner steps per outer step) must be an int >= 1, got 0" in texts[0]
        assert "lr (the outer learning rate) must be > 0, got 0.0" in texts[1]
        assert "momentum (the outer momentum) must be in [0, 1), got 1.0" in texts[2]
        assert "fragments must be an int in 1 .. min(every 2" in texts[3]
        assert "DiLoCo needs replicas to synchronise: dp x fsdp_outer_degree is 1 x 1 = 1" in texts[4]


def finish_run() -> dict:
    import shardfusion as sf

    topo = sf.Topology(sharding=4, fsdp_outer_degree=2)
    model = build_model(KIND)
    sf.fully_shard(model, topo, units=UNIT_CLASSES[KIND])
    opt = _optimizer("adamw", model.parameters())
    diloco = sf.DiLoCo(model, topo, every=4, fragments=2)
    gen = torch.Generator().manual_seed(DATA_SEED + topo.data_parallel_rank)
    for _ in range(3):  # fragment 1 synchronised at step 2; at step 3 nothing is due
        loss_fn(KIND, model, make_batch(KIND, gen)).backward()
        opt.step()
        opt.zero_grad()
        diloco.step()
    finished = diloco.finish()
    return {"finished": finished, "outer_steps": list(diloco.outer_steps),
            "params": sf.full_state_dict(model, buffers=False)}


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_finish_makes_one_model() -> None:
    ranks = run_distributed(finish_run, W, timeout=JOB_TIMEOUT_S)
    assert ranks[0]["finished"] == [0, 1] and ranks[0]["outer_steps"] == [1, 2]
    a, b = ranks[0]["params"], ranks[2]["params"]
    assert all(torch.equal(a[k], b[k]) for k in a)
