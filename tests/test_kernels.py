"""DynamiQ's Pallas kernels (pallas_kernels.dynamiq_triton) against their jnp
reference (pallas_kernels.dynamiq_reference), bit for bit, in interpret mode; their
dispatch (pallas_kernels.dynamiq); their lowering for cuda (the Pallas->Triton
lowering runs on this CPU machine)."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynamiq_jax as dq
from dynamiq_jax.codecs import DynamiQ
from pallas_kernels import dispatch as D
from pallas_kernels import dynamiq_block as B
from pallas_kernels import dynamiq as K
from pallas_kernels import dynamiq_reference as R
from pallas_kernels import plane_words
from pallas_kernels import dynamiq_triton as T
from pallas_kernels import triton_chunk
from pallas_kernels import rng

import gpu_compile_tools as GT
from _helpers import Jitted, lower_for, model_data, per_rank, rows_identical

EPS = {2: 0.23, 4: 0.18, 8: 0.10}
LATTICE = B.LATTICE
WS6 = (2, 3, 4, 5, 6, 8)
WS3 = (2, 4, 8)
TRITON = "__gpu$xla.gpu.triton"
RJ = Jitted(R)  # the references, each call one compiled program (not op by op)


def _keys(seed):
  k0, k1 = rng.derive_key(seed, 1)
  s0, s1 = rng.derive_key(seed, 2)
  return (k0, k1, s0, s1)


def _x(seed, s, dtype=jnp.float32):
  r = np.random.default_rng(seed)
  x = r.standard_normal((s, 256)) * np.exp(r.normal(0, 3, (s, 1)))
  x[0, :16] = 0.0  # a zero scale group
  if s > 2:
    x[2] = 0.0  # a zero super-group
  return jnp.asarray(x.astype(np.float32), dtype)


def _widths(seed, s, width_set, kind):
  """int32 [s], widest first: every width of the set ("mixed", random counts) or one."""
  r = np.random.default_rng(seed)
  if kind == "mixed":
    w = np.concatenate([list(width_set), r.choice(width_set, max(s - len(width_set), 0))])[:s]
  else:
    w = np.full(s, width_set[int(kind)] if kind.isdigit() else max(width_set))
  return jnp.asarray(np.sort(w)[::-1].copy(), jnp.int32)


def _units(widths, plane_bits, room):
  """Units used by ``widths`` plus ``room`` (negative: a payload too small, truncated)."""
  return max(int(np.sum(np.asarray(widths) // plane_bits)) + room, 0)


def _same(a, b):
  a, b = np.asarray(a), np.asarray(b)
  assert a.shape == b.shape and a.dtype == b.dtype
  np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


# (plane_bits, width_set, scale_rounding, strata, S, dtype, widths, room)
SLOW = pytest.mark.slow  # .ci/run-slow: the default tier keeps one case per plane width
# MEE levels (level_set="mee")
CASES = [
    pytest.param((1, WS6, "up", 1, 11, jnp.float32, "mixed", 5), marks=SLOW),
    (1, WS6, "stochastic", 8, 20, jnp.bfloat16, "mixed", 0),
    pytest.param((1, WS6, "up", 8, 3, jnp.float32, "1", 2), marks=SLOW),  # all 3-bit
    pytest.param((1, WS3, "up", 8, 13, jnp.bfloat16, "mixed", 40), marks=SLOW),  # unused units
    pytest.param((1, WS3, "stochastic", 1, 9, jnp.float32, "max", 0), marks=SLOW),  # all 8-bit
    (2, WS3, "up", 8, 11, jnp.bfloat16, "mixed", 3),  # UNUSED below
    pytest.param((2, WS3, "stochastic", 1, 20, jnp.float32, "0", 1), marks=SLOW),  # all 2-bit
    pytest.param((2, WS3, "up", 1, 5, jnp.float32, "mixed", -3), marks=SLOW),  # truncated
    # the kernels' own transpositions for codes of at most 4 and of 5 bits
    pytest.param((1, (2, 3, 4), "stochastic", 8, 12, jnp.bfloat16, "mixed", 1), marks=SLOW),
    pytest.param((1, (3, 5), "up", 8, 9, jnp.float32, "mixed", -2), marks=SLOW),
]
# the lattice levels (the default level set)
LATTICE_CASES = [
    (1, WS6, "up", 8, 20, jnp.bfloat16, "mixed", 0),  # the default codec's
    (1, WS6, "stochastic", 6, 11, jnp.float32, "mixed", 5),  # 7 strata: the prime path
    (2, WS3, "up", 1, 5, jnp.float32, "mixed", -3),  # too few units: truncated
    (1, (2, 3, 4), "stochastic", 8, 12, jnp.bfloat16, "mixed", 1),
    (1, (3, 5), "up", 16, 9, jnp.float32, "mixed", -2),  # and a truncated payload
    pytest.param((1, WS3, "up", 1, 9, jnp.float32, "max", 0), marks=SLOW),  # all 8-bit
    pytest.param((2, WS3, "stochastic", 8, 20, jnp.float32, "0", 1), marks=SLOW),  # all 2-bit
]


UNUSED = CASES[5]
assert UNUSED[0] == 2 and UNUSED[-1] > 0  # 2-bit planes, unused units


@pytest.mark.parametrize("planes", range(1, 9))
def test_plane_transposition_is_the_reference_layout(planes):
  """codes_to_planes / planes_to_codes (the kernels' bit transpositions, in
  their interpret-mode form) give the reference's plane bytes
  (dynamiq_reference.plane_bytes) for codes of ``planes`` bits, and back."""
  r = np.random.default_rng(planes)
  codes = r.integers(0, 2**planes, (64, 8)).astype(np.uint32)
  ref = np.asarray(R.plane_bytes(jnp.asarray(np.tile(codes, (1, 32))), plane_bits=1))[:, :planes, 0]
  got = plane_words.codes_to_planes(jnp.asarray(codes), planes)
  np.testing.assert_array_equal(np.stack([np.asarray(b) for b in got], 1), ref)
  words = [sum(jnp.asarray(ref[:, p]).astype(jnp.uint32) << (8 * (p % 4))
               for p in range(h, min(h + 4, planes))) if h < planes else None
           for h in (0, 4)]
  lane = jax.lax.broadcasted_iota(jnp.uint32, codes.shape, 1)
  np.testing.assert_array_equal(plane_words.planes_to_codes(words, lane, planes), codes)


def _case_id(c):
  pb, ws, sr, strata, s, dtype, kind, room = c
  return (f"p{pb}-w{''.join(map(str, ws))}-{sr}-strata{strata}-S{s}-{jnp.dtype(dtype).name}"
          f"-{kind}-room{room}")


def _with_levels(levels, name, cases):
  """``(levels, case)`` parameters of ``cases`` (a case or a ``pytest.param`` of one),
  keeping each one's marks."""
  out = []
  for c in cases:
    case, marks = (c.values[0], c.marks) if hasattr(c, "values") else (c, ())
    out.append(pytest.param(levels, case, marks=marks, id=f"{name}-{_case_id(case)}"))
  return out


