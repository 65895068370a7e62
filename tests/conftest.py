import pathlib

import pytest

_TIER_BY_DIR = {"unit": "unit", "kernels": "kernels", "integration": "integration", "interop": "interop"}


def pytest_collection_modifyitems(config, items):
    """Each test's tier marker comes from its folder, so `-m unit` etc. select whole tiers."""
    for item in items:
        tier = _TIER_BY_DIR.get(pathlib.Path(item.fspath).parent.name)
        if tier:
            item.add_marker(getattr(pytest.mark, tier))
