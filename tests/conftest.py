import os
import pathlib
import time

import pytest
from hypothesis import HealthCheck, settings

# The pinned reference is llama.cpp built with GGML_NATIVE=OFF (AVX2): every worker the tests start, the
# orchestrator's local ones included, computes as that build whatever this host's CPU is (rpc-server
# --isa reads PYRPC_ISA). tests/interop/test_avx512.py passes --isa avx512 for the AVX-512 build.
os.environ["PYRPC_ISA"] = "avx2"

# Hypothesis profiles. Locally the search is random (a new seed each run, failures replayed from
# .hypothesis/); with CI=true it is derandomized: the examples derive from each test's own source, so CI
# passes or fails on the code, never on the draw, and a failure prints its @reproduce_failure blob.
# Nothing time-based may fail a test in either (the machine is shared). tools/fuzz.py runs the long
# random search ("fuzz": PYRPC_FUZZ_EXAMPLES per test, a seed of its own). HYPOTHESIS_PROFILE overrides.
# (hypothesis loads a "ci" profile of its own when it sees a CI variable: ours start from its defaults)
_BASE = settings.get_profile("default")
_NO_CLOCK = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", _BASE, **_NO_CLOCK)
settings.register_profile("ci", _BASE, derandomize=True, print_blob=True, **_NO_CLOCK)
settings.register_profile("fuzz", _BASE, print_blob=True,
                          max_examples=int(os.environ.get("PYRPC_FUZZ_EXAMPLES", "5000")), **_NO_CLOCK)
_IN_CI = os.environ.get("CI", "").lower() in ("true", "1")
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if _IN_CI else "dev"))

_TIER_BY_DIR = {"unit": "unit", "kernels": "kernels", "integration": "integration", "interop": "interop"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Each test's tier marker comes from its folder, so `-m unit` etc. select whole tiers.

    With -n (pytest-xdist, `--dist loadgroup` in pyproject.toml) a test file runs in one process, so its
    module fixtures (workers, servers) start once; a file that names a parameter in XDIST_GROUP_BY is
    shared out by that parameter's values instead (test_chat_tools: one template family per group, each
    with its own servers), so the slowest file does not hold one process while the other idles."""
    for item in items:
        tier = _TIER_BY_DIR.get(pathlib.Path(item.fspath).parent.name)
        if tier:
            item.add_marker(getattr(pytest.mark, tier))
        group = item.nodeid.split("::")[0]
        by = getattr(getattr(item, "module", None), "XDIST_GROUP_BY", None)
        callspec = getattr(item, "callspec", None)
        if by is not None and callspec is not None and by in callspec.params:
            group += f"[{callspec.params[by]}]"
        item.add_marker(pytest.mark.xdist_group(group))
        item.stash[_GROUP] = group


_GROUP = pytest.StashKey[str]()


@pytest.hookimpl(wrapper=True, specname="pytest_collection_modifyitems")  # after pytest's own reordering
def pytest_collection_modifyitems_by_group(items):  # (a name of its own: the hook has two implementations here)
    """A group's tests run one after another (stably, in the order of each group's first test), so a file
    shared out by XDIST_GROUP_BY starts each group's module fixtures once without -n too: pytest's own
    reordering cannot see that test_chat_tools' (family, option) parameters share a family."""
    yield
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        first.setdefault(item.stash.get(_GROUP, ""), i)
    items.sort(key=lambda item: first[item.stash.get(_GROUP, "")])


# Time per tier (setup + call + teardown of its tests, fixtures included), printed at the end of every run:
# the CI log then says how long each tier took on that machine (docs/testing.md keeps a table of them).
# With pytest-xdist (-n) the tiers' times add up the processes' times, so the wall time is printed too.
_TIER_SECONDS: dict[str, float] = {}
_TIER_TESTS: dict[str, set] = {}
_FILE_SECONDS: dict[str, float] = {}
_STARTED = time.monotonic()


def pytest_runtest_logreport(report):
    tier = next((t for t in _TIER_BY_DIR.values() if t in report.keywords), "other")
    _TIER_SECONDS[tier] = _TIER_SECONDS.get(tier, 0.0) + report.duration
    _TIER_TESTS.setdefault(tier, set()).add(report.nodeid)
    path = report.nodeid.split("::")[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if not _TIER_SECONDS:
        return
    terminalreporter.section("time per tier")
    for tier, seconds in sorted(_TIER_SECONDS.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{tier:12s} {len(_TIER_TESTS[tier]):5d} tests {seconds / 60:7.1f} min")
    terminalreporter.write_line(f"{'all':12s} {sum(map(len, _TIER_TESTS.values())):5d} tests "
                                f"{sum(_TIER_SECONDS.values()) / 60:7.1f} min")
    workers = getattr(terminalreporter.config.option, "numprocesses", None)  # -n (the controller prints this)
    terminalreporter.write_line(f"{'wall':12s} {'':11s} {(time.monotonic() - _STARTED) / 60:7.1f} min"
                                + (f" ({workers} processes)" if workers else ""))
    terminalreporter.section("slowest files")  # where a cut of the CI time would pay
    for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:12]:
        terminalreporter.write_line(f"{seconds / 60:7.1f} min  {path}")
