"""sf.load_safetensors (shardfusion/checkpoint/streaming.py): pretrained safetensors weights into a sharded model.

The reference is the files themselves: the test process builds eager GPTs of `shardfusion.models` (tiny, dense with
its tied lm head; and GPT-MoE with 4 experts) under seed 0, gives them buffers (a float one, a 0-d int64 one, a
non-persistent one; per-expert buffers in the MoE), and writes their state dicts with safetensors.torch.save_file:
one file; a folder of two files with a hand-written model.safetensors.index.json, the tied weight stored under its
second name; a bf16 copy; broken copies. One W=4 job builds the models under seed 1, shards them, loads, and reports
sf.full_state_dict, which must equal the file bitwise (after the file-to-model dtype conversion), in the layouts
I4O1 (sharding=4), I2O2 (sharding=4, outer 2, biases kept whole), MoE ep 2 and MoE ep 2 outer 2. A counting
wrapper around safe_open records the elements each rank reads: at most its fragments' covering rows. Refusals
(unexpected, missing, missing expert seen by one ep rank only, shape, dtype, truncated file, no file) raise the same
ValueError on every rank and copy nothing.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys

import pytest
import torch

from harness import raised, run_distributed
from reference import assert_bitwise
from shardfusion.models import GPT, PRESETS, VOCAB_SIZE

JOB_TIMEOUT_S = 300
DENSE = PRESETS["tiny"]
MOE = dataclasses.replace(PRESETS["tiny"], n_experts=4, top_k=2)
TIED = ("wte.weight", "lm_head.weight")
LAYOUTS = {"I4O1": ({"sharding": 4}, {}),
           "I2O2": ({"sharding": 4, "fsdp_outer_degree": 2}, {"replicate_filter": lambda n, p: n.endswith("bias")}),
           "ep2": ({"sharding": 4, "ep": 2}, {}),
           "ep2O2": ({"sharding": 4, "ep": 2, "fsdp_outer_degree": 2}, {})}
IDX = torch.randint(0, VOCAB_SIZE, (2, 16), generator=torch.Generator().manual_seed(7))  # (B, T)


def build(seed: int, moe: bool = False, ep_group=None) -> GPT:
    """A GPT (dense or MoE) under `seed`, with buffers whose values depend on the seed: `seen` (3,) float and
    `count` () int64 (persistent), `cache` (2,) (non-persistent), and in a MoE `seen` (2,) on every expert."""
    torch.manual_seed(seed)
    model = GPT(MOE if moe else DENSE, ep_group=ep_group)
    model.register_buffer("seen", torch.full((3,), float(seed)))
    model.register_buffer("count", torch.tensor(seed + 10))
    model.register_buffer("cache", torch.full((2,), float(seed)), persistent=False)
    for block in model.blocks if moe else ():
        for g, expert in block.mlp.experts.items():
            expert.register_buffer("seen", torch.full((2,), 100.0 * seed + int(g)))
    return model


def _once(full: dict) -> dict:
    """A full_state_dict as the files hold it: the tied weight once, under its first name."""
    assert torch.equal(full[TIED[0]], full[TIED[1]])
    return {k: v for k, v in full.items() if k != TIED[1]}


def reference(moe: bool = False) -> dict[str, torch.Tensor]:
    """The seed-0 model's state dict as a file holds it: the tied weight once (its first name), no non-persistent
    buffer."""
    return {k: v.clone() for k, v in build(0, moe).state_dict().items() if k != "lm_head.weight"}


def write_files(root: str) -> dict[str, str]:
    """Every file of the job, under `root`: {tag: path}."""
    from safetensors.torch import save_file
    dense, moe = reference(), reference(moe=True)
    paths = {}

    def save(tag: str, sd: dict) -> None:
        paths[tag] = os.path.join(root, f"{tag}.safetensors")
        save_file({k: v.contiguous() for k, v in sd.items()}, paths[tag], metadata={"format": "pt"})

    save("dense", dense)
    save("moe", moe)
    save("bf16", {k: v.bfloat16() if v.is_floating_point() else v for k, v in dense.items()})
    save("prefixed", {f"model.{k}": v for k, v in dense.items()})
    save("extra", {**dense, "blocks.0.attn.extra": torch.zeros(2)})
    save("missing", {k: v for k, v in dense.items() if k != "blocks.1.mlp.fc.bias"})
    save("shape", {**dense, "blocks.0.mlp.fc.weight": dense["blocks.0.mlp.fc.weight"].t()})
    save("dtype", {**dense, "wpe.weight": torch.zeros(dense["wpe.weight"].shape, dtype=torch.int64)})
    # expert 3 lives on ep rank 1 only (ep rank j holds experts 2j, 2j + 1): only those ranks can see it missing
    save("moe_missing", {k: v for k, v in moe.items() if k != "blocks.1.mlp.experts.3.proj.weight"})
    save("truncated", dense)
    with open(paths["truncated"], "r+b") as f:
        f.truncate(os.path.getsize(paths["truncated"]) - 100)
    # Hugging Face's sharded layout, by hand: two files and the index; the tied weight under its second name
    folder = paths["sharded"] = os.path.join(root, "sharded")
    os.makedirs(folder)
    names = [TIED[1] if k == TIED[0] else k for k in dense]
    halves = {"model-00001-of-00002.safetensors": names[:len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, part in halves.items():
        save_file({n: dense[TIED[0] if n == TIED[1] else n].contiguous() for n in part}, os.path.join(folder, file))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(v.numel() * v.element_size() for v in dense.values())},
                   "weight_map": {n: file for file, part in halves.items() for n in part}}, f)
    paths["nothing"] = os.path.join(root, "no-such-folder")
    return paths


# ---- the worker ----------------------------------------------------------------------------------------------------
class CountingOpen:
    """safetensors.safe_open that adds the elements of every tensor it returns to `reads[name]`."""

    reads: dict[str, int] = {}

    def __init__(self, file, framework, device="cpu") -> None:
        self._f = REAL_OPEN[0](file, framework=framework, device=device)

    def __enter__(self):
        self._f.__enter__()
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

    def keys(self):
        return self._f.keys()

    def get_tensor(self, name):
        t = self._f.get_tensor(name)
        self.reads[name] = self.reads.get(name, 0) + t.numel()
        return t

    def get_slice(self, name):
        return CountingSlice(self._f.get_slice(name), name, self.reads)


class CountingSlice:
    def __init__(self, view, name: str, reads: dict) -> None:
        self._view, self._name, self._reads = view, name, reads

    def get_shape(self):
        return self._view.get_shape()

    def get_dtype(self):
        return self._view.get_dtype()

    def __getitem__(self, index):
        t = self._view[index]
        self._reads[self._name] = self._reads.get(self._name, 0) + t.numel()
        return t


REAL_OPEN: list = []


def counted(load):
    """`load()` with safe_open counting: ``(its result, {name: elements read})``."""
    import safetensors
    REAL_OPEN[:] = [safetensors.safe_open]
    CountingOpen.reads = {}
    safetensors.safe_open = CountingOpen
    try:
        return load(), dict(CountingOpen.reads)
    finally:
        safetensors.safe_open = REAL_OPEN[0]


def covering(model) -> dict[str, int]:
    """Elements of the rows (first-dim range) covering each of this rank's non-empty fragments, and each persistent
    buffer's elements: the most a rank may read per name."""
    from shardfusion._runtime.local_state_dict import persistent_buffers
    from shardfusion._runtime.state import named_fragments
    out = {}
    for f in named_fragments(model):
        if f.numel:
            row = math.prod(f.shape[1:])
            out[f.name] = (-(-(f.offset + f.numel) // row) - f.offset // row) * row
    out.update({n: b.numel() for n, b in persistent_buffers(model)})
    return out


def sharded(layout: str, moe: bool = False, seed: int = 1):
    import shardfusion as sf
    from shardfusion.models.gpt import Block
    topo_kw, wrap_kw = LAYOUTS[layout]
    topo = sf.Topology(**topo_kw)
    model = build(seed, moe, topo.get_group("ep") if moe else None)
    return sf.fully_shard(model, topo, units=(Block,), **wrap_kw)


def refused(model, load) -> tuple:
    """``(type, message)`` of what `load()` raised, and whether the model's full state stayed as it was."""
    import shardfusion as sf
    before = sf.full_state_dict(model)
    kind, msg = raised(load)
    after = sf.full_state_dict(model)
    return kind, msg, all(torch.equal(before[k], after[k]) for k in before)


def job(paths: dict[str, str]) -> dict:
    import shardfusion as sf
    out: dict = {}

    def loaded(tag: str, model, path: str, count: bool = False, **kw) -> None:
        before = sf.full_state_dict(model)
        if count:
            result, reads = counted(lambda: sf.load_safetensors(model, path, **kw))
            out[f"{tag}-reads"] = (reads, covering(model))
        else:
            result = sf.load_safetensors(model, path, **kw)
        out[tag] = {"result": tuple(result), "before": before, "after": _once(sf.full_state_dict(model)),
                    "cache": model.cache.clone()}

    model = sharded("I4O1")
    out["logits-before-load"] = model(IDX)[0].detach()  # leaves the root unit gathered (never resharded after forward)
    loaded("I4O1-single", model, paths["dense"], count=True)
    out["logits"] = model(IDX)[0].detach()
    loaded("I4O1-sharded", sharded("I4O1"), paths["sharded"])
    loaded("I2O2-single", sharded("I2O2"), paths["dense"])
    loaded("I2O2-sharded", sharded("I2O2"), paths["sharded"], count=True)
    loaded("I4O1-bf16", sharded("I4O1"), paths["bf16"])
    loaded("ep2", sharded("ep2", moe=True), paths["moe"], count=True)
    loaded("ep2O2", sharded("ep2O2", moe=True), paths["moe"])
    loaded("key_map", sharded("I4O1"), paths["prefixed"], key_map=lambda n: n.removeprefix("model."))
    loaded("lenient-extra", sharded("I4O1"), paths["extra"], strict=False)
    loaded("lenient-missing", sharded("I4O1"), paths["missing"], strict=False)
    model = sharded("I4O1")
    for tag in ("extra", "missing", "shape", "dtype", "truncated", "nothing"):
        out[f"refused-{tag}"] = refused(model, lambda: sf.load_safetensors(model, paths[tag]))
    moe = sharded("ep2", moe=True)
    out["refused-moe_missing"] = refused(moe, lambda: sf.load_safetensors(moe, paths["moe_missing"]))
    return out


# ---- the tests -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    paths = write_files(str(tmp_path_factory.mktemp("streaming")))
    return paths, run_distributed(job, 4, paths, timeout=JOB_TIMEOUT_S)


def expected(file_sd: dict[str, torch.Tensor], dtype=None) -> dict[str, torch.Tensor]:
    """A file's tensors under the model's first names, floats converted to `dtype` (the model's)."""
    out = {TIED[0] if k == TIED[1] else k: v for k, v in file_sd.items()}
    return {k: v.to(dtype) if dtype is not None and v.is_floating_point() else v for k, v in out.items()}


def check_loaded(r: dict, want: dict, what: str) -> None:
    assert r["result"] == ([], []), (what, r["result"])
    assert_bitwise(r["after"], want, what)
    assert not torch.equal(r["before"]["wte.weight"], want["wte.weight"]), f"{what}: the load changed nothing"
    assert not torch.equal(r["before"]["seen"], want["seen"]), what
    assert torch.equal(r["cache"], torch.full((2,), 1.0)), f"{what}: the non-persistent buffer changed"


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_single_file_loads_bitwise_in_each_layout(runs):
    from safetensors.torch import load_file
    paths, ranks = runs
    want = expected(load_file(paths["dense"]))
    for rank, r in enumerate(ranks):
        for tag in ("I4O1-single", "I2O2-single"):
            check_loaded(r[tag], want, f"rank {rank} {tag}")


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_sharded_index_loads_bitwise_tied_weight_under_second_name(runs):
    from safetensors.torch import load_file
    paths, ranks = runs
    folder = paths["sharded"]
    file_sd = {k: v for f in sorted(os.listdir(folder)) if f.endswith(".safetensors")
               for k, v in load_file(os.path.join(folder, f)).items()}
    assert TIED[1] in file_sd and TIED[0] not in file_sd
    want = expected(file_sd)
    assert_bitwise(want, expected(load_file(paths["dense"])), "the two layouts of the files")
    for rank, r in enumerate(ranks):
        for tag in ("I4O1-sharded", "I2O2-sharded"):
            check_loaded(r[tag], want, f"rank {rank} {tag}")


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_bf16_file_into_fp32_model(runs):
    from safetensors.torch import load_file
    paths, ranks = runs
    file_sd = load_file(paths["bf16"])
    assert file_sd["wte.weight"].dtype == torch.bfloat16 and file_sd["count"].dtype == torch.int64
    want = expected(file_sd, torch.float32)
    for rank, r in enumerate(ranks):
        check_loaded(r["I4O1-bf16"], want, f"rank {rank} bf16")
        assert r["I4O1-bf16"]["after"]["wte.weight"].dtype == torch.float32


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_moe_each_ep_rank_loads_its_experts(runs):
    from safetensors.torch import load_file
    paths, ranks = runs
    want = expected(load_file(paths["moe"]))
    assert "blocks.1.mlp.experts.3.seen" in want
    for rank, r in enumerate(ranks):
        for tag in ("ep2", "ep2O2"):
            check_loaded(r[tag], want, f"rank {rank} {tag}")
        reads, _ = r["ep2-reads"]
        held = {n.split(".")[4] for n in reads if ".experts." in n}
        assert held == {str(2 * (rank % 2)), str(2 * (rank % 2) + 1)}, (rank, held)  # ep rank = rank % 2


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_loaded_model_computes_the_reference(runs):
    # the root unit was left gathered by a forward before the load: the next forward must see the loaded values
    _, ranks = runs
    ref = build(0)
    ref_logits, _ = ref(IDX)
    for rank, r in enumerate(ranks):
        assert not torch.allclose(r["logits-before-load"], ref_logits), rank
        torch.testing.assert_close(r["logits"], ref_logits.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_reads_only_covering_rows(runs):
    from safetensors.torch import load_file
    paths, ranks = runs
    totals = {"I4O1-single": sum(v.numel() for v in load_file(paths["dense"]).values()),
              "I2O2-sharded": sum(v.numel() for v in load_file(paths["dense"]).values()),
              "ep2": sum(v.numel() for v in load_file(paths["moe"]).values())}
    share = {"I4O1-single": 0.3, "I2O2-sharded": 0.55, "ep2": 0.3}  # 1/4, 1/2 (inner 2), 1/4 plus partial rows
    for rank, r in enumerate(ranks):
        for tag, total in totals.items():
            reads, bound = r[f"{tag}-reads"]
            file_names = {TIED[1]: TIED[0]}
            reads = {file_names.get(n, n): k for n, k in reads.items()}
            over = {n: (k, bound.get(n, 0)) for n, k in reads.items() if k > bound.get(n, 0)}
            assert not over, f"rank {rank} {tag}: read more than the covering rows (read, bound): {over}"
            assert sum(reads.values()) <= share[tag] * total, (rank, tag, sum(reads.values()), total)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_key_map_and_strict_false(runs):
    from safetensors.torch import load_file
    paths, ranks = runs
    dense = expected(load_file(paths["dense"]))
    for rank, r in enumerate(ranks):
        check_loaded(r["key_map"], dense, f"rank {rank} key_map")
        extra, missing = r["lenient-extra"], r["lenient-missing"]
        assert extra["result"] == ([], ["blocks.0.attn.extra"]), extra["result"]
        assert_bitwise(extra["after"], dense, f"rank {rank} strict=False, an extra name")
        assert missing["result"] == (["blocks.1.mlp.fc.bias"], []), missing["result"]
        kept = {k: v for k, v in dense.items() if k != "blocks.1.mlp.fc.bias"}
        assert_bitwise({k: v for k, v in missing["after"].items() if k in kept}, kept, f"rank {rank} missing")
        assert torch.equal(missing["after"]["blocks.1.mlp.fc.bias"], missing["before"]["blocks.1.mlp.fc.bias"])


def _refusal(ranks: list, tag: str) -> str:
    """The one message every rank raised for `tag`, after checking it is a ValueError that copied nothing."""
    kinds = [r[f"refused-{tag}"] for r in ranks]
    assert all(kind == "ValueError" for kind, _, _ in kinds), (tag, kinds)
    assert all(unchanged for _, _, unchanged in kinds), f"{tag}: a rank's model changed"
    msgs = {msg for _, msg, _ in kinds}
    assert len(msgs) == 1, f"{tag}: the ranks raised different messages: {msgs}"
    msg = msgs.pop()
    assert "nothing copied, on every rank" in msg, msg
    return msg


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_unexpected_name_refused_on_every_rank(runs):
    paths, ranks = runs
    msg = _refusal(ranks, "extra")
    assert "in the files but not in the model: 1 name: 'blocks.0.attn.extra'" in msg and paths["extra"] in msg, msg


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_missing_name_refused_on_every_rank(runs):
    msg = _refusal(runs[1], "missing")
    assert "missing from the files: 1 name: 'blocks.1.mlp.fc.bias'" in msg, msg


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_missing_expert_refused_on_every_rank(runs):
    # only the ranks of ep rank 1 hold expert 3; the others must raise the same error instead of going on
    msg = _refusal(runs[1], "moe_missing")
    assert "missing from the files: 1 name: 'blocks.1.mlp.experts.3.proj.weight'" in msg, msg


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_shape_mismatch_refused_on_every_rank(runs):
    paths, ranks = runs
    msg = _refusal(ranks, "shape")
    assert "'blocks.0.mlp.fc.weight': model (256, 64), file (64, 256)" in msg and paths["shape"] in msg, msg


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_integer_file_for_float_parameter_refused(runs):
    msg = _refusal(runs[1], "dtype")
    assert "'wpe.weight': file dtype torch.int64" in msg and "torch.float32" in msg, msg


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_truncated_file_refused_on_every_rank(runs):
    paths, ranks = runs
    msg = _refusal(ranks, "truncated")
    assert f"safetensors file {paths['truncated']!r} cannot be read" in msg and "ranks 0, 1, 2, 3" in msg, msg


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_missing_path_refused_on_every_rank(runs):
    paths, ranks = runs
    assert f"{paths['nothing']!r} does not exist" in _refusal(ranks, "nothing")


def test_without_safetensors_the_error_says_what_to_install(monkeypatch):
    import shardfusion as sf
    monkeypatch.setitem(sys.modules, "safetensors", None)  # `import safetensors` raises ImportError
    with pytest.raises(ImportError, match="pip install safetensors"):
        sf.load_safetensors(torch.nn.Linear(2, 2), "model.safetensors")
