"""Mutation testing: which deliberate bugs the test suite catches ("kills").

Each entry of :data:`MUTATIONS` plants one bug that matters to a user (the bucket
chain removed, DropCompute's mean taken over the planned micro-batches, Mosaic
GPU's fallback removed, ...) by replacing one exact snippet of one source file, and
names the few tests that should fail under it. For each selected mutation this
driver

1. checks that the snippet occurs exactly once in its file (else the mutation is
   *stale*: the code moved on; update the entry);
2. writes the mutated file;
3. runs ``python -m pytest -p no:cacheprovider -n 0 -q -x <its tests>`` from the
   repository root (``PYTHONPATH`` the root, bytecode not written), with a timeout;
4. always restores the original file (bytes and modification time), on failure,
   timeout and Ctrl-C too;

and records the result: **killed** (pytest exit status 1: a test failed), **survived**
(0: every selected test passed, or was skipped: see the summary line kept with each
result), **error** (anything else: 2 interrupted or a collection error, 3 internal
error, 4 usage error, 5 no tests collected, or the timeout) or **stale**.

Usage::

    python tools/mutations.py [--only NAME ...] [--list] [--out PATH]
                              [--timeout SECONDS] [--baseline]

``--list`` prints the mutations and exits. ``--only`` runs the named ones (default:
all). ``--out`` is where the JSON record goes (default
``docs/results/mutations.json``, written by ``bench.common.write_tool_json``: the
command, the machine (date, commit, jax) and its load, and each mutation's result,
seconds and pytest's summary line).
``--baseline`` first runs every selected mutation's tests on the unmutated tree and
stops if they do not pass (a mutation "killed" by an already failing test says
nothing). The exit status is 1 if any mutation survived, errored or was stale.

The driver refuses to start if ``git status --porcelain`` shows changes to any file
it would mutate, so that it never overwrites uncommitted work. Run it on a quiet
machine: the tests compile XLA programs (each mutation's selection is a few tests,
seconds to a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import time
from typing import NamedTuple

from dynamiq_jax.bench import common

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_OUT = "docs/results/mutations.json"
DEFAULT_TIMEOUT_S = 900


class Mutation(NamedTuple):
  """One planted bug.

  name: short kebab-case id. what: the bug, in one sentence. path: the file, relative
  to the repository root. old: a snippet that occurs exactly once in it. new: what
  replaces it. tests: pytest arguments (node ids) of tests that should fail.
  """

  name: str
  what: str
  path: str
  old: str
  new: str
  tests: tuple[str, ...]


MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        name="bucket-chain-removed",
        what="Each bucket's program no longer reads the previous bucket's last collective "
             "(every bucket chains to the constant 0), so XLA may combine the buckets' "
             "collectives and nothing overlaps the backward pass.",
        path="dynamiq_jax/engine/programs.py",
        old="    after = results[-1].sent if results else None\n",
        new="    after = None  # mutation: the chain between buckets removed\n",
        tests=(
            # unchained, no bucket's sent is read: every program is pruned alike (one
            # lowered function instead of two)
            "tests/test_engine.py::test_buckets_of_one_shape_share_one_lowered_program[3]",
            # the behaviour itself (deviceless 8 x H100 compile; skipped without the
            # gpu-compile extra)
            "tests/test_overlap.py::"
            "test_default_overlaps_the_backward_pass_at_least_as_much_as_pmean",
        )),
    Mutation(
        name="dropcompute-planned-mean",
        what="DropCompute divides the gradient sums by the planned micro-batches per worker "
             "(M) instead of those that finished (C / n).",
        path="dynamiq_jax/training/dropcompute.py",
        old="    per = jnp.where(total > 0, total / np.float32(n), np.float32(1))\n",
        new="    per = np.float32(micro_batches)  # mutation: the planned count\n",
        tests=(
            "tests/test_dropcompute.py::test_weighted_mean_is_exact_with_f32",
            "tests/test_dropcompute.py::test_host_loop_stops_by_the_rule_and_averages_what_ran",
        )),
    Mutation(
        name="mosaic-fallback-removed",
        what="implementation=None uses a Mosaic GPU kernel without probing whether it lowers "
             "for the target GPU, so nothing falls back to Triton or the reference where it "
             "does not (jax 0.10.2, GPUs older than Hopper).",
        path="pallas_kernels/dispatch.py",
        old="  def mosaic():\n"
            "    if interpret or not _mosaic_lowers(op, kernels):\n"
            "      return None\n",
        new="  def mosaic():\n"
            "    if interpret or kernels.mosaic is None:  # mutation: no probe, no fallback\n"
            "      return None\n",
        tests=(
            "tests/test_kernel_dispatch.py::TestMosaicFirst::"
            "test_h100_gets_mosaic_gpu_on_jax_012_and_triton_with_a_warning_on_0_10",
            "tests/test_kernel_dispatch.py::TestMosaicFirst::test_a100_gets_triton",
            "tests/test_kernel_dispatch.py::TestMosaicAfterTriton::"
            "test_mosaic_gpu_where_triton_is_not_usable",
        )),
    Mutation(
        name="guard-ignores-the-vote",
        what="The non-finite guard never reports the ranks' agreed vote: a NaN or Inf on "
             "one rank is zeroed silently instead of skipping the step everywhere.",
        path="dynamiq_jax/engine/guard.py",
        old="  return bad > 0, jnp.where(finite, x, 0.0) * scale, scale\n",
        new="  return bad > 1, jnp.where(finite, x, 0.0) * scale, scale  # mutation\n",
        tests=(
            "tests/test_bad_input.py::test_nonfinite_stays_nonfinite_and_finite_stays_finite[f32]",
            "tests/test_transform.py::TestTraining::test_nan_on_one_rank_skips_the_step_everywhere",
        )),
    Mutation(
        name="ef14-residual-frozen",
        what="Error feedback (EF14) never updates its residual: e stays zero, and top-k's "
             "bias is not fed back.",
        path="dynamiq_jax/api/transform.py",
        old="  residual = PerRank(jax.tree.map(lambda p, c: (p - c)[None], grads, own))\n",
        new="  residual = PerRank(residual.tree)  # mutation: e <- e, never updated\n",
        tests=(
            "tests/test_baselines.py::TestErrorFeedback::test_residuals_recover_what_top_k_drops",
            "tests/test_baselines.py::TestErrorFeedback::"
            "test_data_parallel_step_shards_the_residual",
        )),
    Mutation(
        name="ef21m-sent-frozen",
        what="EF21-M never adds the compressed difference to what a rank has sent (u stays "
             "zero), so it compresses v itself every step instead of v - u.",
        path="dynamiq_jax/api/transform.py",
        old="  sent = jax.tree.map(lambda u, c: (u[0] + c)[None], residual.tree[\"sent\"], own)\n",
        new="  sent = residual.tree[\"sent\"]  # mutation: u <- u, never updated\n",
        tests=(
            "tests/test_arctopk.py::"
            "test_ef21m_transform_follows_the_formulas_and_keeps_replicas_equal",
        )),
    Mutation(
        name="independent-rounding",
        what="DynamiQ's correlated (stratified) rounding is replaced by independent draws on "
             "every rank (one stratum), whatever correlated= says.",
        path="dynamiq_jax/codecs/dynamiq.py",
        old="      args.update(strata=aux.layout.n if self.correlated else 1,\n",
        new="      args.update(strata=1,  # mutation: independent draws\n",
        tests=(
            "tests/test_dynamiq.py::TestAccuracy::test_correlated_rounding_beats_independent[iid]",
        )),
    Mutation(
        name="mean-not-divided",
        what="The all-reduce ignores average=True: workers no longer pre-divide by n, and "
             "the result is the sum, not the mean.",
        path="dynamiq_jax/api/allreduce.py",
        old="  xs = [pack(arrays, segs, ctx.n if opts.average else None) for segs in layout]\n",
        new="  xs = [pack(arrays, segs, None) for segs in layout]  # mutation: never divided\n",
        tests=(
            "tests/test_collectives.py::TestLossless::test_f32_ring_equals_psum_exactly[True]",
            "tests/test_api.py::TestUnboundAxisUnderPlainJit::test_bound_axis_runs",
        )),
    Mutation(
        name="drift-check-disabled",
        what="data_parallel_step no longer checks that replicated parameters get updates "
             "every rank shares, so a chain without a gradient reduction is not named as the "
             "cause (replicas would drift apart).",
        path="dynamiq_jax/training/step_checks.py",
        old="    if set(axes) & varying_axes(u):\n",
        new="    if False:  # mutation: the per-rank update check disabled\n",
        tests=(
            "tests/test_train_state.py::TestMissingReduction::"
            "test_names_the_reduction_to_put_first",
            "tests/test_train_state.py::TestMissingReduction::"
            "test_a_per_rank_reduction_still_names_per_rank",
        )),
    Mutation(
        name="moshpit-unweighted",
        what="Moshpit's weighted rounds give every present member the share 1 instead of the "
             "contributions its value holds, so after an absence a group's mean over-weights "
             "the ranks that averaged alone.",
        path="dynamiq_jax/engine/moshpit.py",
        old="      share = held / self.plan.held(t) if self.plan.weighted else jnp.float32(1)\n",
        new="      share = jnp.float32(1)  # mutation: weighted= ignored\n",
        tests=(
            "tests/test_moshpit.py::"
            "test_weighted_rounds_give_the_exact_mean_of_the_contributions_held",
        )),
    Mutation(
        name="packet-loss-key-reuse",
        what="The reduce step's simulated packet losses are drawn from a fixed key instead of "
             "the bucket's (step-dependent) key: the same packets are lost at every step.",
        path="dynamiq_jax/engine/programs.py",
        old="loss.lost_elements(loss_key(keys.state), REDUCE_HOP",
        new="loss.lost_elements(loss_key((0, 0)), REDUCE_HOP",
        tests=(
            "tests/test_lossy.py::"
            "test_estimator_is_unbiased_over_2000_keys_and_zero_fill_is_not[bernoulli]",
        )),
    Mutation(
        name="reduce-scatter-wrong-row",
        what="The reduce-scatter program ignores the schedule's root when it orders the "
             "ranks' rows, so on the ring each rank keeps its neighbour's shard (ZeRO steps "
             "update the wrong slice of the parameters).",
        path="dynamiq_jax/engine/programs.py",
        old="    x = jnp.roll(rows, -plan.root, axis=0).reshape(-1)",
        new="    x = rows.reshape(-1)  # mutation: the root's roll removed;",
        tests=(
            "tests/test_sharded.py::TestReduceScatter::"
            "test_f32_equals_psum_scatter_on_model_sharded_meshes[4x2]",
            "tests/test_sharded.py::TestShardedOptimizer::"
            "test_f32_zero_and_hsdp_follow_the_replicated_run[False]",
        )),
)


# ---------------------------------------------------------------------------


def _git(*args: str) -> str:
  return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                        check=True).stdout


def _dirty(paths) -> list[str]:
  """``git status --porcelain`` lines for ``paths`` (changes there: staged, unstaged,
  untracked)."""
  return [line for line in _git("status", "--porcelain", "--", *sorted(set(paths))).splitlines()
          if line.strip()]


def _pytest_args(tests) -> list[str]:
  return [arg for t in tests for arg in shlex.split(t)]


def _command(tests) -> list[str]:
  return [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-q", "-x",
          *_pytest_args(tests)]


def _summary(output: str) -> str:
  """pytest's last non-empty line (``1 failed, 2 passed in 30.1s``), or ''."""
  lines = [line.strip() for line in output.splitlines() if line.strip()]
  return lines[-1].strip("= ") if lines else ""


