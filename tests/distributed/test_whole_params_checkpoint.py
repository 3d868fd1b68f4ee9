"""Whole parameters (``whole_params``) in checkpoints and state dicts, and the arguments ``fully_shard`` refuses.

One W=4 job (the GPT of tests/muon_reference.py; Muon with the Newton-Schulz iteration in fp32, so one process is
matched to 1e-5):

- *resume across owner layouts*: 2 steps at FSDP 4 (owners over 4 ranks), checkpoint with both optimizers, load into
  HSDP 2 x 2 (owners over 2 ranks: other owners), 1 more step: equals 3 steps of one process (the Muon momentum
  moved with its matrix);
- *whole to element-sharded and back*: the FSDP-4 checkpoint loaded (model only) into the same model without
  ``whole_params`` gives bitwise the saved ``full_state_dict``; saved from there and loaded into a whole-parameter
  model, bitwise again;
- *other optimizers*: a load given the optimizers in another order, or AdamW alone, is refused;
- *state dicts*: the fragments of a whole-parameter model hold each matrix in its shape on its owner and
  ``(0, *shape[1:])`` elsewhere, while ``model.state_dict()`` holds full-shape DTensors (DTensor's own chunks); after
  scrambling the parameters it loads back bitwise, and a full state dict (``full_state_dict``) loads into it too, and
  so does a safetensors file (``load_safetensors``).

A W=2 job: ``whole_params`` that is not callable, that chooses a parameter ``replicate_filter`` chooses too, or a
DTensor (mp 2), and a nested call with another ``whole_params``: a ``ValueError`` on every rank naming the argument.
"""

from __future__ import annotations

import pytest
import torch

import muon_reference as mr
from harness import raised, run_distributed
from reference import assert_bitwise, assert_close_dicts

JOB_TIMEOUT_S = 300
pytestmark = pytest.mark.timeout(JOB_TIMEOUT_S + 120)


def _full(model) -> dict:
    import shardfusion as sf
    return sf.full_state_dict(model, buffers=False)


def checkpoint_job(root: str) -> dict:
    import shardfusion as sf
    from shardfusion import checkpoint as ckpt

    out: dict = {}
    with mr.newton_schulz(fp32=True):
        topo, model = mr.build(dict(sharding=4))
        opts = mr.optimizers(model)
        mr.train(model, opts, mr.sharded_loss_fn(model, topo), range(mr.STEPS - 1))
        ckpt.save(model, opts, f"{root}/whole-fsdp4")
        saved = _full(model)

        topo, model = mr.build(dict(sharding=4, fsdp_outer_degree=2))
        opts = mr.optimizers(model)
        ckpt.load(model, opts, f"{root}/whole-fsdp4")
        resumed = mr.train(model, opts, mr.sharded_loss_fn(model, topo), range(mr.STEPS - 1, mr.STEPS))
        out["resumed"] = {"losses": resumed["losses"], "params": _full(model)}

    opts = mr.optimizers(model)  # the right optimizers, in another order; or AdamW alone over every parameter
    out["reversed"] = raised(lambda: ckpt.load(model, opts[::-1], f"{root}/whole-fsdp4"))
    out["adamw_only"] = raised(lambda: ckpt.load(model, torch.optim.AdamW(model.parameters()),
                                                 f"{root}/whole-fsdp4"))

    topo, plain = mr.build(dict(sharding=4), whole=False)
    ckpt.load(plain, None, f"{root}/whole-fsdp4")
    out["into_plain"] = (_full(plain), saved)
    ckpt.save(plain, None, f"{root}/plain")
    topo, model = mr.build(dict(sharding=4, fsdp_outer_degree=2))
    ckpt.load(model, None, f"{root}/plain")
    out["back_to_whole"] = (_full(model), saved)

    local = model.state_dict()  # full-shape DTensors (their chunks are copies), with the metadata
    copy = type(local)((k, v.clone()) for k, v in local.items())
    copy._metadata = local._metadata
    out["local_shapes"] = {k: (tuple(v.shape), tuple(v.to_local().shape)) for k, v in local.items()
                           if k.endswith("attn.q.weight")}
    out["fragment_shapes"] = {k: tuple(p.shape) for k, p in model.named_parameters() if k.endswith("attn.q.weight")}
    out["inner_rank"] = topo.inner_rank
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-2.0)
    model.load_state_dict(copy)
    out["local_round_trip"] = (_full(model), saved)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.load_state_dict(saved, strict=False)  # no buffers in `saved`
    out["full_round_trip"] = (_full(model), saved)

    import torch.distributed as dist
    from safetensors.torch import save_file
    if dist.get_rank() == 0:
        tied = {"lm_head.weight"}  # full_state_dict holds it as wte.weight too (one tensor), as state_dict() does
        save_file({k: v.contiguous() for k, v in saved.items() if k not in tied}, f"{root}/saved.safetensors")
    dist.barrier()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    sf.load_safetensors(model, f"{root}/saved.safetensors")
    out["safetensors"] = (_full(model), saved)
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return run_distributed(checkpoint_job, 4, str(tmp_path_factory.mktemp("whole")), timeout=JOB_TIMEOUT_S)


