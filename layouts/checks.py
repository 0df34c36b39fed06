"""Checks shared by the value classes and functions of every package, with messages that
name the attribute or argument, what it may be and what it got (attrs' own `in_` adds its
internals)."""

import numbers
import operator


def one_of(options: tuple):
    """An attrs validator: the value must be one of `options`."""

    def check(instance, attribute, value):
        if value not in options:
            raise ValueError(f"{attribute.name} must be one of {options}, got {value!r}")

    return check


def real_number(name: str):
    """An attrs converter to float that refuses what is not a real number (float() would
    take "2" or True)."""

    def convert(value) -> float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a number, got {value!r}")
        return float(value)

    return convert


def check_group_size(instance, attribute, value):
    """An attrs validator: a scale group's length, a positive int, or None for channel-wise."""
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"{attribute.name} must be a positive int or None (channel-wise), got {value!r}")


def integers(what: str):
    """An attrs validator: an integer array, or None; a float one would be truncated into
    silently wrong codes or indices (`what` says what the integers are)."""

    def check(instance, attribute, value):
        if value is not None and value.dtype.kind not in "iu":
            raise TypeError(f"{attribute.name} must be integers ({what}), got {value.dtype}")

    return check


_WEIGHT_FORMS = {2: "(N, K)", 3: "(E, N, K)"}


def weight_shape(name: str, shape, ndims: tuple[int, ...] = (2, 3)) -> tuple[int, ...]:
    """`shape` as a tuple of ints, if it is a weight's (N, K) (or (E, N, K), as `ndims` allow)
    of positive sizes; else ValueError naming `name`."""
    try:
        sizes = tuple(operator.index(size) for size in shape)
    except TypeError:
        sizes = ()
    if len(sizes) not in ndims or min(sizes) < 1:
        forms = " or ".join(_WEIGHT_FORMS[n] for n in ndims)
        raise ValueError(f"{name} must be {forms} of positive ints, got {shape!r}")
    return sizes


def check_per_expert(name: str, shape: tuple[int, ...], experts: tuple[int, ...], tail: tuple[int, ...] = ()) -> None:
    """Raise ValueError naming `name` unless `shape` is `tail` or (1,) + tail (shared by every
    expert) or `experts` + tail (one per expert; `experts` is () or (E,))."""
    allowed = dict.fromkeys((tail, (1,) + tail, experts + tail))
    if tuple(shape) not in allowed:
        raise ValueError(f"{name} must be shaped {' or '.join(map(str, allowed))}, got {tuple(shape)}")
