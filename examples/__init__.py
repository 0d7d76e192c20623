"""Flax training examples that all-reduce gradients with ``dynamiq_jax``."""
