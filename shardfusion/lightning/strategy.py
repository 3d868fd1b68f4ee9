"""``ShardfusionStrategy``: shardfusion's FSDP / HSDP as a ``pytorch_lightning.Trainer`` strategy.

How a ``Trainer`` run maps onto the library (docs/lightning.md, "From Lightning"):

- launch: Lightning's own launcher (``devices``, ``num_nodes``, ``accelerator``); :meth:`setup_environment` joins
  the process group (gloo on CPU, NCCL on GPUs) and builds the :class:`shardfusion.Topology` from the degrees, so
  ``configure_model`` can read ``self.trainer.strategy.topology`` (e.g. an expert layer's ``ep_group``);
- the model: ``configure_model`` runs first (under ``trainer.init_module(empty_init=True)`` or inside
  ``configure_model``'s own ``torch.device("meta")``, layers are built on the meta device); :meth:`setup` then wraps
  the ``LightningModule`` in :class:`ShardedRoot` and shards that with :func:`shardfusion.fully_shard` (meta tensors
  materialized module by module), and only then calls ``configure_optimizers``;
- each step: Lightning's forward redirection calls ``training_step`` / ``validation_step`` through the sharded root,
  so the root unit is gathered for the whole step (as DDP wraps the module); ``accumulate_grad_batches`` runs the
  micro-batches before the last under :func:`shardfusion.no_sync` (one reduction per optimizer step);
  ``gradient_clip_val`` clips by the global norm (``torch.nn.utils.clip_grad_norm_`` on fragments);
- ``precision``: ``"bf16-mixed"`` / ``"16-mixed"`` set the policy's ``param_dtype`` (``_options.PRECISION_DTYPES``);
- checkpoints: ``trainer.save_checkpoint`` / ``ckpt_path=`` as a sharded folder that loads into any layout, or
  one full file (``save_distributed_checkpoint=False``): ``_checkpoint.py``.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Generator, Mapping, Optional, Sequence, Union

import torch
import torch.nn as nn
from lightning_fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning_fabric.utilities.distributed import _sync_ddp_if_available
from lightning_fabric.utilities.distributed import group as _group
from lightning_fabric.utilities.optimizer import _optimizers_to_device
from pytorch_lightning.core.optimizer import LightningOptimizer
from pytorch_lightning.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from pytorch_lightning.strategies.launchers import _SubprocessScriptLauncher
from pytorch_lightning.strategies.parallel import ParallelStrategy
from pytorch_lightning.trainer.states import TrainerFn

import shardfusion as sf
from shardfusion._runtime.state import is_sharded, sharded_state
from shardfusion.lightning import _checkpoint, _launch, _options

__all__ = ["ShardedRoot", "ShardfusionStrategy"]

_PRECISIONS = (Precision, MixedPrecision, HalfPrecision, DoublePrecision)
"""The Trainer's precision plugins the strategy maps (``_options.check_precision``)."""

_ROOTS: "weakref.WeakKeyDictionary[nn.Module, ShardedRoot]" = weakref.WeakKeyDictionary()
"""LightningModule -> the sharded root holding it, so a later ``fit`` / ``validate`` reuses the wrap."""


