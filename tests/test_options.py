"""``ReduceOptions``: a reduction's options built and checked once, at the front door.

The transforms check their options when they are made (no trace, no axis bound), and
what the front doors pass down is one frozen, hashable object.
"""

from __future__ import annotations

import dataclasses

import pytest

import dynamiq_jax as dq
from dynamiq_jax.engine.options import ReduceOptions


def test_built_options_are_resolved_frozen_and_hashable():
  opts = ReduceOptions.build("allreduce", codec=dq.codecs.Bf16(), axis_name="data",
                             leaf_order=[1, 0], error_feedback="ef14")
  assert isinstance(opts.codec, dq.codecs.Bf16) and opts.codec is opts.buckets.codec  # held once
  assert opts.buckets.leaf_order == (1, 0) and opts.return_own and opts.feedback == "ef14"
  assert hash(opts) == hash(dataclasses.replace(opts))  # a static argument of a jit
  with pytest.raises(dataclasses.FrozenInstanceError):
    opts.average = False  # type: ignore[misc]
  default = ReduceOptions.build("compressed_psum", codec=None, default_codec=dq.codecs.F32(),
                                axis_name="data")
  assert isinstance(default.codec, dq.codecs.F32) and not default.return_own


@pytest.mark.parametrize("make, match", [
    # each refused where the transform is made, before any step is traced
    (lambda: dq.compressed_psum(schedule="spiral"), "spiral"),
    (lambda: dq.compressed_psum(bucket_size=1000), "bucket_size=1000"),
    (lambda: dq.compressed_psum(max_buckets=0), "max_buckets=0"),
    (lambda: dq.compressed_psum(packet_loss=dq.PacketLoss(0.1)), "two_step"),
    (lambda: dq.compressed_psum(schedule="moshpit", stacked="layers"), "stacked="),
    (lambda: dq.compressed_psum(schedule="hierarchical", stacked="layers",
                                axis_name=("host", "local")), "flat schedules"),
    (lambda: dq.compressed_psum(schedule="hierarchical"), r"axis_name=\(slow, fast\)"),
    (lambda: dq.compressed_psum(codec=dq.codecs.MX(), stacked="layers"), "keeps state"),
    (lambda: dq.compressed_psum_scatter(codec="thc"), "cannot reduce-scatter"),
    (lambda: dq.compressed_psum_scatter(error_feedback="ef21m"), "ef21m"),
])
def test_transforms_check_their_options_when_made(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_feedback_needs_a_codec_that_reports_its_contribution():
  with pytest.raises(ValueError, match="reports_contribution=False"):
    dq.compressed_psum(codec="dynamiq", error_feedback="ef14")


def test_a_bad_leaf_order_is_named():
  with pytest.raises(ValueError, match="leaf_order=3"):
    ReduceOptions.build("allreduce", codec="dynamiq", axis_name="data", leaf_order=3)
