"""DCP planners that store each rank's fragment of a flattened parameter as chunks of a 1-D global tensor (one
chunk, or one per run of a tensor-parallel piece: ``tensor_parallel.global_runs``), and read back exactly a rank's
runs, whatever chunks stored them (used by :mod:`shardfusion.checkpoint`, which describes
the keys and the format).

DCP pitfalls these planners work around (torch 2.13):
- ``find_state_dict_object`` refuses a plain tensor addressed with a non-zero offset: both planners override
  ``lookup_object`` / ``lookup_tensor`` for fragment keys.
- ``_validate_global_plan`` requires the chunks of a key to tile its global size exactly (no overlap, full volume,
  when more than one rank plans): empty fragments must not be planned, and every shard needs exactly one writer.
  A parameter of 0 elements is therefore not stored at all (only its shape, in ``meta``), nor its per-element state.
- ``dedup_save_plans`` deduplicates by ``MetadataIndex`` (fqn, offset): equal replicated items are written once
  anyway, by the smallest plan unless ``dedup_save_to_lowest_rank``; we still plan fragments only on their writer.
  Keys present on some ranks only (expert buffers, ``rank/<r>/...``) are planned by those ranks only: that is fine.
- ``DefaultLoadPlanner(flatten_sharded_tensors=True)`` (the default) copies the state dict, so ``load_bytes`` writes
  the loaded object into the copy and the caller sees ``None``: pass ``flatten_sharded_tensors=False``.
- ``dcp.load`` replaces non-Stateful values of the caller's dict with the loaded ones (bytes items arrive there).
- FileSystemWriter serializes each item with its own header (~1 KB): negligible for real models, dominant here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.default_planner import (
    create_default_local_load_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


Runs = list  # [(offset in the flattened global parameter, start in the fragment, length)], see global_runs


def _by_offset(runs: Runs) -> dict[int, tuple[int, int]]:
    """``{global offset: (start in the fragment, length)}`` of a fragment's runs, for the per-item lookups (a
    row-wise piece has one run per row: a linear search per item would be quadratic)."""
    return {offset: (start, length) for offset, start, length in runs}


def _run_slice(fragment: torch.Tensor, runs: dict[int, tuple[int, int]], offset: int) -> torch.Tensor:
    """The part of ``fragment`` that the run starting at global ``offset`` covers (a view)."""
    start, length = runs[offset]
    return fragment[start:start + length]


class FragmentSavePlanner(DefaultSavePlanner):
    """Writes ``fragments`` keys as 1-D chunks of a ``(global_numel,)`` tensor, one per run; every other key as
    DCP's default planner would (plain tensors and bytes, deduplicated across ranks)."""

    def __init__(self, fragments: dict[str, tuple[Runs, int]]) -> None:
        # flatten_state_dict=False: our keys are already flat strings, and the default flattening would store its
        # key mapping in Metadata.planner_data for nothing.
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, dedup_save_to_lowest_rank=True)
        self._fragments = fragments  # key -> (runs, global numel)
        self._runs = {key: _by_offset(runs) for key, (runs, _) in fragments.items()}

    def create_local_plan(self) -> SavePlan:
        """One SHARD write item per run of each fragment key: chunk ``(offset,)`` + ``(length,)`` of a
        ``(global numel,)`` tensor; DCP's default items for the rest."""
        items: list[WriteItem] = []
        rest = {}
        for fqn, obj in self.state_dict.items():
            if fqn not in self._fragments:
                rest[fqn] = obj
                continue
            runs, total = self._fragments[fqn]
            properties = TensorProperties.create_from_tensor(obj)
            for offset, _start, length in runs:
                chunk = ChunkStorageMetadata(offsets=torch.Size([offset]), sizes=torch.Size([length]))
                items.append(WriteItem(index=MetadataIndex(fqn, torch.Size([offset])), type=WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(chunk=chunk, properties=properties,
                                                                   size=torch.Size([total]))))
        items += create_default_local_save_plan(rest, self.is_coordinator).items
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        """The fragment's part for the run at the item's offset, for a fragment key (the default refuses a plain
        tensor at a non-zero offset); else the default lookup."""
        if index.fqn in self._fragments:
            return _run_slice(self.state_dict[index.fqn], self._runs[index.fqn], index.offset[0])
        return super().lookup_object(index)


class FragmentLoadPlanner(DefaultLoadPlanner):
    """Reads ``fragments`` keys as their runs of the stored 1-D global tensor (any stored chunking); other keys as
    DCP's default planner. Keys in ``optional`` that the checkpoint lacks are skipped."""

    def __init__(self, fragments: dict[str, Runs], optional: frozenset = frozenset()) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._fragments = fragments  # key -> runs
        self._runs = {key: _by_offset(runs) for key, runs in fragments.items()}
        self._optional = optional

    def create_local_plan(self) -> LoadPlan:
        """Read items for exactly this rank's range of each fragment key (whatever chunks stored it); DCP's default
        items for the rest. Raises DCP's error for a missing key that is not optional."""
        md = self.metadata.state_dict_metadata
        items = []
        rest = {}
        for fqn, obj in self.state_dict.items():
            if fqn not in md:
                if fqn in self._optional:
                    continue
                raise RuntimeError(f"checkpoint has no {fqn!r}")
            if fqn not in self._fragments:
                rest[fqn] = obj
                continue
            tmd, runs = md[fqn], self._fragments[fqn]
            end = max((offset + length for offset, _, length in runs), default=0)
            if not isinstance(tmd, TensorStorageMetadata) or len(tmd.size) != 1 or end > tmd.size[0]:
                raise RuntimeError(f"{fqn!r}: checkpoint holds {tmd}, cannot read up to element {end}")
            for offset, _start, length in runs:
                # one chunk per call: the read items' destination is then the run's own slice (lookup_tensor)
                chunk = ChunkStorageMetadata(offsets=torch.Size([offset]), sizes=torch.Size([length]))
                items += create_read_items_for_chunk_list(fqn, tmd, [chunk])
        items += create_default_local_load_plan(rest, self.metadata, True).items
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        """The destination part of the fragment for a fragment key: the slice of the run at the item's
        ``dest_index`` offset (its ``dest_offsets`` are relative to it); else the default lookup."""
        if index.fqn in self._fragments:
            return _run_slice(self.state_dict[index.fqn], self._runs[index.fqn], index.offset[0])
        return super().lookup_tensor(index)
