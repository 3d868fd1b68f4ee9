"""What both Lightning strategies take and how it maps onto shardfusion: the topology degrees, the ``fully_shard``
options, and Lightning's ``precision`` setting as a :class:`shardfusion.MixedPrecisionPolicy`.

Validated when a strategy is constructed (names and types of the options), when Lightning attaches its precision
plugin (the precision setting), and when the process group exists (the degrees, by :class:`shardfusion.Topology`).
Every refusal is a ``ValueError`` naming the keyword and the value, raised alike on every rank.
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
from typing import Any, Optional

import torch
import torch.nn as nn

import shardfusion as sf

TOPOLOGY_DEGREES = ("dp", "sharding", "fsdp_outer_degree", "ep", "mp", "sep", "cp")
"""The :class:`shardfusion.Topology` degrees a strategy takes as keywords (``pp`` is refused: see ``check_pp``)."""

_NOT_OPTIONS = ("model", "topology", "device")  # fully_shard's arguments that the strategy itself supplies
FULLY_SHARD_OPTIONS = tuple(name for name in inspect.signature(sf.fully_shard).parameters if name not in _NOT_OPTIONS)
"""The keywords of :func:`shardfusion.fully_shard` a strategy passes through (``units``, ``mp_policy``, ...)."""

PRECISION_DTYPES = {"32-true": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
"""Lightning's ``precision`` settings that map onto shardfusion's mixed precision: the ``param_dtype`` of the
:class:`shardfusion.MixedPrecisionPolicy` (``None``: off). The ``*-true`` settings (``bf16-true``, ``16-true``,
``64-true``) cast the module before the wrap instead, so its shards are in that dtype (:data:`CAST_PRECISIONS`)."""

CAST_PRECISIONS = ("bf16-true", "16-true", "64-true")
"""Lightning's ``precision`` settings that cast the module itself (Lightning's own plugins do it before the wrap)."""


@dataclasses.dataclass(frozen=True)
class ShardOptions:
    """The settings of a strategy: ``degrees`` for :class:`shardfusion.Topology`, ``fully_shard`` for
    :func:`shardfusion.fully_shard` (without ``model``, ``topology`` and ``device``)."""

    degrees: dict[str, int]
    fully_shard: dict[str, Any]
    timeout: Optional[datetime.timedelta]
    arrival_timeout: Optional[float]

    @classmethod
    def from_keywords(cls, strategy: str, degrees: dict[str, int], pp: int, options: dict[str, Any],
                      timeout: Optional[datetime.timedelta], arrival_timeout: Optional[float]) -> "ShardOptions":
        """Check the keywords given to ``strategy`` (its class name, for the messages).

        Raises:
            ValueError: ``pp`` other than 1 (see :func:`check_pp`); a keyword that is neither a degree nor a
                ``fully_shard`` option (the message lists both). The degrees themselves are checked by
                :meth:`topology`, once the world size is known.
        """
        check_pp(strategy, pp)
        unknown = sorted(set(options) - set(FULLY_SHARD_OPTIONS))
        if unknown:
            raise ValueError(f"{strategy}: unknown keyword(s) {', '.join(unknown)}; it takes the topology degrees "
                             f"{', '.join(TOPOLOGY_DEGREES)} and the fully_shard options "
                             f"{', '.join(FULLY_SHARD_OPTIONS)}")
        return cls(dict(degrees), dict(options), timeout, arrival_timeout)

    def topology(self) -> sf.Topology:
        """The :class:`shardfusion.Topology` over the default process group (collective: it builds the groups).

        Raises:
            ValueError: degrees that do not multiply to the world size, or break another rule of
                :class:`shardfusion.Topology` (the message names every degree).
        """
        return sf.Topology(**self.degrees, timeout=self.timeout, arrival_timeout=self.arrival_timeout)

    def mp_policy(self, precision: str) -> Optional[sf.MixedPrecisionPolicy]:
        """The mixed-precision policy for Lightning's ``precision`` setting: the given ``mp_policy`` with its
        ``param_dtype`` set from :data:`PRECISION_DTYPES` (its ``grad_comm_dtype`` is kept).

        Raises:
            ValueError: ``mp_policy.param_dtype`` set to another dtype than the precision setting's.
        """
        given = self.fully_shard.get("mp_policy") or sf.MixedPrecisionPolicy()
        want = PRECISION_DTYPES.get(precision)
        if want is None:
            return given
        if given.param_dtype not in (None, want):
            raise ValueError(f"precision={precision!r} computes in {want} but mp_policy.param_dtype is "
                             f"{given.param_dtype}: leave param_dtype unset, or use precision='32-true' with the "
                             f"mp_policy alone")
        return dataclasses.replace(given, param_dtype=want)

    def shard(self, model: nn.Module, topology: sf.Topology, device: torch.device, precision: str) -> nn.Module:
        """:func:`shardfusion.fully_shard` of ``model`` with these options and ``precision``'s policy."""
        options = dict(self.fully_shard, mp_policy=self.mp_policy(precision))
        return sf.fully_shard(model, topology, device=device, **options)