class ShardedRoot(nn.Module):
    """The model :func:`shardfusion.fully_shard` shards: the ``LightningModule`` as its one child ``module``.

    Lightning calls it for every step (the step's arguments go through ``forward`` to the patched module), so the
    root unit (the parameters outside every unit) is gathered once around the whole ``training_step`` whatever it
    calls inside, as DDP's wrapper does. Its ``training`` flag is the module's (Lightning switches the module's).
    Parameter names are the module's, prefixed with ``module.``.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    @property
    def training(self) -> bool:  # type: ignore[override]
        return self.module.training if "module" in self._modules else True

    @training.setter
    def training(self, value: bool) -> None:  # nn.Module.__init__ and .train() set it: the module's flag rules
        pass

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class ShardfusionStrategy(ParallelStrategy):
    """FSDP / HSDP with fused flat buffers (:func:`shardfusion.fully_shard`) for ``pytorch_lightning.Trainer``.

    ``Trainer(strategy=ShardfusionStrategy(fsdp_outer_degree=2, units=(Block,)), devices=4, accelerator="cpu")``:
    the ``LightningModule`` stays as it is (build its layers in ``__init__`` or ``configure_model``; build the
    optimizer in ``configure_optimizers`` from ``self.parameters()``).

    Args:
        dp, sharding, fsdp_outer_degree, ep, mp, sep, cp: the degrees of :class:`shardfusion.Topology` (default: plain
            FSDP over the world, ``sharding=-1``). With ``ep``, ``mp``, ``sep`` or ``cp`` the module builds its
            expert, tensor- or context-parallel layers in ``configure_model`` from ``self.trainer.strategy.topology``
            (docs/lightning.md).
        pp: refused unless 1 (Lightning's loop has no pipeline schedule).
        units: module classes that each form a unit (``fully_shard(units=)``).
        save_distributed_checkpoint: ``True``: ``trainer.save_checkpoint(path)`` writes a sharded folder that
            loads into any layout; ``False``: one full file on rank 0 that plain Lightning loads.
        timeout: the process group's and the topology's collective timeout.
        arrival_timeout: :class:`shardfusion.Topology`'s arrival deadline in seconds (``None``: its default).
        process_group_backend: ``None``: ``"nccl"`` on GPUs, ``"gloo"`` on CPUs.
        **fully_shard_options: the other keywords of :func:`shardfusion.fully_shard` (``mp_policy``,
            ``reshard_policy``, ``prefetch``, ``init_fn``, ``outer_comm_dtype``, ...).

    Raises:
        ValueError: at construction: ``pp`` other than 1, a keyword :func:`shardfusion.fully_shard` does not take;
            when the Trainer attaches its precision plugin: an unsupported ``precision``
            (``_options.check_precision``); at launch, on every rank: degrees that do not fit the world size; at
            setup: anything :func:`shardfusion.fully_shard` refuses.
    """

    strategy_name = "shardfusion"

    def __init__(self, *, dp: int = 1, sharding: int = -1, fsdp_outer_degree: int = 1, ep: int = 1, mp: int = 1,
                 sep: int = 1, cp: int = 1, pp: int = 1, units: Optional[Sequence[type]] = None,
                 save_distributed_checkpoint: bool = True, timeout: Optional[timedelta] = default_pg_timeout,
                 arrival_timeout: Optional[float] = None, process_group_backend: Optional[str] = None,
                 **fully_shard_options: Any) -> None:
        super().__init__()
        degrees = dict(dp=dp, sharding=sharding, fsdp_outer_degree=fsdp_outer_degree, ep=ep, mp=mp, sep=sep, cp=cp)
        self._options = _options.ShardOptions.from_keywords(type(self).__name__, degrees, pp,
                                                            dict(fully_shard_options, units=units), timeout,
                                                            arrival_timeout)
        self._save_distributed_checkpoint = bool(save_distributed_checkpoint)
        self._timeout = timeout
        self._process_group_backend = process_group_backend
        self._topology: Optional[sf.Topology] = None
        self._num_nodes = 1
        self._full_checkpoint_loaded = False  # load_checkpoint read a full file: load_model_state_dict loads it

    # -- placement -------------------------------------------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """True: Lightning then gives each data-parallel rank its own ``DistributedSampler`` shard."""
        return True

    @property
    def topology(self) -> sf.Topology:
        """The :class:`shardfusion.Topology` of the run (from :meth:`setup_environment` on).

        Raises:
            RuntimeError: read before the processes have joined the process group.
        """
        if self._topology is None:
            raise RuntimeError("ShardfusionStrategy.topology is built when the processes start (setup_environment)")
        return self._topology

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return _options.sampler_kwargs(self.topology)

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        if plugin is not None:
            _options.check_precision(type(self).__name__, plugin, _PRECISIONS)
        self._precision_plugin = plugin

    # -- launch and setup ------------------------------------------------------------------------------------------
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        super().setup_environment()
        assert self.cluster_environment is not None
        self._process_group_backend = _launch.connect(self)
        self._topology = self._options.topology()

    def set_world_ranks(self) -> None:
        _launch.set_world_ranks(self)

    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """``trainer.init_module(empty_init=True)`` builds on the meta device (materialized by the wrap, each
        module by its ``reset_parameters`` or ``init_fn``); otherwise on the root device."""
        device = torch.device("meta") if empty_init else self.root_device
        with device, self.precision_plugin.tensor_init_context():
            yield

    def setup(self, trainer) -> None:
        """Shard the module (after ``configure_model``), then build the optimizers from the fragments."""
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        self.model = self._shard(self.lightning_module)
        if trainer.state.fn == TrainerFn.FITTING:
            self._reset_optimizers_and_schedulers()  # a second fit builds them again, over the same fragments
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _shard(self, module: nn.Module) -> ShardedRoot:
        root = _ROOTS.get(module)
        if root is not None and is_sharded(root):
            topology = sharded_state(root).topology
            _options.same_degrees(type(self).__name__, topology, self._options.degrees)
            self._topology = topology
            return root
        module = self.precision_plugin.convert_module(module)  # the *-true settings cast before the wrap
        root = ShardedRoot(module)
        self._options.shard(root, self.topology, self.root_device, str(self.precision_plugin.precision))
        _ROOTS[module] = root
        return root

    def model_to_device(self) -> None:
        """Nothing: :func:`shardfusion.fully_shard` places the shards on the root device."""

    # -- collectives -----------------------------------------------------------------------------------------------
    def barrier(self, name: Optional[str] = None) -> None:
        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not torch.distributed.is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    def reduce(self, tensor: Any, group: Optional[Any] = None,
               reduce_op: Optional[Union[str, Any]] = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """The micro-batches before the last of an optimizer step accumulate without reducing
        (:func:`shardfusion.no_sync`); the last one's backward reduces their sum once."""
        with sf.no_sync(self.model) if is_sharded(self.model) else nullcontext():
            yield

    # -- checkpoints -----------------------------------------------------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the model is sharded and the optimizers exist before a checkpoint is read into them

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores the optimizers; Lightning still restores the schedulers

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Full checkpoints: the full state dict (rank 0; collective). Sharded ones: ``{}``, the model is written
        by :meth:`save_checkpoint`."""
        if self._save_distributed_checkpoint:
            return {}
        return _checkpoint.full_model_state(self.model, prefix="module.")

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Full checkpoints: the full optimizer state (rank 0; collective). Sharded ones: ``{}`` (as above)."""
        if self._save_distributed_checkpoint:
            return {}
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return _checkpoint.full_optimizer_state(optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Write ``checkpoint`` (Lightning's dict) to ``filepath``: a sharded folder, or one full file (rank 0).

        Raises:
            ValueError: ``storage_options`` given (the folder is written by ``torch.distributed.checkpoint``); on
                every rank: anything :func:`shardfusion.checkpoint.save` raises.
        """
        if storage_options is not None:
            raise ValueError("ShardfusionStrategy.save_checkpoint: storage_options is not supported (the checkpoint "
                             "is written by torch.distributed.checkpoint, not by a CheckpointIO)")
        path = Path(self.broadcast(str(filepath)))
        if not self._save_distributed_checkpoint:
            sf.comm.call_on_rank0(lambda: _checkpoint._remove(path) if path.is_dir() else None,
                                  f"cannot replace {str(path)!r}")
            return super().save_checkpoint(checkpoint, path)
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        optimizers = self.optimizers if "optimizer_states" in checkpoint else None  # weights_only: the model alone
        _checkpoint.save_sharded(path, self.model, optimizers, meta, self.checkpoint_io)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Read a sharded folder (any layout; the model and optimizers loaded here) or a full file (a plain
        Lightning checkpoint too: the model is loaded by :meth:`load_model_state_dict`, the optimizers here)."""
        path = Path(self.broadcast(str(checkpoint_path)))
        if _checkpoint.is_sharded_checkpoint(path):
            return _checkpoint.load_sharded(path, self.model, self.optimizers, self.checkpoint_io, weights_only)
        if path.is_dir():
            raise ValueError(f"ckpt_path {str(path)!r} is a folder without {_checkpoint.META_FILE}: not a checkpoint "
                             f"written by ShardfusionStrategy")
        checkpoint = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        for optimizer, state in zip(self.optimizers, checkpoint.get("optimizer_states", [])):
            _checkpoint.load_full_optimizer(optimizer, state)
        self._full_checkpoint_loaded = True
        return checkpoint

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """A full checkpoint's ``state_dict`` into the fragments (collective); a sharded one is loaded already."""
        if self._full_checkpoint_loaded:
            self._full_checkpoint_loaded = False
            state = {f"module.{k}": v for k, v in checkpoint["state_dict"].items()}
            self.model.load_state_dict(state, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing: :meth:`load_checkpoint` restored the optimizers."""

    def teardown(self) -> None:
        """Release the launcher's environment and plugins; the sharded module stays where it is (moving it would
        detach its fragments from their flat shards)."""
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
