"""The Lightning runs that tests/integration/test_lightning.py checks, launched by Lightning itself.

    python tests/integration/lightning_runs.py w4 OUT     # 4 CPU processes (Lightning's launcher starts 3 more)
    python tests/integration/lightning_runs.py w2 OUT     # 2 processes: resumes from w4's checkpoints

The first ``Trainer.fit`` launches the other processes (they run this script from the start); later Trainers and
Fabrics of the same phase reuse them and the process group, so process start-up is paid once per phase. Rank 0
writes each run's record to ``OUT/<run>.pt``: the global mean loss of every micro-batch, the global gradient norm
before every optimizer step, the logged validation loss, and the full parameters at the end.

The data: ``N_SEQ`` random byte sequences (seed 0); every run draws 8 sequences per optimizer step (per-device batch
and accumulation set from the world size), shuffled by Lightning's ``DistributedSampler`` (seed 0, per epoch).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import pytorch_lightning as pl
from lightning_fabric import Fabric
from torch.utils.data import DataLoader, Dataset

import shardfusion as sf
from shardfusion.lightning import ShardfusionFabricStrategy, ShardfusionStrategy
from shardfusion.models.gpt import GPT, Block, GPTConfig

CONFIG = GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16)
N_SEQ = 48
"""Sequences in the training set: 6 optimizer steps of 8 per epoch."""
GLOBAL_BATCH = 8
ACCUMULATE = 2
WORLD = {"w4": 4, "w2": 2}
"""Processes of each phase."""
CLIP = 0.5
"""Global-norm clip: below the first steps' norms, so clipping is active."""


class Sequences(Dataset):
    """``n`` random byte sequences of ``CONFIG.seq_len + 1`` tokens (inputs and next-byte targets)."""

    def __init__(self, n: int, seed: int) -> None:
        self.tokens = torch.randint(0, 256, (n, CONFIG.seq_len + 1), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i]


