"""How the parameters that ``fully_shard(..., whole_params=f)`` keeps whole are spread over their owner ranks.

Each such parameter lies whole in the shard of one owner rank of its shard group (see ``layout.build_owner_layout``).
Shards stay equal-sized for the all-gather, so what the fullest shard of a flat buffer holds beyond another is
padding; and the optimizer's work (Muon's Newton-Schulz iterations) falls on the owners, unevenly. This module
reports both, from the layouts alone (no collective: every rank knows every shard's layout).
"""

from __future__ import annotations

import torch.nn as nn

from shardfusion._runtime.layout import owner_report
from shardfusion._runtime.state import flat_buffers


def owner_balance(model: nn.Module) -> dict:
    """The owners' load of a sharded model's whole parameters, per kind of shard group.

    Returns:
        ``{"dense": report, "expert": report}`` (a kind without whole parameters is left out), each report with:

        - ``cost``: per shard index of the group, the summed Newton-Schulz cost (``max(m, n) * min(m, n) ** 2``
          multiply-adds per iteration, :func:`~shardfusion._runtime.layout.newton_schulz_cost`) of the matrices it
          owns, over every unit;
        - ``numel``: per shard index, the elements it owns;
        - ``cost_imbalance``: ``max(cost) / mean(cost)`` (1.0 = balanced);
        - ``numel_imbalance``: ``max(numel) / mean(numel)``;
        - ``padding``: elements of the owner-layout buffers (all shards, alignment included) that hold no
          parameter; ``padded_numel``: their total elements; ``padding_fraction = padding / padded_numel``.

        Buffers over the same group on every unit add up; a trainable and a frozen buffer count alike.

    Raises:
        ValueError: ``model`` was not passed to :func:`shardfusion.fully_shard`.
    """
    out: dict[str, dict] = {}
    for buffer in flat_buffers(model):
        if not buffer.owner_layout or not buffer.layout.padded_numel:
            continue
        kind = "expert" if buffer.is_expert else "dense"
        count = buffer.layout.shard_count
        report = owner_report(buffer.layout)  # the Newton-Schulz cost of each slot
        acc = out.setdefault(kind, {"cost": [0] * count, "numel": [0] * count, "padding": 0, "padded_numel": 0})
        for r in range(count):
            acc["cost"][r] += report["cost"][r]
            acc["numel"][r] += report["numel"][r]
        acc["padding"] += report["padding"]
        acc["padded_numel"] += buffer.layout.padded_numel
    for acc in out.values():
        acc["cost_imbalance"] = _imbalance(acc["cost"])
        acc["numel_imbalance"] = _imbalance(acc["numel"])
        acc["padding_fraction"] = acc["padding"] / acc["padded_numel"]
    return out


def _imbalance(values: list[int]) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean else 1.0