@pytest.mark.parametrize("levels,case", _with_levels(EPS, "mee", CASES) +
                         _with_levels(LATTICE, "lattice", LATTICE_CASES))
def test_all_four_kernels_equal_the_reference(levels, case):
  """Bit for bit, and every payload byte is written: interpret mode starts an output
  buffer at zero, which would hide an unwritten byte (the unused units, or a truncated
  payload's last ones), so the payload kernels' buffer starts at 0xA5 here."""
  pb, ws, sr, strata, s, dtype, kind, room = case
  x = _x(s, s, dtype)
  widths = _widths(s, s, ws, kind)
  units = _units(widths, pb, room)
  geo = dict(eps=levels, plane_bits=pb, width_set=ws)
  enc = dict(keys=_keys(1), rank=5, strata=strata, scale_rounding=sr)
  p_ref = RJ.compress_reference(x, widths, units, **enc, **geo)
  assert p_ref.shape == (R.payload_bytes(s, units, pb),)
  _same(T.compress_pallas(x, widths, units, **enc, **geo, interpret=True, fill=0xA5), p_ref)
  _same(T.decompress_pallas(p_ref, widths, units, **geo, interpret=True),
        RJ.decompress_reference(p_ref, widths, units, **geo))
  _same(T.decompress_accumulate_pallas(p_ref, x, widths, units, **geo, interpret=True),
        RJ.decompress_accumulate_reference(p_ref, x, widths, units, **geo))
  enc2 = dict(enc, keys=_keys(2), rank=3)
  want = RJ.decompress_accumulate_recompress_reference(p_ref, x, widths, units, **enc2, **geo)
  _same(T.decompress_accumulate_recompress_pallas(p_ref, x, widths, units, **enc2, **geo,
                                                  interpret=True, fill=0xA5), want)
  # the plane offsets from the counts per width (a codec's allocation gives them) are the
  # kernels' own from the widths, and a hop given them writes the same bytes
  counts = [int(np.sum(np.asarray(widths) == w)) for w in sorted(ws)]
  ptab = T.plane_table(jnp.asarray(counts, jnp.int32), ws, pb, units)
  _same(ptab, triton_chunk.plane_table_of_widths(widths, pb, units))
  _same(T.decompress_accumulate_recompress_pallas(p_ref, x, widths, units, **enc2, **geo,
                                                  ptab=ptab, interpret=True, fill=0xA5), want)