def _run_pytest(tests, timeout_s: float) -> tuple[int | None, str]:
  """(pytest's exit status, or None on timeout; its output). The child and whatever it
  starts run in a session of their own, killed as a group on timeout or interrupt."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
  env["PYTHONDONTWRITEBYTECODE"] = "1"  # no bytecode of a mutated file left behind
  proc = subprocess.Popen(_command(tests), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
  try:
    out, _ = proc.communicate(timeout=timeout_s)
    return proc.returncode, out
  except subprocess.TimeoutExpired:
    _kill_group(proc)
    out, _ = proc.communicate()
    return None, out
  except BaseException:
    _kill_group(proc)
    proc.communicate()
    raise


def _kill_group(proc):
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass


def _classify(code: int | None) -> str:
  if code == 1:
    return "killed"
  if code == 0:
    return "survived"
  return "error"


def run_mutation(m: Mutation, timeout_s: float) -> dict:
  path = ROOT / m.path
  record = {"name": m.name, "path": m.path, "tests": list(m.tests)}
  original = path.read_bytes()
  text = original.decode("utf-8")
  count = text.count(m.old)
  if count != 1:
    return {**record, "result": "stale", "seconds": 0.0, "exit_status": None,
            "summary": f"the snippet occurs {count} times in {m.path}, not once"}
  stat = path.stat()
  start = time.monotonic()
  try:
    path.write_bytes(text.replace(m.old, m.new, 1).encode("utf-8"))
    code, output = _run_pytest(m.tests, timeout_s)
  finally:
    path.write_bytes(original)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
  seconds = round(time.monotonic() - start, 1)
  summary = f"timed out after {timeout_s:g} s" if code is None else _summary(output)
  return {**record, "result": _classify(code), "seconds": seconds, "exit_status": code,
          "summary": summary, "output_tail": output[-3000:]}


def _print_list(mutations):
  for m in mutations:
    print(f"{m.name}\n  {m.what}\n  {m.path}")
    for t in m.tests:
      print(f"    {t}")


def _print_table(results):
  width = max([len(r["name"]) for r in results] + [8])
  print(f"\n{'mutation':<{width}}  {'result':<8}  {'seconds':>8}  pytest")
  for r in results:
    print(f"{r['name']:<{width}}  {r['result']:<8}  {r['seconds']:>8.1f}  {r['summary']}")


def main(argv=None) -> int:
  names = [m.name for m in MUTATIONS]
  p = argparse.ArgumentParser(prog="python tools/mutations.py",
                              description=__doc__.split("\n")[0])
  p.add_argument("--only", nargs="+", metavar="NAME", choices=names, default=None,
                 help="run only these mutations (default: all of them)")
  p.add_argument("--list", action="store_true",
                 help="print the mutations, their files and tests, and exit")
  p.add_argument("--out", default=DEFAULT_OUT,
                 help=f"where the JSON record goes, relative to the repository root "
                      f"(default: {DEFAULT_OUT})")
  p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                 help=f"seconds one mutation's pytest run may take before it counts as an "
                      f"error (default: {DEFAULT_TIMEOUT_S})")
  p.add_argument("--baseline", action="store_true",
                 help="first run every selected mutation's tests on the unmutated tree; "
                      "stop if they do not pass (default: off)")
  args = p.parse_args(argv)
  selected = [m for m in MUTATIONS if args.only is None or m.name in args.only]
  if args.list:
    _print_list(selected)
    return 0

  dirty = _dirty(m.path for m in selected)
  if dirty:
    print("refusing to start: uncommitted changes to files this would mutate:\n  "
          + "\n  ".join(dirty), file=sys.stderr)
    return 2

  baseline = None
  if args.baseline:
    tests = list(dict.fromkeys(t for m in selected for t in m.tests))
    start = time.monotonic()
    code, output = _run_pytest(tests, args.timeout * len(selected))
    baseline = {"exit_status": code, "seconds": round(time.monotonic() - start, 1),
                "summary": "timed out" if code is None else _summary(output)}
    print(f"baseline: {baseline['summary']}")
    if code != 0:
      print(output[-3000:], file=sys.stderr)
      print("refusing to mutate: the selected tests do not pass unmutated", file=sys.stderr)
      return 2

  results = []
  for m in selected:
    print(f"{m.name}: {m.path} ...", flush=True)
    r = run_mutation(m, args.timeout)
    print(f"  {r['result']} ({r['seconds']:.1f} s) {r['summary']}", flush=True)
    results.append(r)
  _print_table(results)

  common.write_tool_json(str(ROOT / args.out), "tools/mutations.py", argv, {
      "pytest": " ".join(_command(["<tests>"])[1:]),
      "timeout_s": args.timeout,
      "baseline": baseline,
      "results": results,
  })
  return 0 if all(r["result"] == "killed" for r in results) else 1


if __name__ == "__main__":
  sys.exit(main())
