"""Trains the byte-level transformer on Python source, data-parallel, compressed all-reduce.

    python -m examples.nnx_char_lm.main --workdir /tmp/char_lm --codec dynamiq --bits 5

Run it from the repository root; ``--help`` lists every flag.
"""

from .. import flags
from .. import loop
from . import config
from . import train


PROG = "python -m examples.nnx_char_lm.main"


def build_parser():
  """The example's flags: every config field, with its meaning and default in ``--help``."""
  return flags.example_parser(config.get_config, prog=PROG, doc=__doc__)


def main(argv=None) -> dict:
  """Runs the example as ``argv`` (default: the command line) says; returns the metrics."""
  return loop.run_example(config.get_config, train.train_and_evaluate, argv, prog=PROG,
                            doc=__doc__)


if __name__ == "__main__":
  main()
