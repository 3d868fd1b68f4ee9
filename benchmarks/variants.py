"""The three data-parallel variants `benchmarks/compare.py` runs, built the same way from the same GPT
(`benchmarks/memory.py` wraps its models with :func:`wrap` and counts their tensors with :func:`live`).

- ``shardfusion``: ``sf.fully_shard(model, Topology(fsdp_outer_degree=O), units=(Block,))``, one flat buffer per
  block and one for the root (embeddings, final norm, tied head), ``after_forward`` (or ``ctx.reshard_policy``);
  ``set_is_last_backward(model, True)`` (every backward ends its step: FSDP2's default); clipping with
  ``sf.clip_grad_norm_``.
- ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on each Block (``reshard_after_forward=True``; False under
  ``after_backward``) then on the root, left at its default, which for the root is not to reshard after forward
  (shardfusion's root unit is not resharded either), over the 2-D mesh ``(replicate=O, shard=I)``; clipping with
  ``torch.nn.utils.clip_grad_norm_`` (the norm is a DTensor; its reduction is a DTensor redistribution).
- ``ddp``: ``DistributedDataParallel(gradient_as_bucket_view=True)`` over all ranks; ``torch.nn.utils.clip_grad_norm_``.

Optional (``pip install -e '.[bench]'``, not run by default): DeepSpeed ZeRO-3 engines (``deepspeed.initialize`` with
torch's ``AdamW`` as the client optimizer and DeepSpeed's ``gradient_clipping`` 1.0), see :func:`deepspeed_config`:

- ``deepspeed``: ZeRO-3 partitioned over all W ranks (the flat ZeRO-3 peer);
- ``ds-hpz``: ZeRO++ hpZ, ``zero_hpz_partition_size = I``: a secondary copy of the parameters partitioned inside the
  inner group serves the backward all-gathers;
- ``ds-mics``: MiCS, ``mics_shard_size = I``: partitioned inside the inner group, replicated over the outer one (the
  closest peer of HSDP). DeepSpeed 0.19 removed MiCS; with such a version the variant is skipped with its error.

A DeepSpeed step is ``engine(x, y)``, ``engine.backward(loss)``, ``engine.step()`` (clipping, the optimizer step and
clearing the gradients inside).

Every variant gets a fresh model built under the same seed, AdamW with the same settings, and the same batches. A step
is: forward, backward, clip to norm 1.0, ``optimizer.step()``, ``zero_grad(set_to_none=True)``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn as nn

import shardfusion as sf
from shardfusion.models.gpt import GPT, Block, GPTConfig, NormalLinear

from benchmarks.measure import local_tensor, optimizer_state_tensors, persistent_bytes

VARIANTS = ("shardfusion", "fsdp2", "ddp")
"""The variants run by default (torch only)."""
DEEPSPEED_VARIANTS = ("deepspeed", "ds-mics", "ds-hpz")
"""Optional variants that need the ``bench`` extra (DeepSpeed); skipped when it is missing."""
ALL_VARIANTS = VARIANTS + DEEPSPEED_VARIANTS
MAX_NORM = 1.0
LR = 1e-3


@dataclass
class Context:
    """What every variant of one worker shares: the device, the groups, the precision policy."""

    device: torch.device
    topo: "sf.Topology"
    mesh: object  # torch DeviceMesh (replicate, shard)
    param_dtype: Optional[torch.dtype]  # None: fp32 everywhere
    reshard_policy: str = "after_forward"  # of the sharded variants' blocks (FSDP2: reshard_after_forward)
    prefetch: int = 1  # shardfusion's prefetch depth
    seed: int = 42
    units: str = "block"  # the sharded variants' unit granularity, one of UNITS
    deepspeed_zero: dict = field(default_factory=dict)  # more zero_optimization keys of the DeepSpeed variants


@dataclass
class Built:
    """One wrapped model, ready to step."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    clip: Callable[[], object]
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    sample_transient: Callable[[], dict[str, int]] = field(default=lambda: {})
    note: str = ""
    # An engine that owns its backward and optimizer step (DeepSpeed): ``backward(loss)`` replaces
    # ``loss.backward()``, ``optimizer_step()`` replaces clip + ``optimizer.step()`` + ``zero_grad``.
    backward: Optional[Callable[[torch.Tensor], None]] = None
    optimizer_step: Optional[Callable[[], None]] = None
    # Bytes kept across steps by groups (params, grads, optimizer, library), when the generic count of
    # ``model.parameters()`` and ``optimizer.state`` does not see them (DeepSpeed's partitions).
    persistent_groups: Optional[Callable[[], dict[str, list]]] = None