def test_unused_units_are_zero_and_values_round_trip():
  """The unused units of a payload are zeros, written by the kernel (its buffer starts at
  0xA5). test_all_four_kernels_equal_the_reference's case with 3 unused 2-bit-plane units,
  called alike: its compiled kernels."""
  pb, ws, sr, strata, s, dtype, kind, room = UNUSED
  x = _x(s, s, dtype)
  widths = _widths(s, s, ws, kind)
  used = _units(widths, pb, 0)
  geo = dict(eps=EPS, plane_bits=pb, width_set=ws)
  enc = dict(keys=_keys(1), rank=5, strata=strata, scale_rounding=sr)
  p = T.compress_pallas(x, widths, used + room, **enc, **geo, interpret=True, fill=0xA5)
  assert room > 0 and not np.asarray(p)[R.payload_bytes(s, used, pb):].any()
  assert R.payload_bytes(s, used, pb) == sum(32 * int(w) + 18 for w in np.asarray(widths))
  y = np.asarray(T.decompress_pallas(p, widths, used + room, **geo, interpret=True))
  xs = np.asarray(x, np.float32)
  rel = np.linalg.norm(y - xs) / np.linalg.norm(xs)
  assert rel < 1.0, rel  # a lossy but sane reconstruction (2..8 bits)


@pytest.mark.parametrize("levels", [EPS, LATTICE], ids=["mee", "lattice"])
@pytest.mark.parametrize("case", ["zeros", "nan", "inf", "1e30", "1e-30"])
def test_edge_values_as_in_the_reference(case, levels):
  s = 9
  x = np.array(_x(5, s))
  if case == "zeros":
    x[:] = 0
  elif case == "nan":
    x[2, 40] = np.nan
  elif case == "inf":
    x[3, 7] = -np.inf
  else:
    x = x / np.abs(x).max() * float(case)
  x = jnp.asarray(x)
  widths = _widths(5, s, WS6, "mixed")
  units = _units(widths, 1, 0)
  geo = dict(eps=levels, width_set=WS6)
  p_ref = RJ.compress_reference(x, widths, units, keys=_keys(6), **geo)
  p_ker = T.compress_pallas(x, widths, units, keys=_keys(6), **geo, interpret=True)
  _same(p_ker, p_ref)
  y = T.decompress_pallas(p_ker, widths, units, **geo, interpret=True)
  _same(y, RJ.decompress_reference(p_ref, widths, units, **geo))
  if case == "zeros":
    np.testing.assert_array_equal(np.asarray(y), 0.0)
  if case in ("1e30", "1e-30"):
    assert np.all(np.isfinite(np.asarray(y)))


