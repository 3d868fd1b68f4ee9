"""Publishing checkpoints and the errors of a load (shardfusion/checkpoint/).

A W=2 job checks save_checkpoint / latest_checkpoint (atomic publish, keep K, an interrupted save ignored; a resumed
run saving lower steps keeps what it publishes, leaves the higher steps and deletes leftover tmp folders) and that
a checkpoint whose keys or shapes differ from the model raises ValueError on every rank, naming them, without a hang;
so do a non-tensor rank_state value or an unsupported optimizer state entry on one rank, a tensor-parallel
parameter (mp = 2), and a data file truncated that only rank 1 reads (read_all in one process too). Param groups of
another count than the saved ones are left as they are. Non-persistent buffers are left out of checkpoints, of
load_full and of the export; a model whose non-persistent buffer has another shape loads.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

from harness import run_distributed
from models import UnevenNet
from reference import assert_bitwise

JOB_TIMEOUT_S = 240


class UnevenNetOther(UnevenNet):
    """UnevenNet with one parameter more (`extra_bias`) and `c` of another shape: keys and shapes differ."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Linear(7, 4, bias=False)
        self.extra_bias = nn.Parameter(torch.zeros(3))


def _publish_job(root: str) -> dict:
    import shardfusion as sf
    from shardfusion import checkpoint as ckpt

    topo = sf.Topology(sharding=2, timeout=30)
    torch.manual_seed(0)
    model = sf.fully_shard(UnevenNet(), topo, units=(nn.Linear,))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out: dict = {"paths": []}
    for step in (1, 2, 3, 4):
        out["paths"].append(ckpt.save_checkpoint(model, opt, root, step, keep=2, extra={"step": step}))
    if topo.rank == 0:  # an interrupted save: a tmp folder, half written, must never become the latest
        os.makedirs(os.path.join(root, "tmp-step-5"), exist_ok=True)
        open(os.path.join(root, "tmp-step-5", "__0_0.distcp"), "wb").write(b"partial")
    torch.distributed.barrier()
    out["latest"] = ckpt.latest_checkpoint(root)
    out["listing"] = sorted(os.listdir(root))
    out["extra"] = ckpt.load(model, opt, out["latest"])
    # param groups of another count than the saved ones (1): left as they are
    params = list(model.parameters())
    two_groups = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "lr": 0.5}], lr=0.25)
    ckpt.load(model, two_groups, out["latest"])
    out["two_groups_lr"] = [g["lr"] for g in two_groups.param_groups]
    # a run resumed from an older checkpoint saves lower steps: what it publishes is kept, steps 3 and 4 (the
    # abandoned timeline) are left, lower ones are pruned, leftover tmp folders (tmp-step-5 above, tmp-step-0) go
    if topo.rank == 0:
        os.makedirs(os.path.join(root, "tmp-step-0"))
    ckpt.save_checkpoint(model, opt, root, 1, keep=3)
    out["resumed_listing_1"] = sorted(os.listdir(root))
    ckpt.save_checkpoint(model, opt, root, 2, keep=1)
    out["resumed_listing_2"] = sorted(os.listdir(root))
    out["resumed_latest"] = ckpt.latest_checkpoint(root)
    torch.manual_seed(0)
    other = sf.fully_shard(UnevenNetOther(), topo, units=(nn.Linear,))
    try:
        ckpt.load(other, None, out["latest"])
    except ValueError as e:
        out["mismatch"] = str(e)
    try:
        ckpt.load(model, None, os.path.join(root, "no-such-checkpoint"))
    except ValueError as e:
        out["unreadable"] = str(e)
    # problems found on one rank only raise on every rank, before anything is written (no hang)
    seen_by_rank_0_only = os.path.join(root, "step-4") if topo.rank == 0 else os.path.join(root, "step-9")
    out["unreadable_on_one_rank"] = _value_error(lambda: ckpt.load(model, opt, seen_by_rank_0_only))
    blocked = os.path.join(root, "blocked")
    if topo.rank == 0:
        open(blocked, "w").close()  # a file where rank 0 must create the root folder
    out["unpublishable"] = _value_error(lambda: ckpt.save_checkpoint(model, opt, blocked, 5))
    bad = os.path.join(root, "bad")
    not_a_tensor = {"seed": 3} if topo.rank == 1 else {}
    out["bad_rank_state"] = _value_error(lambda: ckpt.save(model, opt, bad, rank_state=not_a_tensor))
    first = dict(model.named_parameters())["a.weight"]
    if topo.rank == 0:
        opt.state[first]["factored"] = torch.zeros(2, 3)  # neither per-element nor scalar
    out["bad_state"] = _value_error(lambda: ckpt.save(model, opt, bad))
    opt.state.pop(first, None)
    out["bad_written"] = os.path.exists(os.path.join(bad, ".metadata"))
    tiny = UnevenNet()
    tiny.c.weight.tensor_model_parallel = True  # different values per mp rank: not handled, must raise
    tp_model = sf.fully_shard(tiny, sf.Topology(mp=2, timeout=30), units=(nn.Linear,))
    out["tp_save"] = _value_error(lambda: ckpt.save(tp_model, None, bad))
    out["tp_load"] = _value_error(lambda: ckpt.load(tp_model, None, out["latest"]))
    # a truncated data file that only rank 1 reads (same layout: rank 0 reads __0_0 only): ValueError on every rank
    torch.distributed.barrier()
    if topo.rank == 0:
        os.truncate(os.path.join(root, "step-4", "__1_0.distcp"), 100)
    torch.distributed.barrier()
    out["truncated"] = _value_error(lambda: ckpt.load(model, opt, os.path.join(root, "step-4")))
    return out