UNITS = ("block", "linear")
"""The unit granularities of the sharded variants (``Context.units``): ``"block"``, one unit per transformer block;
``"linear"``, one unit per linear layer inside the blocks (attention's qkv and output projection, the MLP's two
layers: DeepSpeed ZeRO-3's granularity, which gathers each module's parameters when it runs); the blocks' norms then
belong to the root unit. Finer units hold less at once (the transient peak: one unit's full parameters and
gradients, docs/benchmarks.md) for more, smaller collectives."""


def unit_modules(model: GPT, units: str) -> list[nn.Module]:
    """The modules that form units under granularity ``units`` (:data:`UNITS`), in forward order (root excluded)."""
    if units == "block":
        return list(model.blocks)
    if units == "linear":
        return [m for b in model.blocks for m in b.modules() if isinstance(m, NormalLinear)]
    raise ValueError(f"units must be one of {UNITS}, got {units!r}")


def unit_classes(units: str) -> tuple[type, ...]:
    """The ``units=`` classes of ``sf.fully_shard`` for granularity ``units`` (:data:`UNITS`). ``NormalLinear``
    also matches the head, whose weight is tied to the embedding: a parameter shared between units belongs to the
    unit of their lowest common ancestor, the root, so the head forms no unit of its own."""
    if units not in UNITS:
        raise ValueError(f"units must be one of {UNITS}, got {units!r}")
    return (Block,) if units == "block" else (NormalLinear,)


def unit_sizes(config: GPTConfig, units: str = "block") -> tuple[int, list[int]]:
    """Parameter elements of the root unit and of each other unit under granularity ``units`` (unpadded; a tied
    weight counts once); counted on a model built on the meta device, so nothing is allocated."""
    with torch.device("meta"):
        model = GPT(config)
    blocks = [sum(p.numel() for p in m.parameters()) for m in unit_modules(model, units)]
    total = sum(p.numel() for p in model.parameters())
    return total - sum(blocks), blocks


def build(name: str, config: GPTConfig, ctx: Context) -> Built:
    """A fresh GPT under ``ctx.seed``, wrapped as variant ``name``, with its optimizer.

    Raises:
        NotImplementedError: the variant cannot run the requested precision policy (the caller skips it).
    """
    torch.manual_seed(ctx.seed)
    return wrap(name, GPT(config).to(ctx.device), ctx)


def wrap(name: str, model: GPT, ctx: Context, *, last_backward: Optional[bool] = True,
         **fully_shard_kwargs) -> Built:
    """``model`` wrapped as variant ``name``, with its optimizer; ``fully_shard_kwargs`` go to shardfusion's
    ``fully_shard`` (the ``shardfusion`` variant only). ``last_backward`` (``shardfusion`` only): ``True`` calls
    ``set_is_last_backward(model, True)`` once (every backward ends its step, FSDP2's default); ``None`` leaves the
    library's default (``benchmarks/link.py``'s "default" variant).

    Raises:
        NotImplementedError: the variant cannot run the requested precision policy (the caller skips it).
        ValueError: an unknown ``name``, or ``fully_shard_kwargs`` for another variant than ``shardfusion``.
    """
    if name == "shardfusion":
        return _build_shardfusion(model, ctx, last_backward, **fully_shard_kwargs)
    if fully_shard_kwargs:
        raise ValueError(f"variant {name!r} takes no fully_shard keywords, got {sorted(fully_shard_kwargs)}")
    if name == "fsdp2":
        return _build_fsdp2(model, ctx)
    if name == "ddp":
        return _build_ddp(model, ctx)
    if name in DEEPSPEED_VARIANTS:
        return _build_deepspeed(name, model, ctx)
    raise ValueError(f"unknown variant {name!r}; pick from {ALL_VARIANTS}")


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR)


