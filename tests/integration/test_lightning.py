"""shardfusion.lightning: the Trainer and Fabric strategies against Lightning's own DDP (docs/lightning.md).

The runs are in tests/integration/lightning_runs.py, launched by Lightning's own launcher on CPU / gloo: phase
``w4`` (4 processes, every W=4 run in one launch) then phase ``w2`` (2 processes, resuming from ``w4``'s
checkpoints). Each test reads the records the runs wrote; the references are Lightning's ``"ddp"`` strategy for the
Trainer and Fabric over the same ``LightningModule``, data and seeds.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness import REPO, clean_env, run_command

SCRIPT = Path(__file__).with_name("lightning_runs.py")
LAUNCH_TIMEOUT_S = 300
TIMEOUT_S = 2 * LAUNCH_TIMEOUT_S + 60  # a test may start both launches (module fixtures)
LOSS_RTOL = 1e-5
CLIP = 0.5  # lightning_runs.CLIP


def _launch(phase: str, out: Path) -> None:
    result = run_command([sys.executable, str(SCRIPT), phase, str(out)], timeout=LAUNCH_TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """The folder of the W=4 runs' records and checkpoints."""
    out = tmp_path_factory.mktemp("lightning")
    _launch("w4", out)
    return out


@pytest.fixture(scope="module")
def resumed(runs) -> Path:
    """The same folder after the W=2 runs that resume from the W=4 checkpoints."""
    _launch("w2", runs)
    return runs


def _read(folder: Path, name: str) -> dict:
    return torch.load(folder / f"{name}.pt", weights_only=False)


def _assert_params_close(got: dict, want: dict, atol: float) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=atol, msg=name)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("run", ["fsdp", "hsdp"])
def test_trainer_matches_ddp(runs, run):
    """12 optimizer steps (2 epochs, 2 accumulated micro-batches each, clipped to a global norm, validation logged
    with sync_dist) under FSDP 4 and HSDP 2 x 2 (built on the meta device) give DDP's losses, norms, validation loss
    and parameters."""
    ddp, sharded = _read(runs, "ddp"), _read(runs, run)
    assert sharded["global_step"] == ddp["global_step"] == 12
    torch.testing.assert_close(torch.tensor(sharded["losses"]), torch.tensor(ddp["losses"]), rtol=LOSS_RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(sharded["norms"]), torch.tensor(ddp["norms"]), rtol=LOSS_RTOL, atol=0)
    assert max(ddp["norms"]) > CLIP  # the clip acted, on the global norm
    assert sharded["val_loss"] == pytest.approx(ddp["val_loss"], rel=LOSS_RTOL)
    _assert_params_close(sharded["params"], ddp["params"], atol=2e-5)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("run", ["fsdp", "hsdp"])
def test_accumulation_reduces_once_per_step(runs, run):
    """With accumulate_grad_batches=2 the first micro-batch of each step reduces nothing; the second reduce-scatters
    (and, under HSDP, all-reduces over the replicas) once per flat buffer."""
    reductions = _read(runs, run)["reductions"]
    first, last = reductions[0::2], reductions[1::2]
    assert all(r == {"reduce_scatter": 0, "outer_all_reduce": 0} for r in first), first
    assert len({r["reduce_scatter"] for r in last}) == 1 and last[0]["reduce_scatter"] > 0, last
    outer = {r["outer_all_reduce"] for r in last}
    assert outer == ({last[0]["reduce_scatter"]} if run == "hsdp" else {0}), last


@pytest.mark.timeout(TIMEOUT_S)
def test_resume_across_layouts(resumed):
    """A sharded checkpoint saved by trainer.save_checkpoint at the end of epoch 1 under HSDP 2 x 2 at W=4 resumes
    (ckpt_path=) under FSDP 2 at W=2 with the same 8 sequences per step and ends within 1e-4 of the uninterrupted
    DDP run at W=4 (epoch 2's losses within 1e-5: the optimizer, scheduler and data order continue)."""
    ddp, run = _read(resumed, "ddp"), _read(resumed, "resume_sharded")
    assert run["global_step"] == 12
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ddp["losses"][12:]), rtol=LOSS_RTOL, atol=0)
    _assert_params_close(run["params"], ddp["params"], atol=1e-4)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("run", ["resume_full", "resume_full_ddp"])
