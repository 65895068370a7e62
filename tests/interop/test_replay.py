"""A recorded llama.cpp session (tools/trace_proxy.py --record) replays on any worker (tools/replay.py),
and our worker reads back exactly the bytes llama.cpp's worker gave.

The session is llama-completion with flash attention over a prompt of more than 256 tokens, so every
decoded token is one query over 512 KV positions: the case where ggml-cpu cuts the cache into one
slice per thread and merges the slices, so the result depends on the worker's -t. Both workers run
with a -t other than the default, which our worker must therefore take from its flag.
"""
from __future__ import annotations

import os

import pytest

from wire import protocol as p
from wire.protocol import Command
from tools.replay import Replayer, first_difference, read_recording, recorded_outputs
from tools.trace_proxy import Recording, TraceProxy, describe_graph

from .conftest import CLIENT_THREADS, RPC_TIMEOUT, reference

pytestmark = pytest.mark.interop

THREADS = (os.cpu_count() or 2) // 2 + 1  # not the default -t of either worker
PROMPT = "The keeper's log.\n" + " ".join(
    f"Day {i}: fog until noon, a schooner bound south, gulls unusually loud." for i in range(24)) + " Day 24:"


@pytest.fixture(scope="module")
def workers(bin_dir, tmp_path_factory):
    started = []
    try:
        for kind in ("reference", "ours"):
            started.append(reference.start_worker(kind, tmp_path_factory.mktemp(kind), threads=THREADS))
    except reference.WorkerFailed as exc:
        pytest.fail(str(exc), pytrace=False)
    finally:
        if len(started) < 2:
            for w in started:
                w.stop()
    yield dict(zip(("reference", "ours"), started))
    for w in started:
        w.stop()


@pytest.fixture(scope="module")
def recording(llama, model_path, workers, tmp_path_factory):
    """One llama-completion session against llama.cpp's worker, recorded."""
    path = tmp_path_factory.mktemp("recording") / "session.rpcrec"
    with TraceProxy(workers["reference"].address, record=path) as proxy:
        llama("llama-completion", ["-m", model_path, "-p", PROMPT, "-n", 4, "--ignore-eos", "--temp", 0, "-no-cnv",
                                   "-t", CLIENT_THREADS, "-c", 1024, "-fa", "on", "-ngl", 99, "-fit", "off",
                                   "--rpc", proxy.address], timeout=RPC_TIMEOUT, worker=workers["reference"])
    assert not proxy.parse_errors
    return path


def attention_shapes(path):
    """(q ne, k ne) of every FLASH_ATTN_EXT node the session computed."""
    shapes = []
    for entry in read_recording(path):
        if entry.kind == Recording.REQUEST and entry.command == Command.GRAPH_COMPUTE:
            graph = describe_graph(p.GraphComputeRequest.decode(memoryview(entry.payload)))
            shapes += [(tuple(n[5][0][1]), tuple(n[5][1][1])) for n in graph if n[0] == "FLASH_ATTN_EXT"]
    return shapes


def test_session_decodes_one_query_over_512_positions(recording):
    assert any(q[1] == 1 and q[3] == 1 and k[1] >= 512 for q, k in attention_shapes(recording))


@pytest.mark.parametrize("kind", ["reference", "ours"])
def test_replay_reads_back_the_recorded_bytes(recording, workers, kind):
    expected = recorded_outputs(recording)
    assert len(expected) >= 5  # the prompt's logits and one read per decoded token
    got = Replayer(workers[kind].address).run(recording)
    diff = first_difference(expected, got)
    assert diff is None, f"{kind} worker, replaying llama.cpp's worker's session: {diff}\n{workers[kind].describe()}"
