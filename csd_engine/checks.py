"""Type checks that the constructors' validation shares: a count is an int and never a bool
(True would pass as 1), a setting a finite real number, text valid Unicode."""
import math
import numbers


def is_int(value) -> bool:
    """A Python int, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A finite int or float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_integral(value) -> bool:
    """A Python or NumPy integer, not a bool (a token id, a seed); a plain int without the ABC
    check (it runs on every prompt token)."""
    return type(value) is int or (isinstance(value, numbers.Integral) and not isinstance(value, bool))


def is_unicode(text: str) -> bool:
    """Whether `text` is valid Unicode: UTF-8 encodes it (a lone surrogate, which JSON's escapes
    and Python strings can hold but no decoded text does, fails)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True