def _build_shardfusion(model: GPT, ctx: Context, last_backward: Optional[bool] = True, **fully_shard_kwargs) -> Built:
    mp_policy = sf.MixedPrecisionPolicy()
    if ctx.param_dtype is not None:  # as FSDP2's MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32) below
        mp_policy = sf.MixedPrecisionPolicy(param_dtype=ctx.param_dtype, grad_comm_dtype=torch.float32)
    sf.fully_shard(model, ctx.topo, units=unit_classes(ctx.units), reshard_policy=ctx.reshard_policy, mp_policy=mp_policy,
                   prefetch=ctx.prefetch, **fully_shard_kwargs)
    note = "set_is_last_backward not called: the library's default for the outer all-reduce"
    if last_backward is not None:
        # Every backward ends its step: overlap the outer all-reduce with it, as FSDP2 does by default.
        sf.set_is_last_backward(model, last_backward)
        note = (f"set_is_last_backward(model, {last_backward}): outer all-reduce overlapped with backward, as in FSDP2"
                if last_backward else "set_is_last_backward(model, False): outer all-reduce at the step boundary")
    units = sf.get_units(model)
    return Built("shardfusion", model, _adamw(model), lambda: sf.clip_grad_norm_(model, MAX_NORM),
                 sample_transient=lambda: shardfusion_transient(units), note=note)


def shardfusion_transient(units) -> dict[str, int]:
    """Alive full-size buffers of shardfusion units (``sf.get_units``): full parameter and gradient bytes, and how
    many units other than the root (name ``""``) hold a gathered parameter buffer."""
    full = grad = alive_blocks = 0
    for u in units:
        alive = 0
        for g in u.groups:
            if g.full is not g.shard:
                alive += g.full.untyped_storage().nbytes()
            if g.grad_full is not None:
                grad += g.grad_full.untyped_storage().nbytes()
        full += alive
        alive_blocks += bool(alive) and u.name != ""
    return {"full_param_bytes": full, "full_grad_bytes": grad, "blocks_unsharded": alive_blocks}


def _build_fsdp2(model: GPT, ctx: Context) -> Built:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy()
    if ctx.param_dtype is not None:
        mp = MixedPrecisionPolicy(param_dtype=ctx.param_dtype, reduce_dtype=torch.float32)
    for block in unit_modules(model, ctx.units):
        fully_shard(block, mesh=ctx.mesh, reshard_after_forward=ctx.reshard_policy == "after_forward", mp_policy=mp)
    fully_shard(model, mesh=ctx.mesh, mp_policy=mp)  # root: default, i.e. kept unsharded from forward to backward
    groups = _fsdp2_groups(model, ctx.units)
    return Built("fsdp2", model, _adamw(model),
                 lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM),
                 sample_transient=lambda: _fsdp2_transient(groups),
                 note="transient full buffers read from FSDP2 internals (all-gather outputs, unsharded parameters "
                      "and their gradients, reduce-scatter input); best effort")


def _fsdp2_groups(model: nn.Module, units: str = "block") -> list[tuple[bool, object]]:
    """``(is the root, FSDPParamGroup)`` of the root and of each unit wrapped by FSDP2's ``fully_shard``."""
    return [(m is model, pg) for m in [model, *unit_modules(model, units)]
            if (pg := getattr(m._get_fsdp_state(), "_fsdp_param_group", None)) is not None]


def _storage_counter():
    """``add(t)``: the bytes of ``t``'s storage the first time it is seen (0 for a repeat, an empty storage or a
    non-tensor), so that a sum over a sampling counts each storage once."""
    seen: set[int] = set()

    def add(t) -> int:
        if not isinstance(t, torch.Tensor):
            return 0
        st = t.untyped_storage()
        if st.nbytes() == 0 or st.data_ptr() in seen:
            return 0
        seen.add(st.data_ptr())
        return st.nbytes()

    return add


