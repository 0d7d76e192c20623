"""Classic Flax Linen TrainState + jax.pmap loop with a compressed gradient all-reduce."""
