"""``ShardfusionFabricStrategy``: shardfusion's FSDP / HSDP as a ``lightning_fabric.Fabric`` strategy.

The Fabric loop, mapped (docs/lightning.md):

- ``fabric.launch()``: Fabric's launcher; :meth:`setup_environment` joins the process group and builds the
  :class:`shardfusion.Topology` (``fabric.strategy.topology``);
- ``model = fabric.setup_module(model)`` shards ``model`` itself with :func:`shardfusion.fully_shard` (a model built
  under ``fabric.init_module(empty_init=True)`` is on the meta device and materialized there); then the optimizer is
  built from ``model.parameters()`` (the fragments) and passed to ``fabric.setup_optimizers``. ``fabric.setup(model,
  optimizer)`` with an optimizer built before is refused: it would hold the replaced parameters;
- ``fabric.no_backward_sync(model)``: :func:`shardfusion.no_sync`; ``fabric.clip_gradients(model, optimizer,
  max_norm=...)``: the global norm; ``fabric.all_reduce``: over the world;
- ``fabric.save(path, state)`` / ``fabric.load(path, state)``: the sharded folder of ``_checkpoint.py`` (any layout)
  or one full file (``save_distributed_checkpoint=False``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.nn as nn
from lightning_fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning_fabric.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning_fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning_fabric.strategies.parallel import ParallelStrategy
from lightning_fabric.strategies.strategy import _BackwardSyncControl, _validate_keys_for_strict_loading
from lightning_fabric.utilities.distributed import _sync_ddp_if_available
from lightning_fabric.utilities.distributed import group as _group
from lightning_fabric.utilities.types import _Stateful

import shardfusion as sf
from shardfusion._runtime.state import is_sharded
from shardfusion.lightning import _checkpoint, _launch, _options

__all__ = ["ShardfusionFabricStrategy"]

_PRECISIONS = (Precision, MixedPrecision, HalfPrecision, DoublePrecision)
"""Fabric's precision plugins the strategy maps (``_options.check_precision``)."""


class _NoSync(_BackwardSyncControl):
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return sf.no_sync(module) if enabled and is_sharded(module) else nullcontext()