def _fsdp2_transient(groups) -> dict[str, int]:
    """Alive full-size buffers of FSDP2 param groups (private attributes; missing ones count as 0)."""
    add = _storage_counter()

    full = grad = alive_blocks = 0
    for is_root, pg in groups:
        alive = 0
        result = getattr(pg, "_all_gather_result", None)
        alive += add(getattr(result, "all_gather_output", None))
        state = getattr(getattr(pg, "comm_ctx", None), "all_gather_state", None)
        alive += add(getattr(getattr(state, "all_gather_result", None), "all_gather_output", None))
        for fp in getattr(pg, "fsdp_params", []):
            for t in getattr(fp, "all_gather_outputs", []):
                alive += add(t)
            unsharded = getattr(fp, "_unsharded_param", None)
            if unsharded is not None:
                alive += add(unsharded)
                grad += add(unsharded.grad)
        rs_state = getattr(getattr(pg, "comm_ctx", None), "reduce_scatter_state", None)
        grad += add(getattr(rs_state, "reduce_scatter_input", None))
        full += alive
        alive_blocks += bool(alive) and not is_root
    return {"full_param_bytes": full, "full_grad_bytes": grad, "blocks_unsharded": alive_blocks}


def _build_ddp(model: GPT, ctx: Context) -> Built:
    from torch.nn.parallel import DistributedDataParallel

    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    note = ""
    if ctx.param_dtype is not None:
        dtype, dev = ctx.param_dtype, ctx.device.type
        autocast = lambda: torch.autocast(dev, dtype=dtype)  # noqa: E731
        note = f"autocast({dev}, {dtype}): fp32 parameters and gradient all-reduce, {dtype} matmuls"
    return Built("ddp", ddp, _adamw(ddp), lambda: torch.nn.utils.clip_grad_norm_(ddp.parameters(), MAX_NORM),
                 autocast=autocast, note=note)


_HPZ_GROUPS: dict[int, object] = {}  # hpZ partition size -> DeepSpeed's secondary group, created once per process


