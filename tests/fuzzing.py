"""How many examples a property test runs under the current hypothesis profile (tests/conftest.py)."""

from hypothesis import settings


def at_least(n: int) -> int:
    """n examples, or the profile's count where it asks for more than hypothesis' default (tools/fuzz.py's
    long runs): a test's own count stands in local and CI runs."""
    wanted = settings().max_examples
    return max(n, wanted) if wanted > settings.get_profile("default").max_examples else n
