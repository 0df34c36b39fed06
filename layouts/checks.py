"""Attribute checks shared by the value classes of every package, with messages that name
the attribute, what it may be and what it got (attrs' own `in_` adds its internals)."""


def one_of(options: tuple):
    """An attrs validator: the value must be one of `options`."""

    def check(instance, attribute, value):
        if value not in options:
            raise ValueError(f"{attribute.name} must be one of {options}, got {value!r}")

    return check


def check_group_size(instance, attribute, value):
    """An attrs validator: a scale group's length, a positive int, or None for channel-wise."""
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"{attribute.name} must be a positive int or None (channel-wise), got {value!r}")
