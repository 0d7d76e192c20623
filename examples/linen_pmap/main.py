"""Trains the digits CNN with Flax Linen, a TrainState and jax.pmap, compressed all-reduce.

    python -m examples.linen_pmap.main --workdir /tmp/linen_pmap --codec dynamiq --bits 5

Run it from the repository root; ``--help`` lists every flag.
"""

from .. import flags
from .. import loop
from . import config
from . import train


PROG = "python -m examples.linen_pmap.main"


def build_parser():
  """The example's flags: every config field, with its meaning and default in ``--help``."""
  return flags.example_parser(config.get_config, prog=PROG, doc=__doc__)


def main(argv=None) -> dict:
  """Runs the example as ``argv`` (default: the command line) says; returns the metrics."""
  return loop.run_example(config.get_config, train.train_and_evaluate, argv, prog=PROG,
                            doc=__doc__)


if __name__ == "__main__":
  main()