def test_full_checkpoint(resumed, run):
    """save_distributed_checkpoint=False writes one file in plain Lightning's format (the module's own names and
    shapes): it resumes under the strategy at W=2 and under Lightning's DDP at W=2, both within 1e-4 of the
    uninterrupted run."""
    ddp = _read(resumed, "ddp")
    checkpoint = torch.load(resumed / "full.ckpt", weights_only=False)
    assert {k: v.shape for k, v in checkpoint["state_dict"].items()} == {k: v.shape for k, v in ddp["params"].items()}
    assert all(isinstance(k, int) for k in checkpoint["optimizer_states"][0]["state"])  # as torch keys them
    out = _read(resumed, run)
    torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ddp["losses"][12:]), rtol=LOSS_RTOL, atol=0)
    _assert_params_close(out["params"], ddp["params"], atol=1e-4)


@pytest.mark.timeout(TIMEOUT_S)
def test_bf16_mixed(runs):
    """precision="bf16-mixed" computes with bf16 parameters (MixedPrecisionPolicy(param_dtype=bfloat16)) and stays
    close to Lightning's DDP under bf16 autocast (fp32 parameters there)."""
    ddp, sharded = _read(runs, "ddp_bf16"), _read(runs, "fsdp_bf16")
    assert sharded["compute_dtypes"] == ["torch.bfloat16"] and ddp["compute_dtypes"] == ["torch.float32"]
    torch.testing.assert_close(torch.tensor(sharded["losses"]), torch.tensor(ddp["losses"]), rtol=1e-3, atol=0)
    _assert_params_close(sharded["params"], ddp["params"], atol=3e-2)


@pytest.mark.timeout(TIMEOUT_S)
def test_fabric_matches_ddp(resumed):
    """A Fabric loop (no_backward_sync accumulation, clip_gradients, all_reduce) under ShardfusionFabricStrategy
    with HSDP 2 x 2 gives Fabric DDP's losses, norms and parameters; its fabric.save checkpoint loads at W=2 with the
    same parameters, the optimizer's step count and the state's other entries."""
    ddp, sharded = _read(resumed, "fabric_ddp"), _read(resumed, "fabric_hsdp")
    torch.testing.assert_close(torch.tensor(sharded["losses"]), torch.tensor(ddp["losses"]), rtol=LOSS_RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(sharded["norms"]), torch.tensor(ddp["norms"]), rtol=LOSS_RTOL, atol=0)
    _assert_params_close(sharded["params"], ddp["params"], atol=2e-5)
    loaded = _read(resumed, "fabric_load")
    assert loaded["step"] == 6 and loaded["optimizer_steps"] == [6.0]
    _assert_params_close(loaded["params"], sharded["params"], atol=0)


def test_keywords_refused():
    """Keywords that do not map: pp, a name fully_shard does not take; precision plugins of other engines."""
    from pytorch_lightning import Trainer
    from pytorch_lightning.plugins.precision import DeepSpeedPrecision

    import shardfusion as sf
    from shardfusion.lightning import ShardfusionFabricStrategy, ShardfusionStrategy

    for cls in (ShardfusionStrategy, ShardfusionFabricStrategy):
        with pytest.raises(ValueError, match="pp=2 is not supported"):
            cls(pp=2)
        with pytest.raises(ValueError, match="unknown keyword.*outer_degree"):
            cls(outer_degree=2)
    with pytest.raises(ValueError, match="DeepSpeedPrecision.*not supported"):
        Trainer(strategy=ShardfusionStrategy(), plugins=[DeepSpeedPrecision("bf16-mixed")], accelerator="cpu",
                devices=1, logger=False)
    options = ShardfusionStrategy(mp_policy=sf.MixedPrecisionPolicy(param_dtype=torch.float16))._options
    with pytest.raises(ValueError, match="precision='bf16-mixed' computes in torch.bfloat16 but mp_policy.param_dtype"):
        options.mp_policy("bf16-mixed")
    assert options.mp_policy("32-true").param_dtype is torch.float16  # the policy alone


def test_import_needs_the_extra():
    """In an environment with torch alone, `import shardfusion` works and `import shardfusion.lightning` raises one
    ImportError line naming the extra."""
    code = ("import sys; sys.path.insert(0, 'tests'); import torch_only; torch_only.block(); import shardfusion\n"
            "try:\n    import shardfusion.lightning\nexcept ImportError as e:\n    print('ERR', e)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    line = result.stdout.strip()
    assert line.startswith("ERR shardfusion.lightning needs the lightning extra: pip install 'shardfusion[lightning]'")
    assert "\n" not in line