class LitGPT(pl.LightningModule):
    """An ordinary LightningModule: nothing in it knows the strategy."""

    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(CONFIG)
        self.compute_dtypes: list[torch.dtype] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.compute_dtypes.append(self.model.wte.weight.dtype)
        _, loss = self.model(batch[:, :-1], batch[:, 1:])
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        _, loss = self.model(batch[:, :-1], batch[:, 1:])
        self.log("val_loss", loss, sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        per_device = GLOBAL_BATCH // (self.trainer.world_size * ACCUMULATE)
        return DataLoader(Sequences(N_SEQ, 0), batch_size=per_device, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Sequences(16, 1), batch_size=2)


class Record(pl.Callback):
    """The global mean loss of each micro-batch, the global gradient norm before each optimizer step, shardfusion's
    gradient reductions in each micro-batch (``{"reduce_scatter": n, "outer_all_reduce": n}``: reduce-scatters,
    and all-reduces over groups smaller than the world, i.e. HSDP's replicas); optionally a checkpoint at the end of
    epoch ``save_epoch`` (an epoch boundary) with ``trainer.save_checkpoint``."""

    def __init__(self, save_at: str | None = None, save_epoch: int = 0) -> None:
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.reductions: list[dict[str, int]] = []
        self.save_at, self.save_epoch = save_at, save_epoch
        self._counter: sf.comm.CommCounter | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._counter = sf.comm.CommCounter().__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._counter.__exit__(None, None, None)
        records = self._counter.records
        self.reductions.append({
            "reduce_scatter": sum(r.op == "reduce_scatter" for r in records),
            "outer_all_reduce": sum(r.op == "all_reduce" and len(r.group_ranks) < trainer.world_size
                                    for r in records)})
        self.losses.append(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean").item())

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        norm = torch.nn.utils.clip_grad_norm_(pl_module.parameters(), float("inf"))  # global on fragments
        self.norms.append(norm.item())

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self.save_at is not None and trainer.current_epoch == self.save_epoch:
            trainer.save_checkpoint(self.save_at)


def full_parameters(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, torch.Tensor]:
    """Every parameter of ``module`` in full (collective under the shardfusion strategy)."""
    if isinstance(trainer.strategy, ShardfusionStrategy):
        full = sf.full_state_dict(trainer.strategy.model)
        return {k.removeprefix("module."): v for k, v in full.items()}
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def fit(name: str, out: Path, strategy, *, epochs: int = 2, precision: str = "32-true", save_at: str | None = None,
        ckpt_path: str | None = None, empty_init: bool = False) -> None:
    """One ``Trainer.fit`` of a fresh ``LitGPT`` (seed 42) for ``epochs`` epochs; rank 0 writes ``OUT/<name>.pt``."""
    pl.seed_everything(42, verbose=False)
    world = WORLD[sys.argv[1]]
    record = Record(save_at)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, precision=precision, max_epochs=epochs,
                         accumulate_grad_batches=ACCUMULATE, gradient_clip_val=CLIP, limit_val_batches=2,
                         num_sanity_val_steps=1, callbacks=[record], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with trainer.init_module(empty_init=empty_init):
        module = LitGPT()
    trainer.fit(module, ckpt_path=ckpt_path)
    params = full_parameters(trainer, module)
    if trainer.global_rank == 0:
        torch.save({"losses": record.losses, "norms": record.norms, "params": params, "reductions": record.reductions,
                    "val_loss": float(trainer.callback_metrics["val_loss"]), "global_step": trainer.global_step,
                    "compute_dtypes": sorted({str(d) for d in module.compute_dtypes})}, out / f"{name}.pt")


def fabric_run(name: str, out: Path, strategy, *, save_at: str | None = None) -> None:
    """A Fabric loop over one epoch (6 optimizer steps of 2 accumulated micro-batches, clipped); rank 0 writes
    ``OUT/<name>.pt`` as :func:`fit` does."""
    fabric = Fabric(accelerator="cpu", devices=4, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(42, verbose=False)
    model = fabric.setup_module(GPT(CONFIG))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1))
    loader = fabric.setup_dataloaders(DataLoader(Sequences(N_SEQ, 0), batch_size=1, shuffle=True))
    losses, norms = [], []
    for i, batch in enumerate(loader):
        last = i % ACCUMULATE == ACCUMULATE - 1
        with fabric.no_backward_sync(model, enabled=not last):
            _, loss = model(batch[:, :-1], batch[:, 1:])
            fabric.backward(loss / ACCUMULATE)
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
        if last:
            norms.append(fabric.clip_gradients(model, optimizer, max_norm=CLIP).item())
            optimizer.step()
            optimizer.zero_grad()
    if save_at is not None:
        fabric.save(save_at, {"model": model, "optimizer": optimizer, "step": len(norms)})
    if isinstance(strategy, ShardfusionFabricStrategy):
        params = sf.full_state_dict(model._forward_module)
    else:
        params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if fabric.global_rank == 0:
        torch.save({"losses": losses, "norms": norms, "params": params}, out / f"{name}.pt")


def fabric_load(name: str, out: Path, path: str) -> None:
    """Load a Fabric checkpoint into a fresh sharded GPT at this world size; rank 0 writes its full parameters and
    the restored ``step``."""
    fabric = Fabric(accelerator="cpu", devices=2, strategy=ShardfusionFabricStrategy(units=(Block,)))
    fabric.launch()
    model = fabric.setup_module(GPT(CONFIG))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(path, state)
    params = sf.full_state_dict(model._forward_module)
    if fabric.global_rank == 0:
        torch.save({"params": params, "step": state["step"], "optimizer_steps": _adam_step(optimizer)},
                   out / f"{name}.pt")


def _adam_step(optimizer) -> list[float]:
    return sorted({float(s["step"]) for s in optimizer.state.values()})


def main() -> None:
    phase, out = sys.argv[1], Path(sys.argv[2])
    units = (Block,)
    if phase == "w4":
        fit("ddp", out, "ddp")
        fit("fsdp", out, ShardfusionStrategy(units=units, save_distributed_checkpoint=False),
            save_at=str(out / "full.ckpt"))
        fit("hsdp", out, ShardfusionStrategy(fsdp_outer_degree=2, units=units), save_at=str(out / "sharded.ckpt"),
            empty_init=True)
        fit("ddp_bf16", out, "ddp", epochs=1, precision="bf16-mixed")
        fit("fsdp_bf16", out, ShardfusionStrategy(units=units), epochs=1, precision="bf16-mixed")
        fabric_run("fabric_ddp", out, "ddp")
        fabric_run("fabric_hsdp", out, ShardfusionFabricStrategy(fsdp_outer_degree=2, units=units),
                   save_at=str(out / "fabric.ckpt"))
    else:
        fit("resume_sharded", out, ShardfusionStrategy(units=units), ckpt_path=str(out / "sharded.ckpt"))
        fit("resume_full", out, ShardfusionStrategy(units=units), ckpt_path=str(out / "full.ckpt"))
        fit("resume_full_ddp", out, "ddp", ckpt_path=str(out / "full.ckpt"))
        fabric_load("fabric_load", out, str(out / "fabric.ckpt"))


if __name__ == "__main__":
    main()
