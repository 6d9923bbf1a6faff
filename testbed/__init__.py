"""testbed: real-network emulation of bit errors on data-center links, and what they do to AI training."""

__version__ = "0.1.0"


def register_kind(table: dict, cls: type, what: str) -> type:
    """Make `cls` known in `table` by its `name` (runtimes, engines: containerlab's self-registering kinds); the
    same class imported again is fine, two classes of one name are not."""
    if not cls.name:
        raise TypeError(f"{what} class {cls.__name__} has no name")
    known = table.get(cls.name)
    where = f"{cls.__module__}.{cls.__qualname__}"
    if known is not None and f"{known.__module__}.{known.__qualname__}" != where:
        raise ValueError(f"two {what}s named {cls.name!r}: {known.__module__}.{known.__qualname__} and {where}")
    table[cls.name] = cls
    return cls
