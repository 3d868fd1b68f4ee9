"""The README's API sketch runs as written: the first python block under "## The API", saved to a file and run with
`torchrun --standalone --nproc-per-node 4` (CPU: the sketch itself picks gloo when no GPU is visible), exits 0.
The meta-device block that follows it runs too, after the first (it uses its `topo`), without its
`sf.load_safetensors(model, "pretrained/")` line, marked optional, which needs a pretrained folder.
"""

from __future__ import annotations

import os
import re
import sys

import pytest

from harness import REPO, clean_env, run_command

TIMEOUT_S = 240  # each run takes about 15 s on 2 cores, start-up included


def api_blocks() -> list[str]:
    """The python code blocks of README.md's "## The API" section, in order."""
    text = (REPO / "README.md").read_text()
    start = text.index("\n## The API\n")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start:end if end != -1 else len(text)], re.S)


def torchrun(script: str, tmp_path) -> None:
    path = tmp_path / "sketch.py"
    path.write_text(script)
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    result = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                          str(path)], TIMEOUT_S, env=env)
    assert result.returncode == 0, f"the README's sketch failed:\n{script}\n{result.stdout[-3000:]}\n" \
                                   f"{result.stderr[-5000:]}"


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_api_sketch_runs_verbatim_under_torchrun(tmp_path):
    blocks = api_blocks()
    assert len(blocks) >= 2, "the API section should hold the sketch and the meta-device block"
    assert "for x, y in batches:" in blocks[0] and "batches = []" in blocks[0], "the sketch defines its batches"
    torchrun(blocks[0], tmp_path)


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_meta_device_block_runs_after_the_sketch(tmp_path):
    sketch, meta = api_blocks()[:2]
    kept = [line for line in meta.splitlines() if "sf.load_safetensors(" not in line]
    assert len(kept) == len(meta.splitlines()) - 1, "only the optional load_safetensors line is left out"
    torchrun(sketch + "\n".join(kept) + "\n", tmp_path)
