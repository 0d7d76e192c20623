"""The examples: flags, devices, data, smoke runs at a tiny size, bit-identical restore.

The ``main.py`` runs happen in their own processes (they choose their own
device count); the rest runs in-process on conftest's 8 CPU devices.
"""

import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

import dynamiq_jax as dq

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the examples live beside the package, not inside it
  sys.path.insert(0, str(ROOT))

from examples import devices  # noqa: E402
from examples import flags  # noqa: E402
from examples import reduction  # noqa: E402
from examples import datasets  # noqa: E402
from examples import metrics  # noqa: E402
from examples.linen_pmap import config as linen_config  # noqa: E402
from examples.linen_pmap import train as linen_train  # noqa: E402
from examples.nnx_char_lm import config as lm_config  # noqa: E402
from examples.nnx_char_lm import train as lm_train  # noqa: E402
from examples.nnx_digits import config as digits_config  # noqa: E402
from examples.nnx_digits import train as digits_train  # noqa: E402


def _run_main(example, workdir, *flags):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run(
      [sys.executable, "-W", "error", "-m", f"examples.{example}.main", "--workdir",
       str(workdir), "--no-progress", *flags],
      cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
  assert out.returncode == 0, out.stderr[-4000:]
  return json.loads((workdir / "metrics.json").read_text()), out.stdout


def _check_run(metrics, steps):
  losses = metrics["train_loss"]
  assert len(losses) == len(metrics["step_time_s"]) == steps
  assert all(np.isfinite(losses)) and all(t > 0 for t in metrics["step_time_s"])
  assert np.mean(losses[-3:]) < 0.7 * losses[0], losses
  assert metrics["evals"][-1]["step"] == steps
  assert len(metrics["state_sha256"]) == 64


# -- flags, devices, reducers, data ---------------------------------------------


def test_flags_override_the_config_defaults():
  config = flags.parse_flags(digits_config.get_config(), [
      "--codec", "psum-bf16", "--bits", "4", "--schedule", "butterfly", "--devices", "4",
      "--steps", "7", "--seed", "3", "--workdir", "/tmp/x", "--batch-size", "64",
      "--no-progress"])
  assert (config.codec, config.bits, config.schedule, config.devices, config.steps,
          config.seed, config.workdir, config.batch_size, config.progress) == (
              "psum-bf16", 4.0, "butterfly", 4, 7, 3, "/tmp/x", 64, False)
  defaults = flags.parse_flags(digits_config.get_config(), [])
  assert defaults.devices is None and defaults.bits is None and defaults.codec == "dynamiq"


@pytest.mark.parametrize("argv", [["--codec", "no-such-codec"], ["--schedule", "tree"]])
def test_flags_reject_unknown_choices(argv, capsys):
  with pytest.raises(SystemExit):
    flags.parse_flags(digits_config.get_config(), argv)
  assert "invalid choice" in capsys.readouterr().err


def test_overridden_defaults_keep_the_shared_help(capsys):
  with pytest.raises(SystemExit):
    flags.parse_flags(lm_config.get_config(), ["--help"])
  help_text = " ".join(capsys.readouterr().out.split())
  assert "linear warm-up steps before the cosine decay (default: 40)" in help_text
  assert "global batch size in sequences (split over the devices) (default: 64)" in help_text


def test_linen_pmap_takes_the_digits_settings_but_dropout():
  linen, digits = linen_config.get_config(), digits_config.get_config()
  shared = [f.name for f in dataclasses.fields(linen)]
  # The Linen CNN has no Dropout, so no --dropout flag that would do nothing.
  assert {f.name for f in dataclasses.fields(digits)} - set(shared) == {"dropout"}
  assert linen == linen_config.Config(**{name: getattr(digits, name) for name in shared})
  for name in shared:  # the same help text too
    assert (flags._flag_metadata(linen_config.Config, name)
            == flags._flag_metadata(digits_config.Config, name)), name
  with pytest.raises(SystemExit):
    flags.parse_flags(linen, ["--dropout", "0.5"])


def test_tree_digest_hashes_typed_keys_as_their_data():
  key = jax.random.key(0)
  assert (metrics.tree_digest({"rng": key, "w": np.ones(3)})
          == metrics.tree_digest({"rng": jax.random.key_data(key), "w": np.ones(3)}))
  assert metrics.tree_digest(key) != metrics.tree_digest(jax.random.key(1))


def test_setup_checks_that_the_batch_splits_over_the_devices():
  with pytest.raises(ValueError, match="multiple of the 8 devices"):
    devices.setup(digits_config.get_config(batch_size=60))
  chosen, n, mesh = devices.setup(digits_config.get_config(batch_size=64, devices=4))
  assert n == len(chosen) == mesh.shape["data"] == 4


def test_every_registered_reducer_can_be_built_from_flags():
  for name in dq.REDUCERS:
    config = digits_config.get_config(codec=name)
    assert reduction.reducer_options(config) == {}, name  # no --bits: the codec's own default
    assert callable(reduction.make_reducer(config, "data").update), name
  assert reduction.reducer_options(digits_config.get_config(codec="dynamiq", bits=4)) == {"bits": 4}
  assert reduction.reducer_options(digits_config.get_config(codec="psum-bf16", bits=4)) == {}
  if "globalqsgd" in dq.REDUCERS:  # takes whole bits
    assert reduction.reducer_options(
        digits_config.get_config(codec="globalqsgd", bits=16.0)) == {"bits": 16}
    with pytest.raises(ValueError, match="whole bits"):
      reduction.reducer_options(digits_config.get_config(codec="globalqsgd", bits=4.5))


def test_wire_report_counts_what_each_rank_sends():
  params = {"w": np.zeros((300, 400), np.float32)}
  bf16 = reduction.wire_report(digits_config.get_config(codec="psum-bf16"), params, 8)
  assert bf16["bits_per_coord"] == 16
  assert bf16["bytes_per_rank_per_step"] == pytest.approx(2 * 120_000 * 2 * 7 / 8)
  five = reduction.wire_report(digits_config.get_config(codec="dynamiq", bits=5), params, 8)
  assert 4.5 < five["bits_per_coord"] <= 5.0
  assert five["vs_bf16"] == pytest.approx(five["bits_per_coord"] / 16, rel=1e-6)


def test_select_devices_uses_the_simulated_cpu_devices():
  assert len(devices.select_devices(None)) == 8
  assert [d.id for d in devices.select_devices(4)] == [0, 1, 2, 3]
  with pytest.raises(RuntimeError, match="fresh process"):
    devices.select_devices(64)


def test_validate_names_the_bad_setting():
  with pytest.raises(ValueError, match="REDUCERS"):
    flags.validate(digits_config.get_config(codec="nope"))
  with pytest.raises(ValueError, match="schedule"):
    flags.validate(digits_config.get_config(schedule="tree"))


def test_digit_batches_are_a_function_of_the_position():
  a = datasets.EpochBatches(100, 32, seed=1)
  b = datasets.EpochBatches(100, 32, seed=1)
  epoch = np.concatenate([a.indices(p) for p in range(3)])
  assert len(set(epoch.tolist())) == 96  # no repeats within an epoch
  assert np.array_equal(a.indices(7), b.indices(7))  # order of calls does not matter
  assert np.array_equal(b.indices(1), epoch[32:64])
  assert not np.array_equal(a.indices(3), a.indices(0))  # a new permutation per epoch


def test_corpus_is_deterministic_and_splits_by_file():
  one = datasets.python_source_corpus(max_bytes=200_000)
  two = datasets.python_source_corpus(max_bytes=200_000)
  assert one.sha256 == two.sha256 and one.files == two.files >= 2
  assert one.train.size >= 100_000 and one.held_out.size > 0
  assert one.train.size + one.held_out.size >= 200_000
  x, y = datasets.random_windows(one.train, 4, 16, seed=0, position=5)
  assert x.shape == y.shape == (4, 16)
  assert np.array_equal(x[:, 1:], y[:, :-1])
  x2, _ = datasets.random_windows(one.train, 4, 16, seed=0, position=5)
  assert np.array_equal(x, x2)


# -- the examples run ------------------------------------------------------------


def test_nnx_digits_main(tmp_path):
  metrics, stdout = _run_main("nnx_digits", tmp_path, "--devices", "4", "--steps", "24",
                              "--eval_every", "12", "--bits", "4", "--schedule", "butterfly")
  _check_run(metrics, 24)
  assert metrics["devices"]["count"] == 4
  options = metrics["reducer"]["options"]
  assert options["bits"] == 4.0
  assert options == {"bits": 4.0}
  assert metrics["reducer"]["schedule"] == "butterfly"
  assert metrics["reducer"]["codec"].startswith("DynamiQ(bits=4.0")
  assert 3.5 < metrics["wire"]["bits_per_coord"] <= 4.0
  assert [e["step"] for e in metrics["evals"]] == [12, 24]
  assert metrics["final"]["test_accuracy"] > 0.5  # 10 classes: chance is 0.1
  assert "nnx_digits: dynamiq" in stdout


def test_nnx_digits_model_keeps_batch_norm_and_dropout_state_and_evaluates_in_eval_mode():
  from dynamiq_jax.training.nnx import DataParallel
  from flax import nnx
  config = digits_config.get_config(codec="psum-f32", batch_size=64, features=8, hidden=16,
                                    dropout=0.5)
  _, n, mesh = devices.setup(config)
  data = datasets.load_digits(config.test_fraction)
  batch = devices.shard_batch(mesh, (data.x_train[:64], data.y_train[:64]))
  model = digits_train.make_model(config)
  assert [type(m) for m in (model.norm1, model.norm2, model.dropout)] == [
      nnx.BatchNorm, nnx.BatchNorm, nnx.Dropout]
  dp = DataParallel.create(model, reduction.make_optimizer(config), mesh=mesh)

  def model_state(state):
    m, _ = dp.merge(state)
    return (np.asarray(m.norm1.mean[...]), np.asarray(m.norm2.var[...]),
            int(m.dropout.rngs.count[...]))

  mean0, var0, count0 = model_state(dp.state)
  step = dp.train_step(digits_train.loss_fn, donate=False)
  state, _ = step(dp.state, batch)
  state, _ = step(state, batch)
  mean2, var2, count2 = model_state(state)
  assert not np.allclose(mean2, mean0) and not np.allclose(var2, var0)  # running statistics
  assert count2 == count0 + 2  # one dropout draw per step: new masks every step

  # Eval mode: each example's outputs depend on it alone (running statistics, no
  # dropout), so evaluating the batch shifted by one rank's share shifts the outputs; in
  # train mode the batch statistics and the per-rank masks change with the shift.
  shifted = devices.shard_batch(mesh, tuple(np.roll(a, 64 // n, axis=0)
                                            for a in (data.x_train[:64], data.y_train[:64])))
  losses = {}
  for eval_mode in (True, False):
    evaluate = dp.eval_step(digits_train.per_example, eval_mode=eval_mode)
    losses[eval_mode] = np.asarray(evaluate(state, batch)["loss"])
    again = np.asarray(evaluate(state, batch)["loss"])
    moved = np.roll(np.asarray(evaluate(state, shifted)["loss"]), -(64 // n))
    np.testing.assert_array_equal(losses[eval_mode], again)
    assert np.allclose(moved, losses[eval_mode], rtol=1e-5, atol=1e-6) == eval_mode, eval_mode
  assert model_state(state)[2] == count2  # evaluation advances no stream

  host, _ = dp.merge(state)  # the same numbers as the model's own eval mode, on the host
  host.eval()
  on_host = digits_train.per_example(host, (data.x_train[:64], data.y_train[:64]))["loss"]
  np.testing.assert_allclose(losses[True], np.asarray(on_host), rtol=1e-5, atol=1e-6)


def test_linen_pmap_main(tmp_path):
  metrics, _ = _run_main("linen_pmap", tmp_path, "--steps", "20", "--eval_every", "0")
  _check_run(metrics, 20)
  assert metrics["devices"]["count"] == 8
  assert metrics["reducer"]["schedule"] == "ring"
  assert max(metrics["step_time_s"][1:]) < metrics["step_time_s"][0] / 3  # compiled once
  assert metrics["replicas_identical"] is True
  assert metrics["final"]["test_accuracy"] > 0.5


def test_nnx_char_lm_runs(tmp_path):
  config = lm_config.get_config(
      steps=16, eval_every=8, dim=64, heads=2, layers=1, context=32, batch_size=32,
      corpus_bytes=300_000, eval_windows=64, learning_rate=1e-2, warmup_steps=4,
      progress=False, workdir=str(tmp_path))
  metrics = lm_train.train_and_evaluate(config)
  _check_run(metrics, 16)
  assert metrics["params"] >= 50_000
  assert metrics["corpus"]["held_out_bytes"] > 0 and metrics["corpus"]["eval_windows"] == 64
  evals = [e["eval_loss"] for e in metrics["evals"]]
  assert evals[-1] < evals[0] < np.log(256)  # below the uniform byte distribution
  assert json.loads((tmp_path / "metrics.json").read_text())["state_sha256"] == (
      metrics["state_sha256"])


# -- checkpoints -------------------------------------------------------------------


@pytest.mark.slow  # .ci/run-slow; tests/test_checkpoint.py restores bit for bit in seconds
@pytest.mark.parametrize("train, config", [
    (digits_train, digits_config.get_config(steps=8, batch_size=64, eval_every=0)),
    (linen_train, linen_config.get_config(steps=8, batch_size=64, eval_every=0)),
], ids=["nnx_digits", "linen_pmap"])
def test_restored_run_continues_bit_identically(train, config, tmp_path):
  config = dataclasses.replace(config, codec="dynamiq", checkpoint_every=4, progress=False)
  whole = train.train_and_evaluate(dataclasses.replace(config, workdir=str(tmp_path / "a")))
  assert {"4", "8"} <= set(os.listdir(tmp_path / "a" / "checkpoints"))

  # A run preempted after its step-4 checkpoint: only that checkpoint is left.
  shutil.copytree(tmp_path / "a" / "checkpoints", tmp_path / "b" / "checkpoints")
  shutil.rmtree(tmp_path / "b" / "checkpoints" / "8")
  resumed = train.train_and_evaluate(dataclasses.replace(config, workdir=str(tmp_path / "b")))

  assert resumed["resumed_from"] == 4 and resumed["restarts"] == [0, 4]
  assert resumed["train_loss"][4:] == whole["train_loss"][4:]  # computed again, equal bits
  assert resumed["state_sha256"] == whole["state_sha256"]
  assert resumed["final"] == whole["final"]