def check_pp(strategy: str, pp: int) -> None:
    """Refuse pipeline stages: Lightning's loops run one forward and one backward per micro-batch on the whole
    module, where a pipeline needs a schedule that interleaves the micro-batches of several stages
    (:mod:`shardfusion.pipeline`, the training job's ``--pp``).

    Raises:
        ValueError: ``pp`` other than 1.
    """
    if pp != 1:
        raise ValueError(f"{strategy}: pp={pp} is not supported: Lightning runs one forward and backward per "
                         f"micro-batch on the whole module, and pipeline stages need a schedule over several stages "
                         f"(use shardfusion.pipeline or python -m shardfusion.train --pp); pass pp=1")


def check_precision(strategy: str, plugin: object, allowed: tuple[type, ...]) -> None:
    """Refuse the precision plugins that do not map onto shardfusion: only Lightning's own ``Precision``,
    ``MixedPrecision``, ``HalfPrecision`` and ``DoublePrecision`` (``allowed``: the Trainer's or Fabric's classes),
    with a setting of :data:`PRECISION_DTYPES` or :data:`CAST_PRECISIONS`.

    Raises:
        ValueError: another plugin (Transformer Engine, bitsandbytes, DeepSpeed's, FSDP's, a subclass; the message
            names its class and setting).
    """
    precision = getattr(plugin, "precision", None)
    if type(plugin) in allowed and (precision in PRECISION_DTYPES or precision in CAST_PRECISIONS):
        return
    raise ValueError(f"{strategy}: the precision plugin {type(plugin).__name__}(precision={precision!r}) is not "
                     f"supported: shardfusion maps only Lightning's own {', '.join(t.__name__ for t in allowed)} "
                     f"with precision {', '.join([*PRECISION_DTYPES, *CAST_PRECISIONS])} (others replace or quantize "
                     f"layers, or drive another engine's casts)")


def sampler_kwargs(topology: sf.Topology) -> dict[str, int]:
    """``DistributedSampler`` arguments: one replica per data-parallel rank (``dp * sharding`` of them; the ranks
    of one tensor- or context-parallel group read the same samples)."""
    return {"num_replicas": topology.dp * topology.sharding, "rank": topology.data_parallel_rank}


def same_degrees(strategy: str, topology: sf.Topology, degrees: dict[str, int]) -> None:
    """A module sharded by an earlier strategy is reused only under the same degrees.

    Raises:
        ValueError: a degree differs (the message names both).
    """
    resolved = sf.topology.Degrees(world_size=topology.world_size, **degrees)  # sharding=-1 resolved
    held = {name: getattr(topology, name) for name in degrees}
    want = {name: getattr(resolved, name) for name in degrees}
    if held != want:
        raise ValueError(f"{strategy}: the module is already sharded with {held}; this strategy asks for {want}. "
                         f"Use a new module instance (or the same degrees)")