def deepspeed_config(name: str, ctx: Context, block_numel: int) -> dict:
    """The DeepSpeed config of variant ``name`` (see the module doc): ZeRO-3 with every parameter partitioned
    (``stage3_param_persistence_threshold`` 0; DeepSpeed's default of 1e5 elements would keep the small tensors,
    here every LayerNorm and bias and the 256 x 256 projections, whole on every rank); under ``after_forward`` each
    module's parameters released after its forward and gathered again for backward (``stage3_max_reuse_distance``
    0; the default of 1e9 elements keeps a model this small gathered from forward to backward) without prefetch
    (see the comment below); under ``after_backward`` the default reuse distance and a prefetch of ``ctx.prefetch``
    blocks' elements (``stage3_prefetch_bucket_size``, elements); gradients reduce-scattered
    in buckets of one block's elements (``reduce_bucket_size``; the default, 5e8 elements, allocates a 2 GB fp32
    bucket per rank and reduces the whole model's gradients at once at the end of backward); fp32; clipping to
    ``MAX_NORM``. ``block_numel``: the elements of one block. The micro-batch size only feeds DeepSpeed's
    throughput log (the batches are passed by the caller).

    Raises:
        NotImplementedError: mixed precision (not wired for DeepSpeed here).
    """
    if ctx.param_dtype is not None:
        raise NotImplementedError("DeepSpeed variants run fp32 only in this benchmark (bf16 is not wired)")
    inner = _inner_degree(ctx)
    zero: dict = {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": block_numel}
    if ctx.reshard_policy == "after_forward":
        # No prefetch: with any prefetch bucket, DeepSpeed 0.19's prefetcher scans the parameter trace past the
        # parameters already gathered (they do not count against the bucket), marks their backward use as
        # "fetched", and then does not release them after forward; for these models that keeps every parameter
        # gathered from forward to backward (measured), which is the after_backward policy, not ZeRO-3's.
        zero.update(stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0)
    else:
        zero["stage3_prefetch_bucket_size"] = ctx.prefetch * block_numel
    if name == "ds-hpz":
        zero["zero_hpz_partition_size"] = inner
    elif name == "ds-mics":
        zero["mics_shard_size"] = inner
    zero.update(ctx.deepspeed_zero)  # e.g. benchmarks/zeropp.py's ZeRO++ flags
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": MAX_NORM,
            "zero_optimization": zero, "zero_allow_untested_optimizer": True, "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False}


def _build_deepspeed(name: str, model: GPT, ctx: Context) -> Built:
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cuda" if ctx.device.type == "cuda" else "cpu")
    try:
        import deepspeed
        from deepspeed.utils import groups as ds_groups
    except ImportError as e:
        raise NotImplementedError(f"deepspeed is not importable ({e}); pip install -e '.[bench]'") from e
    import torch.distributed as dist

    block_numel = max(sum(p.numel() for p in b.parameters()) for b in model.blocks)
    config = deepspeed_config(name, ctx, block_numel)
    inner = _inner_degree(ctx)
    if name == "ds-mics" and not _deepspeed_has_mics():
        raise NotImplementedError(f"MiCS is not in DeepSpeed {deepspeed.__version__} (removed in 0.19: its config "
                                  f"rejects 'mics_shard_size'); it needs deepspeed<0.19")
    deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)  # reuses the default group
    if name == "ds-mics" and dist.get_backend() == "gloo":
        # Measured with deepspeed 0.18.9 (docs/benchmarks.md): MiCS gathers through c10d's coalescing manager
        # (runtime/zero/mics.py, _flat_all_gather_with_coalescing_manager), which gloo does not implement; its
        # fallback without the manager gathers over the whole world with buffers sized for the shard group.
        raise NotImplementedError("MiCS on gloo: 'Backend gloo does not implement startCoalescing' (deepspeed "
                                  "0.18.9 runtime/zero/mics.py:240 -> comm/torch.py:272 _coalescing_manager); "
                                  "needs NCCL")
    # hpZ's secondary group is a process-wide global of DeepSpeed's, created by the first hpZ engine; a plain
    # ZeRO-3 engine built after it would pick it up, so it is set for hpZ engines only.
    hpz = config["zero_optimization"].get("zero_hpz_partition_size", 1)
    ds_groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = _HPZ_GROUPS.get(hpz) if hpz > 1 else None
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=_adamw(model), config=config)
    if hpz > 1:
        _HPZ_GROUPS[hpz] = ds_groups._ZERO_PARAM_INTRA_PARALLEL_GROUP
    module = engine.module
    blocks = [list(b.parameters()) for b in module.blocks]
    in_blocks = {id(p) for ps in blocks for p in ps}
    root = [p for p in module.parameters() if id(p) not in in_blocks]
    zopt = engine.optimizer
    note = (f"DeepSpeed {deepspeed.__version__} ZeRO-3 ({type(zopt).__name__}), zero_optimization "
            f"{config['zero_optimization']}; transient full buffers: parameters in ds_status AVAILABLE or "
            f"INFLIGHT and the gradients of the full parameters, best effort")
    return Built(name, engine, zopt, clip=lambda: None,
                 backward=engine.backward, optimizer_step=engine.step,
                 sample_transient=lambda: _deepspeed_transient(root, blocks),
                 persistent_groups=lambda: _deepspeed_groups(module, zopt), note=note)


def _inner_degree(ctx: Context) -> int:
    import torch.distributed as dist

    return dist.get_world_size() // ctx.topo.fsdp_outer_degree


def _deepspeed_has_mics() -> bool:
    try:
        import deepspeed.runtime.zero.mics  # noqa: F401
    except ImportError:
        return False
    return True