def test_float16_and_one_supergroup():
  x = _x(3, 1, jnp.float16)
  widths = jnp.asarray([5], jnp.int32)
  geo = dict(eps=EPS, keys=_keys(3), rank=1, strata=4)
  p = RJ.compress_reference(x, widths, 5, **geo)
  _same(T.compress_pallas(x, widths, 5, **geo, interpret=True), p)
  _same(T.decompress_accumulate_recompress_pallas(p, x, widths, 5, **geo, interpret=True),
        RJ.decompress_accumulate_recompress_reference(p, x, widths, 5, **geo))


@pytest.mark.parametrize("levels", [EPS, LATTICE], ids=["mee", "lattice"])
def test_unbiased_through_the_kernels(levels):
  s, draws = 4, 512
  x = _x(7, s)
  widths = jnp.asarray([5, 4, 3, 2], jnp.int32)
  units = _units(widths, 1, 0)

  def one(seed):
    p = T.compress_pallas(x, widths, units, eps=levels, keys=_keys(seed), rank=2, strata=8,
                          interpret=True)
    return T.decompress_pallas(p, widths, units, eps=levels, interpret=True)

  y = np.asarray(jax.jit(jax.vmap(one))(jnp.arange(draws)), np.float64)
  xs = np.asarray(x, np.float64)
  err, var = y.mean(0) - xs, y.var(0, ddof=1)
  for w in (np.ones_like(xs), np.sign(xs)):
    z = np.sum(w * err, 1) / np.sqrt(np.sum(var, 1) / draws + 1e-300)
    assert np.max(np.abs(z)) < 5.0, z


def test_other_launches_give_the_same_bits():
  """Other (block, num_warps) launches (bench.kernels --sweep; dynamiq_triton.TUNED) cut
  the chunk into other programs only: every kernel still equals the reference bit for
  bit (37 super-groups: a partial last program at both blocks), and every payload byte
  is written (output buffer started at 0xA5). The payload-writing kernels at (4, 2), their
  launch on an H200 (TUNED), the decodes at (32, 8): each kernel compiled at one launch
  (the programs' indexing is the launch's, shared by all four)."""
  s = 37
  x = _x(9, s, jnp.bfloat16)
  widths = _widths(9, s, WS6, "mixed")
  units = _units(widths, 1, 6)
  geo = dict(eps=EPS, plane_bits=1, width_set=WS6)
  enc = dict(keys=_keys(9), rank=1, strata=8, scale_rounding="stochastic")
  small, large = dict(interpret=True, launch=(4, 2)), dict(interpret=True, launch=(32, 8))
  p_ref = RJ.compress_reference(x, widths, units, **enc, **geo)
  _same(T.compress_pallas(x, widths, units, **enc, **geo, **small, fill=0xA5), p_ref)
  _same(T.decompress_pallas(p_ref, widths, units, **geo, **large),
        RJ.decompress_reference(p_ref, widths, units, **geo))
  _same(T.decompress_accumulate_pallas(p_ref, x, widths, units, **geo, **large),
        RJ.decompress_accumulate_reference(p_ref, x, widths, units, **geo))
  _same(T.decompress_accumulate_recompress_pallas(p_ref, x, widths, units, **enc, **geo,
                                                  **small, fill=0xA5),
        RJ.decompress_accumulate_recompress_reference(p_ref, x, widths, units, **enc, **geo))


