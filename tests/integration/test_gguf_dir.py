"""Weights from the worker's own disk (rpc-server --gguf-dir, protocol_spec.md §8.3) against our worker:
the same greedy text as uploading, the fallbacks (another file of the same name; a file that changed after
the worker started), and hostile LOAD_TENSORs closing only their own connection."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from orchestrator.graph.model import ModelFile
from orchestrator.pipeline.client import RpcClient, WorkerError
from orchestrator.pipeline.runner import Pipeline
from tools import reference
from tools.make_model import write_model
from wire import protocol as p
from wire.ggml import GGMLType, contiguous_strides
from wire.protocol import Command

PROMPT = [1, 504, 3126, 314, 260, 2017]
N_PREDICT = 6
TINY = dict(n_layer=2, n_embd=64, n_head=2, n_head_kv=1, n_ff=128)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The orchestrator's model; worker `same` holds a copy of it, worker `other` a file of the same name
    with other weights (another seed)."""
    root = tmp_path_factory.mktemp("gguf_dir")
    vocab = reference.model_path()
    model = write_model(root / "model.gguf", "llama", vocab_from=vocab, **TINY)
    (root / "same").mkdir()
    (root / "other").mkdir()
    shutil.copy(model, root / "same" / "model.gguf")
    write_model(root / "other" / "model.gguf", "llama", vocab_from=vocab, seed=1, **TINY)
    workers = {}
    try:
        for name in ("same", "other"):
            workers[name] = reference.start_worker("ours", root / "logs", threads=1, timeout=600,
                                                   extra=("--gguf-dir", str(root / name)))
        yield model, root, workers
    finally:
        for w in workers.values():
            w.stop()


def generate(model_path, endpoint) -> tuple[list[int], int, int]:
    """Greedy tokens of one worker's pipeline, bytes read from the worker's disk, weight bytes in all."""
    pipe = Pipeline(ModelFile(model_path), n_ctx=128, n_batch=64, n_ubatch=64, flash_attn=False)
    try:
        pipe.connect([endpoint])
        pipe.place()
        pipe.allocate()
        pipe.link()
        pipe.upload()
        out = [int(np.argmax(pipe.evaluate_prompt(PROMPT)))]
        while len(out) < N_PREDICT:
            out.append(int(np.argmax(pipe.evaluate_token(out[-1]))))
        return out, pipe.from_disk, sum(s.weight_bytes for s in pipe.stages)
    finally:
        pipe.close()


@pytest.fixture(scope="module")
def uploaded(setup):
    model, _, workers = setup
    tokens, from_disk, _ = generate(model, workers["other"].address)  # same name, other bytes: uploaded
    assert from_disk == 0
    return tokens


def test_loading_from_the_workers_disk_gives_the_uploaded_text(setup, uploaded):
    model, _, workers = setup
    tokens, from_disk, _ = generate(model, workers["same"].address)
    weights = ModelFile(model).weights
    assert from_disk == sum(w.data.nbytes for w in weights.values())
    assert tokens == uploaded


def test_a_tensor_changed_after_start_up_falls_back_to_set_tensor(setup, uploaded):
    """The worker's digest is of the file at start-up; a tensor edited since (in place) hashes otherwise."""
    model, root, workers = setup
    weights = ModelFile(model).weights
    victim = weights["blk.0.ffn_down.weight"]
    copy = root / "same" / "model.gguf"
    original = copy.read_bytes()[victim.offset:victim.offset + 64]
    with open(copy, "r+b") as f:
        f.seek(victim.offset)
        f.write(bytes(b ^ 0x5A for b in original))
    try:
        tokens, from_disk, _ = generate(model, workers["same"].address)
    finally:
        with open(copy, "r+b") as f:
            f.seek(victim.offset)
            f.write(original)
    assert from_disk == sum(w.data.nbytes for w in weights.values()) - victim.data.nbytes
    assert tokens == uploaded


def _tensor(handle, base, n):
    ne = (n, 1, 1, 1)
    return p.RpcTensor(id=1, type=GGMLType.F32, buffer=handle, ne=ne, nb=contiguous_strides(GGMLType.F32, ne),
                       data=base)


@pytest.mark.parametrize("case", ["offset past the file", "size overflow", "unknown file id",
                                  "range past the buffer"])
def test_hostile_loads_close_the_connection_and_the_worker_lives(setup, case):
    model, _, workers = setup
    worker = workers["same"]
    size = model.stat().st_size
    with RpcClient(worker.address) as c:
        ext = p.ExtHelloResponse.decode(c.call(Command.EXT_HELLO))
        assert ext.features & p.FEATURE_GGUF_FILES
        files = c.gguf_files()
        assert [f.size for f in files] == [size]
        handle, base = c.alloc_buffer(4096)
        file_id, offset, n, rec = 0, 0, 1024, _tensor(handle, base, 256)
        if case == "offset past the file":
            offset = size + 1
            n = 0
        elif case == "size overflow":
            offset, n = 64, (1 << 64) - 32
        elif case == "unknown file id":
            file_id = len(files)
        else:  # a tensor record claiming 8 KiB of a 4 KiB buffer
            rec, n = _tensor(handle, base, 2048), 8192
        c.load_tensor(rec, file_id, offset, n, 0)
        with pytest.raises(WorkerError, match="closed"):
            c.receive(Command.LOAD_TENSOR)
    with RpcClient(worker.address) as c:  # the worker still serves, and said why it closed the other
        assert c.device_memory()[1] > 0
    assert worker.alive() and "LOAD_TENSOR" in worker.log_tail()


def test_llamacpp_style_clients_see_no_change(setup):
    """Without EXT_HELLO nothing differs: the worker sends nothing unsolicited and upstream commands work."""
    _, _, workers = setup
    with RpcClient(workers["same"].address) as c:
        handle, base = c.alloc_buffer(64)
        rec = _tensor(handle, base, 16)
        c.set_tensor(rec, bytes(range(64)))
        assert c.get_tensor(rec, 64) == bytes(range(64))
