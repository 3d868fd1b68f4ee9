"""The full gradient buffer is allocated uninitialized, and each parameter's first gradient is copied into its slice
([Note: first gradient by copy] in shardfusion/_runtime/flat_buffer.py): nothing may read a slice no gradient wrote.

Every ``torch.empty`` of ``flat_buffer.py`` is poisoned (filled with NaN) in the workers, so a slice, a padding
element or a receive buffer read before it is written turns the run's losses and parameters into NaN; each case must
still equal the single-process reference. The cases are where a slice gets no gradient: a unit that does not run on
some steps (its whole buffer), a buffer shared by parameters that get gradients and one that gets none (everything in
the root unit), micro-batches accumulated with gradient sync off (the second gradient adds into the slice the first
wrote), the same under mixed precision (the buffer is summed into the fp32 accumulator and then overwritten), HSDP
resharded after backward, and gradients quantized in blocks for the reduce-scatter and the outer all-reduce (a block's
scale is read from every element of it, the padding between parameters included).
"""

from __future__ import annotations

import pytest
import torch

from reference import Case, CaseJobs, check_parity, reference_train, run_cases

WORLD = 4
APPROX_LOSS_RTOL = 0.02  # per step, against the fp32 reference
CASES = [
    Case(name="skip-unit", model="skip", optim="sgd", lr=0.1),
    Case(name="skip-one-buffer", model="skip", units="none", optim="sgd", lr=0.1),
    Case(name="skip-no-sync", model="skip", units="none", micro=2, no_sync=True, optim="sgd", lr=0.1),
    Case(name="transformer-hsdp-no-sync", outer=2, reshard_policy="after_backward", micro=2, no_sync=True,
         clip=(0.5, 2.0)),
    Case(name="transformer-bf16-no-sync", micro=2, no_sync=True, param_dtype="bfloat16"),
    Case(name="transformer-int8-grads", outer=2, grad_comm_dtype="int8", outer_comm_dtype="int8"),
]
APPROX = {"transformer-bf16-no-sync": {"param_dtype": None},
          "transformer-int8-grads": {"grad_comm_dtype": None, "outer_comm_dtype": None}}
"""Cases compared with the fp32 reference by loss only (rounded compute or quantized communication): what the
reference runs instead."""


class _PoisonedTorch:
    """``torch`` as ``flat_buffer.py`` sees it, but ``empty`` returns NaN-filled floating-point tensors."""

    def __init__(self, real) -> None:
        self._real = real

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def empty(self, *args, **kwargs):
        t = self._real.empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t


def poisoned_cases(cases: list[Case]) -> dict:
    import shardfusion._runtime.flat_buffer as flat_buffer

    flat_buffer.torch = _PoisonedTorch(torch)
    return run_cases(cases)


@pytest.fixture(scope="module")
def jobs() -> CaseJobs:
    return CaseJobs({WORLD: CASES}, worker=poisoned_cases)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_unwritten_gradient_slices_are_never_read(jobs: CaseJobs, name: str):
    case = jobs.case(name)
    rs = jobs.results(case)
    for r in rs:
        assert all(loss == loss for loss in r["losses"]), f"{name}: a NaN loss: {r['losses']}"
    for r in rs:
        assert all(bool(t.isfinite().all()) for t in r["params"][-1].values() if t is not None), name
    if name not in APPROX:
        check_parity(rs, reference_train(case), name)
        return
    want = torch.tensor(reference_train(case.with_(**APPROX[name]))["losses"])
    got = torch.tensor(rs[0]["losses"])
    assert ((got - want).abs() / want.abs()).max().item() <= APPROX_LOSS_RTOL, f"{name}: {got} vs fp32 {want}"


IDX = torch.tensor([[1, 2, 3], [4, 5, 1]])  # (2, 3): one row of token ids per rank


def _sparse_embedding_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Flatten(), torch.nn.Linear(12, 1))


def sparse_embedding_job() -> list:
    import torch.distributed as dist
    import shardfusion as sf

    model = sf.fully_shard(_sparse_embedding_model(), sf.Topology(sharding=2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):  # the second step starts from a buffer freed and allocated again
        model(IDX[dist.get_rank()][None]).sum().backward()
        opt.step()
        opt.zero_grad()
    return sf.full_state_dict(model)


@pytest.mark.timeout(120)
def test_sparse_embedding_gradient_is_added_into_its_slice():
    """A sparse gradient (``nn.Embedding(sparse=True)``) cannot be copied into a dense slice: it is added into the
    zeroed slice; the run equals plain PyTorch on the concatenated batch (the mean of the ranks' losses)."""
    from harness import run_distributed

    got = run_distributed(sparse_embedding_job, 2)
    ref = _sparse_embedding_model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        (ref(IDX).sum() / 2).backward()
        opt.step()
        opt.zero_grad()
    for name, want in ref.state_dict().items():
        torch.testing.assert_close(got[0][name], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
