"""One vocabulary across the front doors, and the common mistakes answered by name.

Codec names are accepted wherever a codec is (``dq.reducer``'s resolver), every
front door takes ``seed=`` / ``key=``, ``stacked=`` and ``packet_loss=`` alike (the
old names warn for one release), every list of schedules is complete, and
``tp_psum`` answers its own mistakes with the tensor-parallel fix.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynamiq_jax as dq
from dynamiq_jax.codecs import F32, ARCTopK, IntGroup
from dynamiq_jax.schedules import HIERARCHICAL, plan
from dynamiq_jax.schedules.names import FLAT_SCHEDULES, SCATTER_SCHEDULES, SCHEDULES
from dynamiq_jax.api.tp import TP_SCHEDULES

N = 4
G = np.random.default_rng(3).standard_normal((N, 2048)).astype(np.float32)  # host: no compile
KEY = jax.random.key(0)


def _vmap(f, g=G, jit=False):
  f = jax.vmap(f, axis_name="i")
  return np.asarray((jax.jit(f) if jit else f)(g))


def _tx(tx, g=G):
  """One update of the optax transform ``tx`` on every rank's row of ``g``."""

  def one(x):
    return tx.update(x, tx.init(x), x)[0]

  return _vmap(one, g)


# -- codec names wherever a codec is -------------------------------------------------------

FRONT_DOORS = {
    "allreduce": lambda c: _vmap(lambda x: dq.allreduce(x, axis_name="i", codec=c)[0]),
    "reduce_scatter": lambda c: _vmap(lambda x: dq.reduce_scatter(x, axis_name="i", codec=c)[0]),
    "simulate": lambda c: np.asarray(dq.simulate(G, codec=c)),
    "tp_psum": lambda c: _vmap(lambda x: dq.tp_psum(x, "i", codec=c), jit=True),
    "compressed_psum": lambda c: _tx(dq.compressed_psum("i", codec=c)),
    "compressed_psum_scatter": lambda c: _tx(
        dq.compressed_psum_scatter("i", codec=c, scatter_dimension=0)),
    "wire_stats": lambda c: np.asarray(dq.wire_stats(G[0], codec=c, n=N)[:3]),
}


@pytest.mark.parametrize("door", FRONT_DOORS)
def test_codec_names_are_accepted_by_every_front_door(door):
  run = FRONT_DOORS[door]
  by_name = run("int8")
  np.testing.assert_array_equal(by_name, run(IntGroup(bits=8)))
  assert not np.array_equal(by_name, run(F32()))  # the name chose the codec


@pytest.mark.parametrize("door", FRONT_DOORS)
def test_a_bad_codec_says_what_a_codec_is(door):
  with pytest.raises(ValueError, match=r"codec='int7' is not one of .*'int8'"):
    FRONT_DOORS[door]("int7")
  with pytest.raises(TypeError, match=r"codec=42 is neither a codec name nor .*codec='int8'"):
    FRONT_DOORS[door](42)


def test_compressed_psum_takes_a_name_where_it_used_to_fail():
  # was: AttributeError: 'str' object has no attribute 'default_error_feedback'
  tx = dq.compressed_psum("data", codec="arc-topk")
  assert tx.init(jnp.zeros(8)).residual is not None  # ARC-Top-K's EF14, from its name


# -- tp_psum's own mistakes -----------------------------------------------------------------

def test_tp_psum_outside_a_bound_axis_gives_the_tensor_parallel_fix():
  for call in (lambda: dq.tp_psum(jnp.ones(8), "model"),
               lambda: jax.jit(lambda x: dq.tp_psum(x, "model"))(jnp.ones(8))):
    with pytest.raises(dq.UnboundAxisError) as err:
      call()
    msg = str(err.value)
    assert "shard_map" in msg and "manual over that axis" in msg
    assert "axis_names={'model'}" in msg and "dq.nnx.DataParallel" in msg
    # not the gradient all-reduce's fix, which binds the data axis
    assert "data_parallel_step(loss_fn, tx" not in msg


