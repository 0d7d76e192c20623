"""Flax NNX CNN on scikit-learn digits, data-parallel with a compressed all-reduce."""