def _deepspeed_transient(root: list, blocks: list[list]) -> dict[str, int]:
    """Alive full-size buffers of a DeepSpeed ZeRO-3 module: the data of the parameters gathered now (``ds_status``
    AVAILABLE or INFLIGHT) and their full gradients, and how many blocks hold gathered parameters."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    add = _storage_counter()

    def gathered(p) -> bool:
        return getattr(p, "ds_status", None) in (ZeroParamStatus.AVAILABLE, ZeroParamStatus.INFLIGHT)

    full = grad = alive_blocks = 0
    for i, ps in enumerate([root, *blocks]):
        alive = sum(add(p.data) for p in ps if gathered(p))
        grad += sum(add(p.grad) for p in ps)
        full += alive
        alive_blocks += bool(alive) and i > 0
    return {"full_param_bytes": full, "full_grad_bytes": grad, "blocks_unsharded": alive_blocks}


def _deepspeed_groups(module: nn.Module, zopt) -> dict[str, list]:
    """DeepSpeed ZeRO-3's tensors kept across steps, by group: ``params`` the module's parameter partitions
    (``ds_tensor``, views of its flat partition buffers) and secondary (hpZ) partitions; ``optimizer`` the fp32
    master partitions (in fp32 the same storage as the parameter partitions, then counted once) and AdamW's state;
    ``grads`` the flat gradient-partition buffer; ``library`` the gathered data of parameters still full (none
    after the step). The reduce bucket (:func:`_deepspeed_buckets`), which DeepSpeed keeps allocated between
    steps, is a buffer of the backward's reductions: counted in the transient memory, as shardfusion's full
    gradient buffers are (benchmarks/transient.py)."""
    params = list(module.parameters())
    opt_state = [v for st in zopt.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    library = [p.data for p in params]
    return {"params": [p.ds_tensor for p in params] + [getattr(p, "ds_secondary_tensor", None) for p in params],
            "optimizer": list(zopt.fp32_partitioned_groups_flat) + opt_state,
            "grads": [zopt.grad_partitions_flat_buffer],
            "library": library}


def _deepspeed_buckets(zopt) -> list[torch.Tensor]:
    """DeepSpeed ZeRO-3's reduce buckets (0.19: ``ipg_buckets[dtype].buffer``; allocated at the first backward)."""
    buckets = getattr(zopt, "ipg_buckets", {})
    return [t for t in (getattr(bk, "buffer", None) for bk in buckets.values()) if isinstance(t, torch.Tensor)]


def step(b: Built, x: torch.Tensor, y: torch.Tensor, after_optimizer: Optional[Callable[[], None]] = None,
         on_phase: Optional[Callable[[str], None]] = None):
    """One training step on token ids ``x``, ``y`` (B, T) int64; returns the loss (a 0-dim fp32 tensor, not
    synchronized). ``after_optimizer`` runs between ``optimizer.step()`` and ``zero_grad`` (when every persistent
    tensor, gradients included, is alive); for an engine with its own step (DeepSpeed) after ``engine.step()``,
    whose gradient partitions are kept allocated across steps. ``on_phase(part)`` is told where the step is (the
    phases of ``shardfusion.live_memory.LiveMemory``): ``activations`` before the forward, ``other`` before the
    backward and after the step, ``optimizer_step`` before the clipping and the optimizer step."""
    phase = on_phase or (lambda part: None)
    phase("activations")
    with b.autocast():
        _, loss = b.model(x, y)
    phase("other")
    if b.optimizer_step is not None:
        b.backward(loss)
        phase("optimizer_step")
        b.optimizer_step()
        phase("other")
        if after_optimizer is not None:
            after_optimizer()
        return loss.detach()
    loss.backward()
    phase("optimizer_step")
    b.clip()
    b.optimizer.step()
    phase("other")
    if after_optimizer is not None:
        after_optimizer()
    b.optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def persistent_tensors(b: Built) -> Callable[[], list[torch.Tensor]]:
    """A function listing the tensors :func:`persistent` counts (parameters, gradients, optimizer state; DeepSpeed's
    partitions), as they are when called."""
    if b.persistent_groups is not None:
        return lambda: [t for ts in b.persistent_groups().values() for t in ts if isinstance(t, torch.Tensor)]

    def tensors() -> list[torch.Tensor]:
        params = list(b.model.parameters())
        found = params + [p.grad for p in params] + optimizer_state_tensors(b.optimizer)
        return [t for t in found if isinstance(t, torch.Tensor)]

    return tensors


def persistent(b: Built) -> dict[str, int]:
    """Bytes this rank keeps across steps: parameters (shards), gradients, optimizer state (distinct storages)."""
    if b.persistent_groups is not None:
        out = persistent_bytes(b.persistent_groups())
        out["total"] = sum(out.values())
        return out
    return _storage_bytes(b)