@pytest.mark.parametrize("codec", [ARCTopK(), "arc-topk"], ids=["object", "name"])
def test_tp_psum_refuses_arc_topk_saying_why_and_what_instead(codec):
  with pytest.raises(ValueError) as err:
    _vmap(lambda x: dq.tp_psum(x, "i", codec=codec))
  msg = str(err.value)
  assert "error feedback" in msg and "'ef14'" in msg and "no next step" in msg
  assert "codecs.IntGroup(bits=8)" in msg


@pytest.mark.parametrize("codec", [dq.codecs.mxfp8(), dq.codecs.OmniReduce(), "mxfp8"],
                         ids=["mx-adaptive", "omnireduce", "mxfp8-name"])
def test_tp_psum_refuses_stateful_codecs_naming_stateless_ones(codec):
  with pytest.raises(ValueError, match=r"keeps state.*Fix: .*'mxfp8-ocp'"):
    _vmap(lambda x: dq.tp_psum(x, "i", codec=codec))


def test_tp_psum_accepts_what_it_suggests():
  exact = np.asarray(G.sum(0))
  for codec in ("int8", "int4", "dynamiq", "mxfp8-ocp", "bf16-ring"):
    got = _vmap(lambda x: dq.tp_psum(x, "i", codec=codec), jit=True)[0]
    assert np.linalg.norm(got - exact) / np.linalg.norm(exact) < 0.15, codec


# -- seed / key -----------------------------------------------------------------------------

def test_key_defaults_to_the_seed_as_in_simulate_and_compressed_psum():
  codec = IntGroup(bits=4, rounding="stochastic")  # (a 2048-value DynamiQ bucket is bf16)
  reduce = lambda **kw: _vmap(lambda x: dq.allreduce(x, axis_name="i", codec=codec, **kw)[0])
  default = reduce()
  np.testing.assert_array_equal(default, reduce(key=jax.random.key(0)))
  np.testing.assert_array_equal(default, np.asarray(dq.simulate(G, codec=codec)))
  assert not np.array_equal(default, reduce(seed=1))
  np.testing.assert_array_equal(reduce(seed=1), np.asarray(dq.simulate(G, codec=codec, seed=1)))
  scatter = lambda **kw: _vmap(
      lambda x: dq.reduce_scatter(x, axis_name="i", codec=codec, **kw)[0])
  np.testing.assert_array_equal(scatter(), scatter(key=jax.random.key(0)))
  # compressed_psum(seed=s) folds the step into jax.random.key(s), as simulate's docstring says
  np.testing.assert_array_equal(_tx(dq.compressed_psum("i", codec=codec, seed=1)),
                                reduce(key=jax.random.fold_in(jax.random.key(1), 0)))


# -- stacked= -------------------------------------------------------------------------------

LAYERED = {"layers": {"w": np.random.default_rng(5).standard_normal((N, 3, 512), np.float32)},
           "head": np.random.default_rng(6).standard_normal((N, 300), np.float32)}


def test_simulate_takes_stacked_and_layers_warns():
  out = dq.simulate(LAYERED, codec=F32(), stacked="layers")
  mean = jax.tree.map(lambda x: x.mean(0), LAYERED)
  np.testing.assert_allclose(np.asarray(out["layers"]["w"][1]), np.asarray(mean["layers"]["w"]),
                             rtol=1e-6, atol=1e-6)
  with pytest.warns(DeprecationWarning, match=r"simulate\(layers=...\) is renamed stacked=") as rec:
    old = dq.simulate(LAYERED, codec=F32(), layers="layers")
  assert rec[0].filename == __file__  # the warning points at the caller's line
  jax.tree.map(np.testing.assert_array_equal, old, out)
  with pytest.raises(TypeError, match="both stacked= and its old name layers="):
    dq.simulate(LAYERED, codec=F32(), stacked="layers", layers="layers")
  # the input is positional and called grads, so stacked= is free for the option
  with pytest.raises(ValueError, match="every leaf of `grads`"):
    dq.simulate({"a": jnp.ones((4, 8)), "b": jnp.ones((3, 8))}, codec=F32())


# -- packet_loss= ---------------------------------------------------------------------------

