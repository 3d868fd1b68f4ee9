"""shardfusion under PyTorch Lightning: :class:`ShardfusionStrategy` for ``pytorch_lightning.Trainer`` and
:class:`ShardfusionFabricStrategy` for ``lightning_fabric.Fabric`` (docs/lightning.md, "From Lightning").

    from shardfusion.lightning import ShardfusionStrategy
    trainer = pytorch_lightning.Trainer(strategy=ShardfusionStrategy(fsdp_outer_degree=2, units=(Block,)),
                                        devices=4, accelerator="cpu")

Needs the ``lightning`` extra (``pip install 'shardfusion[lightning]'``: pytorch-lightning and lightning-fabric
2.6 or newer); ``import shardfusion`` never imports it. The modules: ``strategy.py`` (the Trainer's), ``fabric.py``
(Fabric's), ``_options.py`` (the keywords and the precision setting, shared), ``_checkpoint.py`` (the sharded and
full checkpoints, shared).
"""

try:
    import lightning_fabric  # noqa: F401
    import pytorch_lightning  # noqa: F401
except ImportError as error:
    raise ImportError(f"shardfusion.lightning needs the lightning extra: pip install 'shardfusion[lightning]' "
                      f"({error.msg})") from None

from shardfusion.lightning.fabric import ShardfusionFabricStrategy
from shardfusion.lightning.strategy import ShardedRoot, ShardfusionStrategy

__all__ = ["ShardedRoot", "ShardfusionFabricStrategy", "ShardfusionStrategy"]
