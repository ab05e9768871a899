"""Argument checks at the Python API's boundary: a wrong type is a TypeError, a value
out of range a UserError (a ValueError), each naming the argument, what it must be and
what it got, instead of a traceback from deep inside or a silent result.

    n = check_int(n, "n", low=1)                    # 3 -> 3; 2.5 -> TypeError
    keep = check_fraction(keep, "keep")             # in (0, 1]
    check_instance(plan, "plan", PrunePlan, "make one with headlab.select")
"""

from __future__ import annotations

import math
import numbers

from headlab.errors import UserError

MAX_SEED = 2**63 - 1  # torch's generators take a signed 64-bit seed


def check_int(value, name: str, *, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an int, refused unless a whole number (no bool, no float such as
    32.0, no string) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a whole number (int), got {value!r} "
                        f"({type(value).__name__})")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        raise UserError(f"{name} must be {_range(low, high)}, got {value}")
    return value


def check_seed(value, name: str = "seed") -> int:
    """A seed torch's generators take: a whole number in [0, 2**63 - 1]."""
    value = check_int(value, name)
    if not 0 <= value <= MAX_SEED:
        raise UserError(f"{name} must be in [0, 2**63 - 1], got {value}")
    return value


def check_fraction(value, name: str, *, include_one: bool = True,
                   error: type[UserError] = UserError) -> float:
    """``value`` as a float in (0, 1] (or (0, 1) with ``include_one=False``); a value out
    of range raises ``error`` (a UserError, or a subclass such as DataError)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if math.isnan(value) or not (0 < value < 1 or (include_one and value == 1)):
        raise error(f"{name} must be in (0, {'1]' if include_one else '1)'}, got {value}")
    return value


def check_instance(value, name: str, expected: type | tuple[type, ...], hint: str) -> None:
    """Refuse ``value`` unless an instance of ``expected``; ``hint`` says where one comes
    from."""
    if not isinstance(value, expected):
        names = " or ".join(t.__name__ for t in (expected if isinstance(expected, tuple)
                                                 else (expected,)))
        raise TypeError(f"{name} must be a {names} ({hint}), got {type(value).__name__}")


def _range(low: int | None, high: int | None) -> str:
    if low is not None and high is not None:
        return f"in [{low}, {high}]"
    return f"at least {low}" if low is not None else f"at most {high}"