# The tensors of a shardfusion FlatBuffer (see [Note: flat buffer tensors] in shardfusion/_runtime/flat_buffer.py)
# and of an FSDP2 FSDPParam / FSDPParamGroup that may hold memory; private attributes, read with getattr (a missing
# one counts as nothing).
_SF_BUFFER_ATTRS = ("shard", "full", "grad_full", "grad_acc", "grad_shard", "step_grad", "direct_grad",
                    "_gather_input", "_reduce_in", "_reduce_out", "_sync_buf")
_FSDP2_PARAM_ATTRS = ("_sharded_param_data", "_sharded_post_forward_param_data", "_unsharded_param",
                      "unsharded_accumulated_grad")


def library_tensors(b: Built) -> list[torch.Tensor]:
    """The wrapping library's own tensors besides the parameters: shardfusion's flat buffers (shards, full buffers,
    gradient buffers), FSDP2's padded shards, unsharded parameters and their gradients, all-gather outputs and
    reduce-scatter inputs; DeepSpeed's reduce buckets; none for DDP. A resharded full buffer has a storage of 0
    bytes."""
    out: list = []
    if b.name == "shardfusion":
        from shardfusion._runtime.state import flat_buffers

        for fb in flat_buffers(b.model):
            out += [getattr(fb, a, None) for a in _SF_BUFFER_ATTRS]
    elif b.name in DEEPSPEED_VARIANTS:
        out += _deepspeed_buckets(b.optimizer)
    elif b.name == "fsdp2":
        for _, pg in _fsdp2_groups(b.model, _units_of(b.model)):
            out.append(getattr(getattr(pg, "_all_gather_result", None), "all_gather_output", None))
            out.append(getattr(pg, "_partial_reduce_output", None))
            ctx = getattr(pg, "comm_ctx", None)
            state = getattr(ctx, "all_gather_state", None)
            out.append(getattr(getattr(state, "all_gather_result", None), "all_gather_output", None))
            out += [getattr(s, "reduce_scatter_input", None) for s in getattr(ctx, "reduce_scatter_states", [])]
            for fp in getattr(pg, "fsdp_params", []):
                out += [getattr(fp, a, None) for a in _FSDP2_PARAM_ATTRS]
                out += list(getattr(fp, "all_gather_outputs", []))
                out.append(getattr(getattr(fp, "_unsharded_param", None), "grad", None))
    return [t for t in out if isinstance(t, torch.Tensor)]


def live(b: Built) -> dict[str, int]:
    """Bytes of the distinct storages alive now: :func:`persistent`'s groups plus the library's own tensors
    (:func:`library_tensors`), each storage counted once, in the first group that holds it."""
    if b.persistent_groups is not None:
        return persistent(b)
    return _storage_bytes(b, library_tensors(b))


def _storage_bytes(b: Built, library: Optional[list[torch.Tensor]] = None) -> dict[str, int]:
    """Bytes of distinct storages: parameters, gradients, optimizer state (and ``library`` when given); "total"."""
    params = list(b.model.parameters())
    groups = {"params": params, "grads": [p.grad for p in params], "optimizer": optimizer_state_tensors(b.optimizer)}
    if library is not None:
        groups["library"] = library
    out = persistent_bytes(groups)
    out["total"] = sum(out.values())
    return out


# ---- live memory by part (benchmarks/compare.py's breakdown of the peak) ------------------------------------------
class _Watch:
    """A ``shardfusion.live_memory.LiveMemory`` watch over tensors listed by ``parts()`` (``{part: [tensor or
    (unit name, tensor)]}``: a DTensor counts its local shard); ``labels`` maps the storages of labelled tensors to
    their unit's name after each call."""

    def __init__(self, parts: Callable[[], dict[str, list]]) -> None:
        self._parts = parts
        self.labels: dict[int, str] = {}

    def __call__(self) -> dict[str, dict]:
        from shardfusion.live_memory import _storages

        out, self.labels = {}, {}
        for part, items in self._parts().items():
            found: dict = {}
            for item in items:
                name, t = item if isinstance(item, tuple) else (None, item)
                if not isinstance(t, torch.Tensor):
                    continue
                for key, st in _storages([local_tensor(t)]).items():
                    found[key] = st
                    if name is not None:
                        self.labels[key] = name
            out[part] = found
        return out


