"""Every ``python`` block of docs/guide.md runs as pasted, each in a fresh interpreter.

A fresh interpreter because each block sets ``jax_num_cpu_devices`` before
JAX starts, which only takes effect in a process where JAX has not started.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "guide.md"


def _python_blocks() -> list[tuple[str, str]]:
  """``(heading, code)`` of every fenced python block, named by the section it sits in."""
  blocks, heading = [], "top"
  fence = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
  text = GUIDE.read_text()
  for match in fence.finditer(text):
    # the prose before the block: a "# " comment inside an earlier code block is no heading
    prose = re.sub(r"^```.*?^```$", "", text[:match.start()], flags=re.S | re.M)
    headings = re.findall(r"^#+ (.*)$", prose, re.M)
    heading = headings[-1] if headings else heading
    blocks.append((heading, match.group(1)))
  return blocks


BLOCKS = _python_blocks()


def test_the_guide_has_its_sections():
  assert [h for h, _ in BLOCKS] == [
      "Using plain `jax.jit` with sharded arrays", "Flax NNX: `dq.nnx.DataParallel`",
      "Sharded models: tensor, FSDP and HSDP meshes",
      "Sharded models: tensor, FSDP and HSDP meshes",
      "Sparsification: ARC-Top-K and error feedback", "Scanned layers: `stacked=`",
      "Moshpit averaging: `schedule=\"moshpit\"`", "Lossy links: `packet_loss=dq.PacketLoss(p)`",
      "Tensor-parallel all-reduce: `dq.tp_psum`", "Checkpointing with Orbax",
      "Lowering for GPUs from a CPU host", "A CPU run stops with a rendezvous timeout"]


@pytest.mark.parametrize("code", [c for _, c in BLOCKS], ids=[h for h, _ in BLOCKS])
def test_block_runs(code, tmp_path):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(ROOT)] + os.environ.get("PYTHONPATH", "").split(os.pathsep)), JAX_PLATFORMS="cpu")
  # Warnings are errors here too, as in the rest of the suite.
  out = subprocess.run([sys.executable, "-W", "error", "-c", code], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr[-4000:]}"