def test_launch_config():
  """The default launch, a tuned entry for the target GPU, and clear errors for bad launches."""
  assert T.launch_config("compress", interpret=True) == (T.BLOCK, T.NUM_WARPS)
  assert T.launch_config("compress", (8, 4)) == (8, 4)
  for bad, match in [((16,), "two ints"), ("fast", "two ints"), ((12, 4), "power of two"),
                     ((16, 3), "num_warps"), ((4, 4), "block >= 8")]:
    with pytest.raises(ValueError, match=match):
      T.launch_config("compress", bad)
  with pytest.raises(ValueError, match="power of two"):
    T.compress_pallas(_x(1, 4), _widths(1, 4, WS6, "mixed"), 40, eps=EPS, keys=_keys(1),
                      interpret=True, launch=(6, 2))
  mesh = GT.abstract_h100_mesh((1,), ("gpu",))
  kind = mesh.abstract_device.device_kind
  saved = dict(T.TUNED)
  try:
    T.TUNED[kind] = {"compress": (32, 8)}
    with jax.sharding.use_abstract_mesh(mesh):
      assert T.launch_config("compress") == (32, 8)
      assert T.launch_config("decompress") == (T.BLOCK, T.NUM_WARPS)
  finally:
    T.TUNED.clear()
    T.TUNED.update(saved)


@pytest.mark.slow  # .ci/run-slow
def test_vmap_maps_the_kernels_over_a_batch():
  """Batched x, keys and widths (each batch element its own chunk); the unbatched
  payload case is covered by broadcasting in the rule."""
  s, pb, b = 6, 1, 2
  geo = dict(eps=EPS, plane_bits=pb, width_set=WS6)
  xs = jnp.stack([_x(10 + i, s) for i in range(b)])
  ws = jnp.stack([_widths(10 + i, s, WS6, "mixed") for i in range(b)])
  units = max(_units(w, pb, 2) for w in ws)
  seeds = jnp.arange(b, dtype=jnp.uint32)

  def enc(x, w, seed, impl):
    keys = tuple(k + seed for k in _keys(4))
    return impl(x, w, units, keys=keys, rank=1, strata=8, **geo)

  ker = lambda *a, **k: T.compress_pallas(*a, **k, interpret=True)
  p = jax.vmap(lambda x, w, sd: enc(x, w, sd, ker))(xs, ws, seeds)
  p_ref = jax.vmap(lambda x, w, sd: enc(x, w, sd, R.compress_reference))(xs, ws, seeds)
  _same(p, p_ref)
  for i in range(b):  # and each element is the unbatched result
    _same(p[i], RJ.compress_reference(xs[i], ws[i], units, keys=tuple(
        k + seeds[i] for k in _keys(4)), rank=1, strata=8, **geo))
  dec = jax.vmap(lambda p, w: T.decompress_pallas(p, w, units, **geo, interpret=True))
  _same(dec(p, ws), jax.vmap(lambda p, w: RJ.decompress_reference(p, w, units, **geo))(p, ws))
  acc = jax.vmap(lambda p, x: T.decompress_accumulate_pallas(p, x, ws[0], units, **geo,
                                                                    interpret=True))
  _same(acc(p, xs), jax.vmap(lambda p, x: RJ.decompress_accumulate_reference(
      p, x, ws[0], units, **geo))(p, xs))
  hop = lambda impl: jax.vmap(lambda p, x, w: impl(p, x, w, units, keys=_keys(5), strata=8, **geo))
  _same(hop(lambda *a, **k: T.decompress_accumulate_recompress_pallas(
      *a, **k, interpret=True))(p, xs, ws),
        hop(R.decompress_accumulate_recompress_reference)(p, xs, ws))


