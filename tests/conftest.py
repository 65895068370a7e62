import os
import pathlib

import pytest

# The pinned reference is llama.cpp built with GGML_NATIVE=OFF (AVX2): every worker the tests start, the
# orchestrator's local ones included, computes as that build whatever this host's CPU is (rpc-server
# --isa reads PYRPC_ISA). tests/interop/test_avx512.py passes --isa avx512 for the AVX-512 build.
os.environ["PYRPC_ISA"] = "avx2"

_TIER_BY_DIR = {"unit": "unit", "kernels": "kernels", "integration": "integration", "interop": "interop"}


def pytest_collection_modifyitems(config, items):
    """Each test's tier marker comes from its folder, so `-m unit` etc. select whole tiers."""
    for item in items:
        tier = _TIER_BY_DIR.get(pathlib.Path(item.fspath).parent.name)
        if tier:
            item.add_marker(getattr(pytest.mark, tier))
