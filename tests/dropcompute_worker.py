"""One process of tests/test_dropcompute.py's multi-process test (not a test itself).

    python tests/dropcompute_worker.py <coordinator host:port> <processes> <rank> <reducer>

Every process trains a linear model under ``dq.dropcompute_step`` with the
all-reduce ``dq.reducer(<reducer>)``;
the last process sleeps 0.15 s in each of its micro-batches when told to be slow.
Prints ``key=value`` words for the test to check.
"""

import sys
import time


def main(coordinator: str, processes: int, rank: int, reducer: str) -> None:
  from dynamiq_jax.training import multiprocess
  multiprocess.initialize(coordinator, num_processes=processes, process_id=rank)
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import dynamiq_jax as dq

  mesh = jax.make_mesh((jax.device_count(),), ("data",), devices=jax.devices())
  tx = optax.chain(dq.reducer(reducer, "data"), optax.sgd(0.1))
  d, m = 4096, 8
  rng = np.random.default_rng(rank)
  data = [(rng.standard_normal((4, d)).astype(np.float32), rng.standard_normal(4).astype(
      np.float32)) for _ in range(m)]

  def loss_fn(p, b):
    return jnp.mean((b[0] @ p["w"] - b[1]) ** 2)

  def batches(slow: bool):
    def fetch(i):
      if slow and rank == processes - 1:
        time.sleep(0.15)
      return data[i]
    return fetch

  repl = NamedSharding(mesh, P())

  def put(tree):
    return jax.tree.map(lambda a: jax.make_array_from_callback(
        np.shape(a), repl, lambda idx, a=np.asarray(a): a[idx]), tree)

  params0 = put({"w": np.zeros(d, np.float32)})
  opt0 = put(jax.tree.map(np.asarray, tx.init({"w": np.zeros(d, np.float32)})))
  budget = dq.dropcompute_step(loss_fn, tx, mesh=mesh, micro_batches=m,
                               policy=dq.DropCompute(threshold=0.5))
  # a budget no step reaches: the same compiled all-reduce as the 0.5 s one (whether that is
  # the synchronous step bit for bit: test_host_loop_all_finished_equals_the_synchronous_step)
  sync = dq.dropcompute_step(loss_fn, tx, mesh=mesh, micro_batches=m,
                             policy=dq.DropCompute(threshold=1e9))

  params, opt, _, _ = budget(params0, opt0, batches(False))  # compiles
  # the all-reduce and update: a step with no slowness, less this worker's compute
  params, opt, _, fast = budget(params, opt, batches(False))
  allreduce_s = fast.step_s - fast.compute_s[rank]
  params, opt, _, slow = budget(params, opt, batches(True))
  params, opt, _, waited = sync(params, opt, batches(True))
  w = np.asarray(params["w"].addressable_data(0))
  print(f"allreduce_s={allreduce_s:.4f} slow_step_s={slow.step_s:.4f} "
        f"finished={','.join(str(int(k)) for k in slow.finished_per_worker)} "
        f"sync_slow_step_s={waited.step_s:.4f} "
        f"digest={int(w.view(np.uint32).astype(np.uint64).sum())}", flush=True)


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