@pytest.mark.slow  # two ring compiles, one in interpret mode; each kernel's parity: above
def test_ring_with_kernels_equals_xla_on_8_devices(mesh):
  g = model_data("heavy", 8, 1 << 15, 1)
  codec = DynamiQ(bits=5)

  def reduce(impl):
    return lambda x: dq.allreduce(x, axis_name="data", codec=codec, key=jax.random.key(4),
                                  implementation=impl)[0]

  ker = per_rank(mesh, reduce("pallas"), g)
  ref = per_rank(mesh, reduce("xla"), g)
  assert rows_identical(ker)
  _same(ker, ref)


def test_allreduce_lowers_inside_shard_map_with_check_vma():
  """As ``dq.data_parallel_step`` runs them (``check_vma=True``), lowered for cuda
  over a mesh of (abstract) H100s. (Interpret mode cannot run there on jax 0.10.2:
  its interpreter indexes a varying ref with an invarying index and check_vma
  rejects that.)"""
  mesh = GT.abstract_h100_mesh((8,), ("data",))
  g = jax.ShapeDtypeStruct((8, 1 << 16), jnp.float32,  # large enough to be compressed
                           sharding=jax.sharding.NamedSharding(mesh, jax.P("data")))

  def body(x):
    return dq.allreduce(x[0], axis_name="data", codec=DynamiQ(bits=5), key=jax.random.key(4),
                        implementation="pallas")[0][None]

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=jax.P("data"), out_specs=jax.P("data"),
                            check_vma=True))
  assert TRITON in f.trace(g).lower(lowering_platforms=("cuda",)).as_text()


