"""Attribute checks shared by the value classes of every package, with messages that name
the attribute, what it may be and what it got (attrs' own `in_` adds its internals)."""


def one_of(options: tuple):
    """An attrs validator: the value must be one of `options`."""

    def check(instance, attribute, value):
        if value not in options:
            raise ValueError(f"{attribute.name} must be one of {options}, got {value!r}")

    return check