def test_resume_across_owner_layouts_matches_single_process(job):
    want = mr.reference(dp_world=4, fp32=True)
    for r in job:
        torch.testing.assert_close(r["resumed"]["losses"][0], want["losses"][-1], rtol=mr.RTOL, atol=mr.ATOL)
        assert_close_dicts(r["resumed"]["params"], want["params"], "resumed FSDP 4 -> HSDP 2 x 2",
                           atol=mr.PARAM_ATOL)


@pytest.mark.parametrize("key", ["into_plain", "back_to_whole", "local_round_trip", "full_round_trip", "safetensors"])
def test_whole_parameters_load_bitwise_into_either_layout(job, key):
    for r in job:
        got, want = r[key]
        assert_bitwise(got, want, f"{key}, inner rank {r['inner_rank']}")


@pytest.mark.parametrize("key", ["reversed", "adamw_only"])
def test_other_optimizers_than_saved_are_refused(job, key):
    """Saved with [Muon, AdamW]: a load given them in another order, or AdamW alone, would give each group another
    optimizer's hyperparameters and each parameter another optimizer's state: refused on every rank."""
    for r in job:
        kind, msg = r[key]
        assert kind == "ValueError" and "['Muon', 'AdamW']" in msg and "same order" in msg, (kind, msg)


def test_fragments_are_whole_matrices_on_owners_and_state_dict_full_dtensors(job):
    for name in job[0]["fragment_shapes"]:
        shapes = [r["fragment_shapes"][name] for r in job]
        owners = [s for s in shapes if s == (32, 32)]
        assert len(owners) == 2 and all(s in ((32, 32), (0, 32)) for s in shapes), f"{name}: {shapes}"  # 2 replicas
        # model.state_dict(): the full shape, DTensor's Shard(0) chunk over the inner group of 2 on every rank
        assert all(r["local_shapes"][name] == ((32, 32), (16, 32)) for r in job), [r["local_shapes"] for r in job]


def errors_job() -> dict:
    import torch.nn as nn

    import shardfusion as sf
    from shardfusion.models import GPT, Block
    from shardfusion.models.gpt_parallel import parallelize

    def model():
        torch.manual_seed(0)
        return GPT(mr.config())

    topo = sf.Topology(sharding=2)
    out = {"not_callable": raised(lambda: sf.fully_shard(model(), topo, whole_params="matrices")),
           "both": raised(lambda: sf.fully_shard(model(), topo, whole_params=mr.is_block_matrix,
                                                 replicate_filter=lambda n, p: n.endswith("attn.q.weight")))}
    mp = sf.Topology(mp=2, sharding=1)
    out["dtensor"] = raised(lambda: sf.fully_shard(parallelize(model(), mp.get_mesh("mp")), mp, units=(Block,),
                                                   whole_params=mr.is_block_matrix))

    def nested():
        m = model()
        sf.fully_shard(m.blocks[0], topo, whole_params=lambda n, p: p.dim() == 2)
        sf.fully_shard(m, topo, units=(Block,), whole_params=mr.is_block_matrix)

    out["nested"] = raised(nested)
    out["linear"] = isinstance(model().blocks[0].attn.q, nn.Linear)
    return out


def test_bad_whole_params_are_refused_on_every_rank():
    rs = run_distributed(errors_job, 2, timeout=JOB_TIMEOUT_S)
    words = {"not_callable": ["whole_params", "callable"], "both": ["replicate_filter", "whole_params", "attn.q"],
             "dtensor": ["whole_params", "tensor-parallel", "local piece"], "nested": ["whole_params"]}
    for r in rs:
        for key, want in words.items():
            kind, msg = r[key]
            assert kind == "ValueError", f"{key}: {kind}: {msg}"
            for w in want:
                assert w in msg, f"{key}: the message should say {w!r}: {msg}"
