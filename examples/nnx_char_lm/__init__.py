"""Flax NNX byte-level transformer on Python source, data-parallel with a compressed all-reduce."""