LOSS = dq.PacketLoss(p=0.2)
LOSSY = {
    "allreduce": lambda **kw: _vmap(lambda x: dq.allreduce(
        x, axis_name="i", codec=F32(), schedule="two_step", **kw)[0]),
    "reduce_scatter": lambda **kw: _vmap(lambda x: dq.reduce_scatter(
        x, axis_name="i", codec=F32(), schedule="two_step", **kw)[0]),
    "simulate": lambda **kw: np.asarray(dq.simulate(G, codec=F32(), schedule="two_step", **kw)),
    "compressed_psum": lambda **kw: _tx(dq.compressed_psum(
        "i", codec=F32(), schedule="two_step", **kw)),
    "compressed_psum_scatter": lambda **kw: _tx(dq.compressed_psum_scatter(
        "i", codec=F32(), schedule="two_step", scatter_dimension=0, **kw)),
}


@pytest.mark.parametrize("door", LOSSY)
def test_packet_loss_is_the_name_and_loss_warns(door):
  run = LOSSY[door]
  lossy = run(packet_loss=LOSS)  # no warning: pytest turns warnings into errors
  assert not np.array_equal(lossy, run())  # packets were lost
  with pytest.warns(DeprecationWarning, match=rf"{door}\(loss=...\) is renamed packet_loss="):
    np.testing.assert_array_equal(run(loss=LOSS), lossy)
  with pytest.raises(TypeError, match="both packet_loss= and its old name loss="):
    run(packet_loss=LOSS, loss=LOSS)
  with pytest.raises(ValueError, match="packet_loss= runs on schedule='two_step'"):
    dq.compressed_psum("i", codec=F32(), schedule="ring", packet_loss=LOSS)


# -- every list of schedules, complete ------------------------------------------------------

def _message(call) -> str:
  with pytest.raises(ValueError) as err:
    call()
  return str(err.value)


def _lists(msg: str, names) -> bool:
  return all(f"'{name}'" in msg for name in names)


def test_schedule_lists_come_from_one_place():
  assert tuple(plan._PLANS) == FLAT_SCHEDULES
  assert set(SCHEDULES) == set(FLAT_SCHEDULES) | {"hierarchical", "hierarchical-butterfly",
                                                   "moshpit"}
  assert set(HIERARCHICAL) <= set(SCATTER_SCHEDULES)
  assert set(TP_SCHEDULES) == set(FLAT_SCHEDULES)


def test_unknown_schedules_list_every_schedule():
  everything = {
      "allreduce": lambda s: _vmap(lambda x: dq.allreduce(x, axis_name="i", codec=F32(),
                                                          schedule=s)[0]),
      "simulate": lambda s: dq.simulate(G, codec=F32(), schedule=s),
      "compressed_psum": lambda s: dq.compressed_psum("i", schedule=s),
      "wire_stats": lambda s: dq.wire_stats(G[0], codec=F32(), n=N, schedule=s),
  }
  for door, call in everything.items():
    msg = _message(lambda: call("tree"))
    assert f"{door}: schedule='tree'" in msg and _lists(msg, SCHEDULES), msg
  scatters = {
      "reduce_scatter": lambda s: _vmap(lambda x: dq.reduce_scatter(
          x, axis_name="i", codec=F32(), schedule=s)[0]),
      "compressed_psum_scatter": lambda s: dq.compressed_psum_scatter("i", schedule=s),
  }
  for door, call in scatters.items():
    assert _lists(_message(lambda: call("tree")), SCATTER_SCHEDULES)
    msg = _message(lambda: call("moshpit"))
    assert f"{door} does not run schedule='moshpit'" in msg and _lists(msg, SCATTER_SCHEDULES)
  msg = _message(lambda: _vmap(lambda x: dq.tp_psum(x, "i", schedule="moshpit")))
  assert "tp_psum does not run schedule='moshpit'" in msg and _lists(msg, FLAT_SCHEDULES)
  assert _lists(_message(lambda: plan.get_plan("tree", 4)), FLAT_SCHEDULES)


def test_moshpit_runs_and_lists_every_flat_schedule_inside_its_groups():
  msg = _message(lambda: dq.Moshpit(inner="tree"))
  assert "inner='tree'" in msg and _lists(msg, FLAT_SCHEDULES)
  got = dq.simulate(G, codec=F32(), schedule=dq.Moshpit(grid=(2, 2), inner="two_step"))
  np.testing.assert_allclose(np.asarray(got[0]), np.asarray(G.mean(0)), rtol=1e-5, atol=1e-6)
