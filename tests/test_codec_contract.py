"""The codec contract: a codec written against it in one file, the metadata pass, import rules."""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynamiq_jax as dq
from dynamiq_jax import codecs
from dynamiq_jax.engine.programs import combine_metadata
from dynamiq_jax.codecs.supergroup_stats import SupergroupStats
from dynamiq_jax.schedules import axis_context

from _helpers import per_rank, rows_identical

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 8


def _readme_codec():
  """Runs docs/design.md's "Writing a codec" block; returns its namespace."""
  with open(os.path.join(ROOT, "docs", "design.md")) as f:
    text = f.read()
  section = text.split("## Writing a codec", 1)[1]
  block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  namespace = {}
  exec(compile(block, "docs/design.md (Writing a codec)", "exec"), namespace)
  return namespace


@pytest.fixture(scope="module")
def int8():
  return _readme_codec()["Int8"]


def test_readme_codec_is_short():
  block = _readme_codec.__code__  # the block itself is measured below
  del block
  with open(os.path.join(ROOT, "docs", "design.md")) as f:
    section = f.read().split("## Writing a codec", 1)[1]
  code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  body = code.split("class Int8Payload")[1].split("grads =")[0]
  lines = [line for line in body.splitlines() if line.strip() and not line.strip().startswith("#")]
  assert len(lines) <= 30, len(lines)


def test_readme_codec_reduces_within_its_bound(int8):
  g = np.random.default_rng(0).standard_normal((N, 1000)).astype(np.float32)
  out = np.asarray(dq.simulate(g, codec=int8()))
  assert rows_identical(out)
  mean = g.mean(0)
  # one int8 rounding per hop (n of them), each at most a quantum of the partial sum
  quantum = np.abs(g).sum(0).max() / N / 127
  assert np.abs(out[0] - mean).max() <= N * quantum
  assert 0 < np.abs(out[0] - mean).max()  # it is lossy: the test would see a no-op


def test_readme_codec_is_unbiased(int8):
  g = np.random.default_rng(1).standard_normal((4, 256)).astype(np.float32)
  outs = np.stack([np.asarray(dq.simulate(g, codec=int8(), seed=s))[0] for s in range(200)])
  err = outs.mean(0) - g.mean(0)
  se = outs.std(0) / np.sqrt(len(outs))
  assert np.all(np.abs(err) < 5 * se + 1e-7)


def test_readme_codec_under_shard_map_equals_simulate(int8, mesh):
  g = np.random.default_rng(2).standard_normal((N, 700)).astype(np.float32)
  key = jax.random.key(3)
  out = per_rank(mesh, lambda x: dq.allreduce(x, axis_name="data", codec=int8(), key=key)[0], g)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(dq.simulate(g, codec=int8(), key=key)))
  assert dq.wire_stats(jnp.zeros(700), codec=int8(), n=N).bits_per_coord == pytest.approx(
      int8().wire_bits(700, N) / 700)


def test_every_library_codec_implements_the_contract():
  for codec in [codecs.DynamiQ(), codecs.Bf16(), codecs.F32(), codecs.mxfp8(), codecs.mxfp4(),
                codecs.MX(scale="e8m0"), codecs.THC(), codecs.GlobalQSGD(),
                codecs.OmniReduce()]:
    assert isinstance(codec, codecs.Codec)
    hash(codec)  # a valid static jit argument
    assert (codec.init_state(1024, 4) is not None) == codec.stateful


def test_a_non_codec_is_refused_by_name():
  # a codec's name is a codec (tests/test_vocabulary.py); anything else is refused
  with pytest.raises(TypeError, match="neither a codec name nor a dynamiq_jax codec"):
    jax.vmap(lambda x: dq.allreduce(x, axis_name="i", codec=object(), key=jax.random.key(0)),
             axis_name="i")(jnp.ones((2, 8)))


class TestStatisticsAllReduce:
  """DynamiQ's metadata pass on its own: means add, norms combine as hypot."""

  @staticmethod
  def _combined(local, seed=0):
    """local [n, units, 2] per rank -> what every rank holds after the pass."""

    def one(x):
      ctx = axis_context("i")
      keys = dq.codecs.Keys.from_key(jax.random.key(seed), bucket=0, rank=ctx.rank())
      meta = dq.codecs.Metadata(x, combine=SupergroupStats())
      return combine_metadata(meta, ctx, keys)

    return np.asarray(jax.vmap(one, axis_name="i")(local))

  def test_norms_combine_as_the_root_of_summed_squares(self):
    rng = np.random.default_rng(0)
    n, units = 8, 64
    norms = np.exp(rng.normal(0, 2, (n, n, units))).astype(np.float32)
    norms = norms.astype(jnp.bfloat16).astype(np.float32)  # what each rank sends
    local = np.stack([np.zeros_like(norms), norms], axis=-1)  # [rank, chunk, units, 2]
    out = self._combined(local)
    assert rows_identical(out)
    want = np.sqrt(np.sum(norms.astype(np.float64) ** 2, axis=0))  # F = sum of local F
    got = out[0][..., 1]
    # two bf16 roundings (each rank's norm, then the owner's combined one)
    np.testing.assert_allclose(got, want, rtol=2 * 2.0**-8)
    # a plain sum of norms (the mistake this test exists for) is far outside that
    assert np.max(np.abs(norms.sum(0) / want - 1)) > 10 * n * 2.0**-8

  @pytest.mark.slow  # .ci/run-slow; the whole all-reduce's unbiasedness is tested in test_dynamiq
  def test_means_add_unbiased(self):
    rng = np.random.default_rng(1)
    n, units = 4, 32
    means = (rng.standard_normal((n, n, units)) * 1e-3).astype(np.float32)
    local = np.stack([means, np.zeros_like(means)], axis=-1)
    outs = np.stack([self._combined(local, seed=s)[0][..., 0] for s in range(64)])
    want = means.astype(np.float64).sum(0)
    # two bf16 roundings (each rank's mean, then the owner's sum), each within 2^-8
    bound = 2 * 2.0**-8 * np.abs(means.astype(np.float64)).sum(0)
    assert np.all(np.abs(outs[0] - want) <= bound)
    err = outs.mean(0) - want
    se = outs.std(0) / np.sqrt(len(outs)) + 1e-12
    assert np.mean(np.abs(err) < 4 * se) > 0.98


def test_import_rules_hold():
  """The layer rules of pyproject.toml's [tool.importlinter] (see the comments there)."""
  code = ("import sys; from importlinter.cli import lint_imports; "
          f"sys.exit(lint_imports(config_filename={os.path.join(ROOT, 'pyproject.toml')!r}))")
  res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=ROOT))
  assert res.returncode == 0, res.stdout + res.stderr
  assert res.stdout.count("KEPT") == 8 and "BROKEN" not in res.stdout, res.stdout