def memory_watch(b: Built) -> Callable[[], dict[str, dict]]:
    """The watched parts of variant ``b`` (``params``, ``grads``, ``optimizer`` kept across steps; ``full_params``,
    ``full_grads`` the gathered parameters and full-size gradients of each unit, labelled by unit: ``""`` the root,
    ``blocks.<i>`` a block), for :class:`shardfusion.live_memory.LiveMemory`. shardfusion's and DDP's come from
    ``shardfusion.live_memory.model_storages`` (DDP's gradients are its buckets); FSDP2's and DeepSpeed's are read
    from their internals as :func:`library_tensors` and :func:`_deepspeed_groups` read them (best effort;
    DeepSpeed's reduce bucket, where its module gradients are copied to be reduced, is in ``full_grads`` as the
    unit ``"reduce bucket"``). Collective buffers that are none of these (FSDP2's reduce-scatter input, a copy of
    the gradients) count as ``comm_buffers`` (see ``LiveMemory``)."""
    from shardfusion.live_memory import model_storages

    if b.name in ("shardfusion", "ddp"):
        return model_storages(b.model, b.optimizer)
    if b.name == "fsdp2":
        return _Watch(lambda: _fsdp2_parts(b))
    if b.name in DEEPSPEED_VARIANTS:
        return _Watch(lambda: _deepspeed_parts(b))
    raise ValueError(f"unknown variant {b.name!r}")


def _units_of(model: GPT) -> str:
    """The granularity FSDP2 was applied with: ``"linear"`` when a block's first linear layer has FSDP state."""
    first = unit_modules(model, "linear")[0]
    return "linear" if hasattr(first, "_get_fsdp_state") else "block"


def _fsdp2_parts(b: Built) -> dict[str, list]:
    params = list(b.model.parameters())
    full, grads = [], []
    names = {m: n for n, m in b.model.named_modules()}
    for m in [b.model, *unit_modules(b.model, _units_of(b.model))]:
        name = names[m]
        pg = getattr(m._get_fsdp_state(), "_fsdp_param_group", None)
        if pg is None:
            continue
        full.append((name, getattr(getattr(pg, "_all_gather_result", None), "all_gather_output", None)))
        state = getattr(getattr(pg, "comm_ctx", None), "all_gather_state", None)
        full.append((name, getattr(getattr(state, "all_gather_result", None), "all_gather_output", None)))
        for fp in getattr(pg, "fsdp_params", []):
            full += [(name, t) for t in getattr(fp, "all_gather_outputs", [])]
            unsharded = getattr(fp, "_unsharded_param", None)
            full.append((name, unsharded))
            grads.append((name, getattr(unsharded, "grad", None)))
            grads.append((name, getattr(fp, "unsharded_accumulated_grad", None)))
    return {"params": params, "grads": [p.grad for p in params], "optimizer": optimizer_state_tensors(b.optimizer),
            "full_params": full, "full_grads": grads}


def _deepspeed_parts(b: Built) -> dict[str, list]:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    groups = b.persistent_groups()
    module = b.model.module
    full, grads = [], []
    for name, m in [("", None)] + [(f"blocks.{i}", blk) for i, blk in enumerate(module.blocks)]:
        ps = list(m.parameters()) if m is not None else _deepspeed_root_params(module)
        full += [(name, p.data) for p in ps
                 if getattr(p, "ds_status", None) in (ZeroParamStatus.AVAILABLE, ZeroParamStatus.INFLIGHT)]
        grads += [(name, p.grad) for p in ps]
    # the reduce bucket: the full gradients' staging buffer (they are views of it until reduced), kept between steps
    grads += [("reduce bucket", t) for t in _deepspeed_buckets(b.optimizer)]
    return {"params": groups["params"], "grads": groups["grads"], "optimizer": groups["optimizer"],
            "full_params": full, "full_grads": grads}


def _deepspeed_root_params(module: nn.Module) -> list:
    in_blocks = {id(p) for blk in module.blocks for p in blk.parameters()}
    return [p for p in module.parameters() if id(p) not in in_blocks]
