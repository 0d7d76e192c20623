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


# -- the docs read as a manual -------------------------------------------------------------

DOCS = ROOT / "docs"
LOG_POINTER = "git show 49f2b26:docs/results.md"
"""The one commit the docs may name: where the measurement log up to the rewrite lives."""


def test_results_is_a_manual_of_at_most_40_kb():
  """A summary first, one current table per question, the history left to git."""
  text = (DOCS / "results.md").read_text()
  assert len(text.encode()) <= 40 * 1024, len(text.encode())
  assert re.findall(r"^## (.*)$", text, re.M)[0] == "Summary"
  assert LOG_POINTER in text


def _commit_hashes(text):
  """Hex words of 7 to 40 characters with a digit and a letter: what a short hash looks like."""
  return [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", text)
          if re.search(r"[a-f]", w) and re.search(r"[0-9]", w)]


@pytest.mark.parametrize("path", sorted(DOCS.glob("*.md")) + [ROOT / "README.md"],
                         ids=lambda p: p.name)
def test_no_work_log_in_the_manual(path):
  """No commit hashes, tracker numbers or work-log words: the docs describe the code as it is
  (the measured results files under ``docs/results/`` name the commit they ran at)."""
  text = path.read_text().replace(LOG_POINTER, "")
  assert not _commit_hashes(text), _commit_hashes(text)
  log = re.findall(r"(?i)\bissue\s*#?\d+|(?<![\w/&])#\d+\b|\bstop \d+\b|\bsessions?\b"
                   r"|an earlier note|lost to a restart", text)
  assert not log, log


def _anchors(path):
  """GitHub's anchors of a Markdown file's headings (fenced code left out)."""
  text = re.sub(r"^```.*?^```$", "", path.read_text(), flags=re.S | re.M)
  seen, anchors = {}, set()
  for heading in re.findall(r"^#+ (.*)$", text, re.M):
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
    anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
    seen[slug] = seen.get(slug, 0) + 1
  return anchors


@pytest.mark.parametrize("path", sorted(DOCS.glob("*.md")) + [ROOT / "README.md"],
                         ids=lambda p: p.name)
def test_links_between_the_docs_resolve(path):
  """Every relative link names a file that exists and, into a Markdown file, one of its headings."""
  text = re.sub(r"^```.*?^```$", "", path.read_text(), flags=re.S | re.M)
  for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", text):
    if target.startswith(("http://", "https://", "mailto:")):
      continue
    dest = path.parent / target if target else path
    assert dest.exists(), f"{path.name}: {target}"
    if anchor and dest.suffix == ".md":
      assert anchor in _anchors(dest), f"{path.name}: {target}#{anchor}"