class ShardfusionFabricStrategy(ParallelStrategy):
    """FSDP / HSDP with fused flat buffers (:func:`shardfusion.fully_shard`) for ``lightning_fabric.Fabric``.

    ``Fabric(strategy=ShardfusionFabricStrategy(fsdp_outer_degree=2, units=(Block,)), devices=4,
    accelerator="cpu")``. Takes the keywords of :class:`shardfusion.lightning.ShardfusionStrategy` (the degrees of
    :class:`shardfusion.Topology`, ``units`` and the other :func:`shardfusion.fully_shard` options,
    ``save_distributed_checkpoint``, ``timeout``, ``arrival_timeout``, ``process_group_backend``).

    Raises:
        ValueError: as :class:`shardfusion.lightning.ShardfusionStrategy`; ``fabric.setup(model, optimizer)`` (set up
            the module first); ``fabric.save`` with other than one sharded module, or with a ``filter``.
    """

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
        self._backward_sync_control = _NoSync()

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
    def topology(self) -> sf.Topology:
        """The :class:`shardfusion.Topology` of the run (from ``fabric.launch()`` on).

        Raises:
            RuntimeError: read before the processes have joined the process group.
        """
        if self._topology is None:
            raise RuntimeError("ShardfusionFabricStrategy.topology is built when the processes start (launch)")
        return self._topology

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return _options.sampler_kwargs(self.topology)

    @property
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else Precision()

    @precision.setter
    def precision(self, precision: Optional[Precision]) -> None:
        if precision is not None:
            _options.check_precision(type(self).__name__, precision, _PRECISIONS)
        self._precision = precision

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

    def _set_world_ranks(self) -> None:
        _launch.set_world_ranks(self)

    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        """``fabric.init_module(empty_init=True)``: the meta device (materialized by :meth:`setup_module`)."""
        stack = ExitStack()
        stack.enter_context(torch.device("meta") if empty_init else self.root_device)
        stack.enter_context(self.precision.module_init_context())
        return stack

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Shard ``module`` in place with :func:`shardfusion.fully_shard`; returns it."""
        return self._options.shard(module, self.topology, self.root_device, str(self.precision.precision))

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list, scheduler: Any = None) -> Any:
        """Refused: the optimizers would hold the parameters the wrap replaces.

        Raises:
            ValueError: always; the message says what to call instead.
        """
        raise ValueError("ShardfusionFabricStrategy replaces the module's parameters by fragments of their shards: "
                         "call model = fabric.setup_module(model), build the optimizer from model.parameters(), then "
                         "optimizer = fabric.setup_optimizers(optimizer)")

    def module_to_device(self, module: nn.Module) -> None:
        """Nothing: :func:`shardfusion.fully_shard` places the shards on the root device."""

    # -- collectives -----------------------------------------------------------------------------------------------
    def all_reduce(self, tensor: Any, group: Optional[Any] = None,
                   reduce_op: Optional[Union[str, Any]] = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not torch.distributed.is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    # -- checkpoints -----------------------------------------------------------------------------------------------
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:
        """``fabric.save(path, state)``: a sharded folder (the sharded module and the optimizers in ``state`` through
        :func:`shardfusion.checkpoint.save`, the other entries in its meta file) or one full file on rank 0.

        Raises:
            ValueError: ``storage_options`` or ``filter`` given; ``state`` holding other than one sharded module;
                on every rank: anything :func:`shardfusion.checkpoint.save` raises.
        """
        if storage_options is not None or filter is not None:
            raise ValueError("ShardfusionFabricStrategy.save_checkpoint: storage_options and filter are not supported "
                             "(the checkpoint is written by torch.distributed.checkpoint)")
        path = Path(self.broadcast(str(path)))
        module_key, optimizer_keys = _split_state(state)
        if not self._save_distributed_checkpoint:
            full = {k: self._full_entry(v) for k, v in state.items()}
            sf.comm.call_on_rank0(lambda: self._write_full(path, full), f"cannot write {str(path)!r}")
            return
        meta = {"module": module_key, "optimizers": optimizer_keys,
                "state": {k: (v.state_dict() if isinstance(v, _Stateful) else v) for k, v in state.items()
                          if k != module_key and k not in optimizer_keys}}
        _checkpoint.save_sharded(path, state[module_key], [state[k] for k in optimizer_keys], meta,
                                 self.checkpoint_io)

    def _full_entry(self, value: Any) -> Any:
        if isinstance(value, nn.Module):
            return _checkpoint.full_model_state(value)
        if isinstance(value, torch.optim.Optimizer):
            return _checkpoint.full_optimizer_state(value)
        return value.state_dict() if isinstance(value, _Stateful) else value

    def _write_full(self, path: Path, full: dict[str, Any]) -> None:
        _checkpoint._remove(path) if path.is_dir() else None
        self.checkpoint_io.save_checkpoint(full, path)

    def load_checkpoint(self, path: Any, state: Optional[Any] = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        """``fabric.load(path, state)``: restore the sharded module and the optimizers of ``state`` in place from a
        sharded folder (any layout) or a full file, the other entries from the rest; returns what ``state`` did not
        ask for.

        Raises:
            ValueError: ``state`` holding other than one sharded module (or a sharded module alone, for
                ``fabric.load_raw``); a folder that is not a checkpoint of this strategy; optimizer entries other than
                those saved; anything :func:`shardfusion.checkpoint.load` raises.
            KeyError: ``strict`` and an entry of ``state`` that the checkpoint lacks.
        """
        path = Path(self.broadcast(str(path)))
        if isinstance(state, nn.Module):  # fabric.load_raw(path, module)
            state = {"module": state}
        module_key, optimizer_keys = _split_state(state or {})
        if _checkpoint.is_sharded_checkpoint(path):
            return self._load_sharded(path, state, module_key, optimizer_keys, strict, weights_only)
        if path.is_dir():
            raise ValueError(f"{str(path)!r} is a folder without {_checkpoint.META_FILE}: not a checkpoint written by "
                             f"ShardfusionFabricStrategy")
        checkpoint = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        if len(state) == 1:  # fabric.load_raw: the file is the module's state dict itself
            checkpoint = {module_key: checkpoint} if module_key not in checkpoint else checkpoint
        _validate_keys_for_strict_loading(state.keys(), checkpoint.keys(), strict=strict)
        for key in list(state):
            if key not in checkpoint:
                continue
            value = checkpoint.pop(key)
            if key == module_key:
                state[key].load_state_dict(value, strict=strict)
            elif key in optimizer_keys:
                _checkpoint.load_full_optimizer(state[key], value)
            elif isinstance(state[key], _Stateful):
                state[key].load_state_dict(value)
            else:
                state[key] = value
        return checkpoint

    def _load_sharded(self, path: Path, state: dict, module_key: str, optimizer_keys: list[str], strict: bool,
                      weights_only: Optional[bool]) -> dict[str, Any]:
        meta = self.checkpoint_io.load_checkpoint(path / _checkpoint.META_FILE, weights_only=weights_only)
        saved = meta["optimizers"]
        if optimizer_keys and optimizer_keys != saved:
            raise ValueError(f"fabric.load({str(path)!r}): the state's optimizers are {optimizer_keys}, the checkpoint "
                             f"holds {saved}: pass the same optimizer entries (or none)")
        optimizers = [state[k] for k in optimizer_keys]
        _checkpoint.load_sharded(path, state[module_key], optimizers, self.checkpoint_io, weights_only)
        rest = dict(meta["state"])
        others = [k for k in state if k != module_key and k not in optimizer_keys]
        _validate_keys_for_strict_loading(others, rest.keys(), strict=strict)
        for key in others:
            if key in rest:
                value = rest.pop(key)
                if isinstance(state[key], _Stateful):
                    state[key].load_state_dict(value)
                else:
                    state[key] = value
        return rest


def _split_state(state: dict[str, Any]) -> tuple[str, list[str]]:
    """The key of the one sharded module in ``state`` and the keys of its optimizers, in order.

    Raises:
        ValueError: no sharded module in ``state``, or several (save each model to its own path).
    """
    modules = [k for k, v in state.items() if isinstance(v, nn.Module) and is_sharded(v)]
    if len(modules) != 1:
        raise ValueError(f"ShardfusionFabricStrategy checkpoints hold one model set up by fabric.setup_module; the "
                         f"state has {len(modules)} ({', '.join(modules) or 'none'}): pass one, and save other models "
                         f"to their own paths")
    return modules[0], [k for k, v in state.items() if isinstance(v, torch.optim.Optimizer)]
