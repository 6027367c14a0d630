"""What the tree modules share: the argument check that raises a one-line `ValueError`."""


def require(ok: bool, message: str) -> None:
    """Raise `ValueError(message)` unless `ok`."""
    if not ok:
        raise ValueError(message)
