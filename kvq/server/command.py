"""`kvq serve` (being built: issue 6)."""


def register(sub) -> None:
    return None
