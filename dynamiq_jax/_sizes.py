"""Integer size arithmetic shared by codecs and schedules."""

__all__ = ["ceil_div", "round_up"]


def ceil_div(a: int, b: int) -> int:
  """``ceil(a / b)`` for ``a >= 0``, ``b >= 1``, in integers."""
  return -(-a // b)


def round_up(a: int, b: int) -> int:
  """The smallest multiple of ``b`` that is >= ``a`` (``a >= 0``, ``b >= 1``)."""
  return ceil_div(a, b) * b
