"""Padding of the flat buffers with shards cut on row boundaries (shape-true fragments) against the plain aligned
layout, on the models the job trains, at inner degrees 2, 4 and 8. Pure layout math: no processes, no tensors
(the models are built on the meta device).

    python -m benchmarks.row_padding [--degrees 2,4,8] [--out docs/shape-true-parameters.md]

Models: the GPT presets tiny, small, medium; GPT-MoE small (4 experts) and medium (8 experts); the job's HF presets
llama, qwen3_moe, mixtral (4 experts, top 2) at the shapes of ``HF_SHAPES`` (tiny: 2 layers of width 64, small: 4
of 128), and llama at width 4096 (two layers) for shards of a realistic size. HF models need transformers.

Each model is split into the units ``fully_shard`` makes by default in the job (the GPT's ``Block``s, an HF model's
decoder layers) and laid out buffer by buffer (dense and expert, one per dtype) as ``sf.plan.unit_sizes`` sees
them; expert buffers are sharded over the same degree (ep = 1). Per model and degree:

- ``params``: elements of the parameters (every unit, every buffer);
- ``old pad``: padding of the plain layout (parameters aligned, the buffer rounded up to ``inner * align``):
  ``round_up(packed, inner * align) - params`` per buffer, summed;
- ``new pad``: padding of ``layout.build_layout`` (rows kept whole, docs/shape-true-parameters.md);
- ``extra``: ``new pad - old pad`` in elements, and in % of the new buffers' total;
- ``max row``: the largest row (``prod(shape[1:])``) of any parameter: the per-boundary bound's scale;
- ``buffers``: flat buffers of the plain layout -> of the new one (``layout.row_groups`` splits a kind into row
  classes where one buffer would pad more than about a row per shard).

With ``--out`` the table replaces the part of that file between the ``<!-- row_padding -->`` markers.
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

import torch

MARK = "<!-- row_padding -->"
GPT_MODELS = {"gpt tiny": ("tiny", 0), "gpt small": ("small", 0), "gpt medium": ("medium", 0),
              "gpt-moe small (4 experts)": ("small", 4), "gpt-moe medium (8 experts)": ("medium", 8)}
HF_SHAPES = {"tiny": dict(n_layer=2, n_head=4, d_model=64, seq_len=64),
             "small": dict(n_layer=4, n_head=4, d_model=128, seq_len=128),
             # the width of a 7B model (two layers: every layer is laid out alike), to see shards of realistic size
             "d4096": dict(n_layer=2, n_head=32, d_model=4096, seq_len=128)}


def _models():
    """``(label, meta model, unit classes)`` for every model measured; HF ones only when transformers is there."""
    import dataclasses

    from shardfusion.models import GPT, PRESETS, Block

    for label, (preset, experts) in GPT_MODELS.items():
        config = dataclasses.replace(PRESETS[preset], n_experts=experts) if experts else PRESETS[preset]
        with torch.device("meta"):
            yield label, GPT(config), (Block,)
    try:
        from shardfusion.train import hf_models
        hf_models.import_transformers()
    except ValueError:
        return
    for name in hf_models.HF_MODELS:
        for shape_name, shape in HF_SHAPES.items():
            if shape_name == "d4096" and name != "llama":
                continue
            config = hf_models.preset_config(name, **shape, n_experts=0 if name == "llama" else 4, top_k=2,
                                             expert_hidden=None, dropout=0.0, aux_loss_coef=0.0)
            with torch.device("meta"):
                model = hf_models.build_model(config)
            yield f"hf {name} {shape_name}", model, hf_models.unit_classes(model)


def _old_padded(shapes, count: int, align: int) -> int:
    end = 0
    for shape in shapes:
        if math.prod(shape):
            end = -(-end // align) * align + math.prod(shape)
    return -(-end // (count * align)) * count * align if end else 0


def measure(model, units, degrees) -> dict[int, dict]:
    """Per degree: params, old and new padded elements, max row, summed over the model's buffers."""
    from shardfusion._runtime.layout import build_layout, row_groups, row_numel
    from shardfusion.plan import unit_sizes

    buffers = []
    dtype = next(model.parameters()).dtype
    align = max(1, 16 // torch.tensor([], dtype=dtype).element_size())
    for u in unit_sizes(model, units=units):
        buffers += list(u.buffer_shapes) + list(u.expert_buffer_shapes)
    out = {}
    for count in degrees:
        row = {"params": 0, "old": 0, "new": 0, "max_row": 0, "buffers": 0, "split": 0}
        for shapes in buffers:
            groups = row_groups(shapes, count, align)
            for group in groups:
                layout = build_layout([str(i) for i in group], [shapes[i] for i in group], count, align)
                row["params"] += layout.numel
                row["new"] += layout.padded_numel
            row["old"] += _old_padded(shapes, count, align)
            row["buffers"] += 1
            row["split"] += len(groups)
            row["max_row"] = max([row["max_row"]] + [row_numel(s) for s in shapes if len(s) > 1])
        out[count] = row
    return out


def table(degrees) -> str:
    lines = ["| model | inner | params | old pad | old pad % | new pad | new pad % | extra | extra % | max row | "
             "buffers |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, model, units in _models():
        for count, r in measure(model, units, degrees).items():
            old, new = r["old"] - r["params"], r["new"] - r["params"]
            lines.append(f"| {label} | {count} | {r['params']:,} | {old:,} | {100 * old / r['old']:.3f} | {new:,} | "
                         f"{100 * new / r['new']:.3f} | {new - old:,} | {100 * (new - old) / r['new']:.3f} | "
                         f"{r['max_row']:,} | {r['buffers']} -> {r['split']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--degrees", default="2,4,8", help="inner degrees, comma-separated (default 2,4,8)")
    parser.add_argument("--out", default=None, help="a Markdown file whose part between the markers is replaced")
    args = parser.parse_args()
    degrees = [int(d) for d in args.degrees.split(",")]
    if any(d < 1 for d in degrees):
        raise ValueError(f"--degrees must be ints >= 1, got {args.degrees!r}")
    text = table(degrees)
    print(text)
    if args.out:
        path = Path(args.out)
        doc = path.read_text()
        if doc.count(MARK) != 2:
            raise ValueError(f"--out {path}: expected two {MARK!r} markers, found {doc.count(MARK)}")
        path.write_text(re.sub(f"{MARK}.*?{MARK}", lambda _: f"{MARK}\n{text}\n{MARK}", doc, flags=re.S))


if __name__ == "__main__":
    main()
