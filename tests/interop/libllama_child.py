"""libllama.so (the pinned reference) driven from a child process, for oracles that call its C API.

Each oracle is a function `main(lib, vocab, request)`; `run` sends it, with `open_vocab` and the
structs below, to a fresh interpreter (so the library's globals and a crash stay there), feeds it the
JSON request on stdin and returns its JSON answer.
"""
from __future__ import annotations

import ctypes
import inspect
import json
import subprocess
import sys
from pathlib import Path

from .conftest import reference


class _ModelParams(ctypes.Structure):
    """struct llama_model_params of the pinned include/llama.h."""
    _fields_ = [("devices", ctypes.c_void_p), ("tensor_buft_overrides", ctypes.c_void_p),
                ("n_gpu_layers", ctypes.c_int32), ("split_mode", ctypes.c_int), ("load_mode", ctypes.c_int),
                ("lazy_mode", ctypes.c_int), ("main_gpu", ctypes.c_int32), ("tensor_split", ctypes.c_void_p),
                ("progress_callback", ctypes.c_void_p), ("progress_callback_user_data", ctypes.c_void_p),
                ("kv_overrides", ctypes.c_void_p), ("vocab_only", ctypes.c_bool), ("check_tensors", ctypes.c_bool),
                ("use_extra_bufts", ctypes.c_bool), ("no_host", ctypes.c_bool), ("no_alloc", ctypes.c_bool),
                ("load_mtp", ctypes.c_bool)]


def open_vocab(bin_dir: str, model: str):
    """libllama with its log silenced and `model`'s vocabulary loaded (vocab_only): (lib, vocab)."""
    lib = ctypes.CDLL(str(Path(bin_dir) / "libllama.so"))
    lib._log_callback = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(lambda *_: None)
    lib.llama_log_set(lib._log_callback, None)
    lib.llama_model_default_params.restype = _ModelParams
    lib.llama_model_load_from_file.argtypes = [ctypes.c_char_p, _ModelParams]
    lib.llama_model_load_from_file.restype = ctypes.c_void_p
    lib.llama_model_get_vocab.argtypes = [ctypes.c_void_p]
    lib.llama_model_get_vocab.restype = ctypes.c_void_p
    lib.llama_backend_init()
    params = lib.llama_model_default_params()
    params.vocab_only = True
    handle = lib.llama_model_load_from_file(model.encode(), params)
    if not handle:
        sys.exit(f"libllama could not load {model}")
    return lib, lib.llama_model_get_vocab(handle)


def run(main, bin_dir: Path, model: Path, request, timeout: float, stderr: list | None = None):
    """main(lib, vocab, request) run in a child process over libllama; its JSON answer."""
    program = "\n".join(["import ctypes, json, sys", "from pathlib import Path", inspect.getsource(_ModelParams),
                         inspect.getsource(open_vocab), inspect.getsource(main),
                         f"json.dump({main.__name__}(*open_vocab(sys.argv[1], sys.argv[2]), json.load(sys.stdin)),"
                         " sys.stdout)"])
    done = subprocess.run([sys.executable, "-c", program, str(bin_dir), str(model)], capture_output=True,
                          input=json.dumps(request).encode(), env=reference.llama_env(), timeout=timeout)
    if done.returncode != 0:
        raise AssertionError(f"libllama oracle failed ({done.returncode}) on {model}:\n"
                             f"{done.stderr.decode(errors='replace')[-3000:]}")
    if stderr is not None:
        stderr.append(done.stderr.decode(errors="replace"))
    return json.loads(done.stdout)
