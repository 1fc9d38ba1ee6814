"""`kvq eval` (being built: issue 5)."""


def register(sub) -> None:
    return None
