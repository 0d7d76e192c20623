"""Keywords renamed in this release, still accepted for one release with a warning."""

from __future__ import annotations

import warnings

__all__ = ["UNSET", "renamed"]


class _Unset:
  """The default of a renamed keyword: tells "not passed" from an explicit None."""

  def __repr__(self):
    return "UNSET"


UNSET = _Unset()


def renamed(new_value, old_value, *, new: str, old: str, where: str, stacklevel: int = 3):
  """The value of keyword ``new``, taking the deprecated ``old`` for one release.

  Args:
    new_value: what was passed as ``new`` (its default where not passed).
    old_value: what was passed as ``old``, or :data:`UNSET`.
    new, old: the keywords' names.
    where: the function, for the messages.
    stacklevel: as for ``warnings.warn``: 3 points at the caller of the function that
      calls this one.

  Returns:
    ``old_value`` (with a ``DeprecationWarning`` naming ``new``) if it was passed,
    else ``new_value``.

  Raises:
    TypeError: both were passed.
  """
  if old_value is UNSET:
    return new_value
  if new_value is not None:
    raise TypeError(f"{where}() got both {new}= and its old name {old}=. Fix: pass {new}= "
                    f"only")
  warnings.warn(f"{where}({old}=...) is renamed {new}=...; {old}= will be removed in the "
                f"next release. Fix: pass {new}={old_value!r}", DeprecationWarning,
                stacklevel=stacklevel)
  return old_value