class TestDispatch:

  def _lowered(self, implementation, platform, pb=1):
    s, units = 11, 30
    ws = WS6 if pb == 1 else WS3
    f = lambda p, x, w: K.decompress_accumulate_recompress(
        p, x, w, units, eps=EPS, keys=_keys(0), plane_bits=pb, width_set=ws,
        implementation=implementation)
    args = (jax.ShapeDtypeStruct((R.payload_bytes(s, units, pb),), jnp.uint8),
            jax.ShapeDtypeStruct((s, 256), jnp.float32), jax.ShapeDtypeStruct((s,), jnp.int32))
    return lower_for(platform, jax.jit(f), *args)

  def test_default_is_chosen_by_the_lowering_platform(self, monkeypatch):
    # Triton's part of None; Mosaic GPU first for an H100: test_kernel_dispatch.TestMosaicFirst
    monkeypatch.setattr(D, "_mosaic_lowers", lambda op, kernels: False)
    assert self._lowered(None, "cuda").count(TRITON) == 1
    assert "stablehlo.while" not in self._lowered(None, "cuda")  # no XLA:CPU workaround on GPU
    cpu = self._lowered(None, "cpu")
    assert TRITON not in cpu and "stablehlo.while" in cpu  # the reference's materialize
    assert TRITON not in self._lowered("xla", "cuda")
    assert self._lowered("pallas", "cuda", pb=2).count(TRITON) == 1
    assert TRITON not in self._lowered("pallas", "cpu")  # interpreted

  def test_public_names_equal_the_reference_on_cpu(self):
    """The dispatching names give the reference's bits for every implementation. The
    default codec's case of test_all_four_kernels_equal_the_reference: its compiled
    references and decode kernels serve here too (the decodes called eagerly: each kernel
    is one jitted launch)."""
    _, ws, sr, strata, s, dtype, kind, room = CASES[1]
    x = _x(s, s, dtype)
    w = _widths(s, s, ws, kind)
    units = _units(w, 1, room)
    geo = dict(eps=EPS, plane_bits=1, width_set=ws)
    enc = dict(keys=_keys(1), rank=5, strata=strata, scale_rounding=sr)
    ref = RJ.compress_reference(x, w, units, **enc, **geo)
    eps_tuple = tuple(EPS.items())
    for impl in (None, "xla", "pallas"):
      p = jax.jit(lambda x, w: K.compress(x, w, units, **dict(geo, eps=eps_tuple), **enc,
                                          implementation=impl))(x, w)
      _same(p, ref)
    y_ref = RJ.decompress_reference(ref, w, units, **geo)
    _same(Jitted(K).decompress(ref, w, units, **geo), y_ref)  # one program, not op by op
    _same(K.decompress(ref, w, units, **geo, implementation="pallas"), y_ref)
    _same(K.decompress_accumulate(ref, x, w, units, **geo, implementation="pallas"),
          RJ.decompress_accumulate_reference(ref, x, w, units, **geo))

  def test_odd_widths_with_two_bit_planes_fall_back_to_the_reference(self):
    s = 4
    x = _x(7, s)
    w = _widths(7, s, WS6, "mixed")
    geo = dict(eps=EPS, plane_bits=2, width_set=WS6)
    with pytest.raises(NotImplementedError, match="odd widths"):
      T.compress_pallas(x, w, 12, keys=_keys(7), **geo, interpret=True)
    _same(Jitted(K).compress(x, w, 12, keys=_keys(7), **geo, implementation="pallas"),
          RJ.compress_reference(x, w, 12, keys=_keys(7), **geo))

  def test_bad_implementation(self):
    with pytest.raises(ValueError, match="implementation='cuda'"):
      K.decompress(jnp.zeros((82,), jnp.uint8), jnp.full((1,), 2, jnp.int32), 2, eps=EPS,
                   implementation="cuda")

  def test_unsupported_input_falls_back_and_says_so_once(self, caplog):
    x = _x(8, 3).astype(jnp.float8_e4m3fn)
    w = _widths(8, 3, WS6, "mixed")
    D._warned.clear()
    with caplog.at_level(logging.WARNING, logger="dynamiq_jax"):
      # two functions, each traced (and dispatched) anew: the first compiled (one program,
      # not one per operation), the second only traced
      call = lambda: lambda x, w: K.compress(x, w, 12, eps=EPS, keys=_keys(0),
                                             implementation="pallas")
      a = jax.jit(call())(x, w)
      b = jax.eval_shape(call(), x, w)
    _same(a, RJ.compress_reference(x, w, 12, eps=EPS, keys=_keys(0)))
    assert (b.shape, b.dtype) == (a.shape, a.dtype)
    msgs = [r.getMessage() for r in caplog.records if "float8" in r.getMessage()]
    assert len(msgs) == 1 and "using the XLA reference" in msgs[0]

  def test_bad_payload_size_names_the_fix(self):
    with pytest.raises(ValueError, match=r"payload_bytes\(4, 3, 1\)"):
      K.decompress(jnp.zeros((10,), jnp.uint8), jnp.full((4,), 2, jnp.int32), 3, eps=EPS,
                          implementation="pallas")