def _value_error(fn) -> str:
    """The message of the ValueError `fn()` raises ("" if none)."""
    try:
        fn()
    except ValueError as e:
        return str(e)
    return ""


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_atomic_publish_keep_and_key_errors(tmp_path):
    from shardfusion import checkpoint as ckpt
    root = str(tmp_path / "ckpts")
    results = run_distributed(_publish_job, 2, root, timeout=120)
    for r in results:
        assert r["latest"] == os.path.join(root, "step-4"), r["latest"]
        assert r["listing"] == ["latest", "step-3", "step-4", "tmp-step-5"], r["listing"]  # keep=2
        assert r["extra"] == {"step": 4}
        assert r["two_groups_lr"] == [0.25, 0.5], r["two_groups_lr"]
        assert r["resumed_listing_1"] == ["latest", "step-1", "step-3", "step-4"], r["resumed_listing_1"]
        assert r["resumed_listing_2"] == ["latest", "step-2", "step-3", "step-4"], r["resumed_listing_2"]  # keep=1
        assert r["resumed_latest"] == os.path.join(root, "step-2"), r["resumed_latest"]
        step4 = os.path.join(root, "step-4")
        assert r["truncated"].startswith(f"checkpoint {step4!r} cannot be read: __1_0.distcp has 100 bytes") and \
            any(f"rank 1: {kind}" in r["truncated"] for kind in ("EOFError", "RuntimeError")) and \
            "\n" not in r["truncated"], r["truncated"]  # which error depends on what the 100 bytes cut (the layout)
        msg = r["mismatch"]
        assert "missing from the checkpoint: ['extra_bias']" in msg, msg
        assert "c.weight model (4, 7) vs checkpoint (3, 7)" in msg, msg
        assert "no-such-checkpoint" in r["unreadable"] and "not readable" in r["unreadable"], r["unreadable"]
        assert "rank 1: rank_state['seed'] must be a tensor" in r["bad_rank_state"], r["bad_rank_state"]
        assert r["unreadable_on_one_rank"].startswith("rank 1: checkpoint folder") and \
            "step-9" in r["unreadable_on_one_rank"], r["unreadable_on_one_rank"]
        assert r["unpublishable"].startswith(f"cannot prepare '{root}/blocked/tmp-step-5': FileExistsError"), \
            r["unpublishable"]
        assert "rank 0: optimizer state 'factored' of 'a.weight' is a tensor of shape (2, 3)" in r["bad_state"], \
            r["bad_state"]
        assert not r["bad_written"]
        for key in ("tp_save", "tp_load"):
            assert ("rank 1: parameters ['c.weight'] are marked tensor_model_parallel=True but are plain tensors"
                    in r[key]), r[key]
    with pytest.raises(ValueError, match=r"cannot be read: __1_0\.distcp has 100 bytes, the metadata needs \d+ "
                                         r"\(\d+ keys: model/"):  # one process, no process group
        ckpt.read_all(os.path.join(root, "step-4"))


class Masked(nn.Module):
    """A Linear and a non-persistent mask buffer whose size is a constructor argument (a cache, not state)."""

    def __init__(self, max_len: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("mask", torch.ones(max_len, max_len).tril(), persistent=False)

    def forward(self, x):
        return self.fc(x)


def _nonpersistent_job(root: str) -> dict:
    import shardfusion as sf
    from shardfusion import checkpoint as ckpt
    topo = sf.Topology(sharding=2, timeout=30)
    torch.manual_seed(0)
    saved = sf.fully_shard(Masked(max_len=8), topo, units=(nn.Linear,))
    path = ckpt.save_checkpoint(saved, None, root, 1)
    torch.manual_seed(1)
    loaded = sf.fully_shard(Masked(max_len=16), topo, units=(nn.Linear,))  # another mask shape
    out = {"load": _value_error(lambda: ckpt.load(loaded, None, path)), "path": path,
           "saved": sf.full_state_dict(saved), "loaded": sf.full_state_dict(loaded), "mask": loaded.mask.clone()}
    full = {**sf.full_state_dict(saved), "mask": torch.zeros(3, 3)}  # e.g. an older export holding it: ignored
    out["load_full_state"] = _value_error(lambda: ckpt.load_full_state(loaded, full))
    out["mask_after"] = loaded.mask.clone()
    return out


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_nonpersistent_buffers_left_out(tmp_path):
    from safetensors.torch import load_file
    from shardfusion import checkpoint as ckpt
    from shardfusion.checkpoint.export import export
    results = run_distributed(_nonpersistent_job, 2, str(tmp_path / "ckpts"), timeout=120)
    plain_keys = sorted(Masked().state_dict())
    assert plain_keys == ["fc.bias", "fc.weight"]
    for r in results:
        assert r["load"] == "", r["load"]
        assert_bitwise(r["loaded"], r["saved"], "load")
        assert torch.equal(r["mask"], torch.ones(16, 16).tril())  # the model's own, not the saved one's
        assert r["load_full_state"] == "" and torch.equal(r["mask_after"], r["mask"]), r["load_full_state"]
    path = results[0]["path"]
    assert sorted(ckpt.read_meta(path)["buffer_shapes"]) == []
    full = ckpt.load_full(path)
    assert sorted(full) == plain_keys
    Masked().load_state_dict(full)  # strict
    target = export(path, str(tmp_path / "export"))
    assert sorted(load_file(target)) == plain_keys