@pytest.mark.parametrize("plane_bits,width_set", [(1, WS6), (2, WS3)])
def test_lowers_for_gpu_with_triton(plane_bits, width_set):
  """Each unit kernel lowers for cuda (Pallas -> Triton) on this CPU machine."""
  s, units = 37, 150
  geo = dict(eps=EPS, plane_bits=plane_bits, width_set=width_set)
  x = jax.ShapeDtypeStruct((s, 256), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((s,), jnp.int32)
  p = jax.ShapeDtypeStruct((R.payload_bytes(s, units, plane_bits),), jnp.uint8)
  fns = [(lambda x, w: T.compress_pallas(x, w, units, keys=_keys(0), strata=8, **geo),
          (x, w), "compress"),
         (lambda p, w: T.decompress_pallas(p, w, units, **geo), (p, w), "decompress"),
         (lambda p, x, w: T.decompress_accumulate_pallas(p, x, w, units, **geo),
          (p, x, w), "decompress_accumulate"),
         (lambda p, x, w: T.decompress_accumulate_recompress_pallas(
             p, x, w, units, keys=_keys(0), strata=8, scale_rounding="stochastic", **geo),
          (p, x, w), "decompress_accumulate_recompress")]
  for f, args, name in fns:
    text = lower_for("cuda", jax.jit(f), *args)
    assert text.count(TRITON) == 1, name
    assert f"dynamiq_units_{name}_p{plane_bits}" in text


def test_kernels_lower_inside_shard_map_with_check_vma():
  """Inside ``jax.shard_map(check_vma=True)`` over (abstract) H100s each pallas_call
  declares how its output varies over the mesh (dispatch.typed_like), or tracing fails."""
  mesh = GT.abstract_h100_mesh((8,), ("data",))
  s, units = 8, 30
  sharded = lambda shape, dtype: jax.ShapeDtypeStruct(
      (8,) + shape, dtype, sharding=jax.sharding.NamedSharding(mesh, jax.P("data")))

  def body(x, w):
    x, w = x[0], w[0]
    p = K.compress(x, w, units, eps=EPS, keys=_keys(0), rank=jax.lax.axis_index("data"),
                          strata=8, implementation="pallas")
    p = K.decompress_accumulate_recompress(p, x, w, units, eps=EPS, keys=_keys(1),
                                                  strata=8, implementation="pallas")
    return K.decompress_accumulate(p, x, w, units, eps=EPS, implementation="pallas")[None]

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(jax.P("data"), jax.P("data")),
                            out_specs=jax.P("data"), check_vma=True))
  text = f.trace(sharded((s, 256), jnp.float32),
                 sharded((s,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count(TRITON) == 3


def test_plane_table_checks_its_input():
  with pytest.raises(ValueError, match=r"counts has shape \(3,\); give one count per width"):
    T.plane_table(jnp.zeros(3, jnp.int32), WS6, 1, 10)
  with pytest.raises(ValueError, match=r"ptab has shape \(8,\).*give int32 \[16\]"):
    T.decompress_pallas(jnp.zeros(R.payload_bytes(1, 8, 1), jnp.uint8),
                        jnp.full((1,), 8, jnp.int32), 8, eps=EPS, width_set=WS6,
                        ptab=jnp.zeros(8, jnp.int32), interpret=True)


@pytest.mark.parametrize("pieces", [1, 2])
def test_joined_parts_are_the_dense_block(pieces):
  """The Triton kernels' one array of a block's parts (``join_parts``) is the dense
  ``[S, G / 2, 2, CB, P]`` view with its pieces split out, and ``split_parts`` undoes it."""
  cfg = triton_chunk.Config(eps=(), width_set=(2, 8), plane_bits=1, scale_rounding="up", sg=3,
                  num_warps=4, pieces=pieces)
  dense = jnp.arange(3 * 256, dtype=jnp.int32).reshape(cfg.dense(3))
  parts = [dense[:, :, h, c, q * cfg.piece:(q + 1) * cfg.piece] for h, c, q in triton_chunk.part_keys(cfg)]
  joined = triton_chunk.join_parts(parts, cfg)
  np.testing.assert_array_equal(joined, dense.reshape(triton_chunk.joined_shape(cfg)))
  for got, want in zip(triton_chunk.split_parts(joined, cfg), parts, strict=True):
    np.testing.assert_array_equal(got, want)


def test_group_max_keeps_nan_across_a_transposed_block():
  """The group maximum is NaN where a group holds a NaN, also when XLA:CPU reduces an axis
  that is not the minor one (a joined block in interpret mode): its float reduction there
  drops NaN, so the block arithmetic takes it on the float bits."""
  x = np.zeros((16, 8, 8, 1, 2, 2), np.float32)  # a bf16 block stacked: [S, G / 2, P, 1, C, H]
  x[2, 1, 3, 0, 1, 0] = np.nan
  gmax = jax.jit(lambda v: B.group_max(jnp.transpose(v, (0, 1, 5, 4, 3, 2)), 3))(x)
  assert np.isnan(gmax[2, 1, 0]) and np.isnan(gmax).sum() == 1
