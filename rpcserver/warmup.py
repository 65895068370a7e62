"""Start-up warm-up: run small llama graphs through the normal path so numba has every kernel loaded.

Numba compiles (or loads from its on-disk cache) a kernel the first time it is called with a given
signature; left to the first client, that lands in its first GRAPH_COMPUTE. Here a private Session
(its own buffers and budget, nothing shared with clients) takes a tiny random llama through the same
requests a client sends: weights upload, KV cache clear, GRAPH_COMPUTE for prompts of 8 and 2 tokens
(ggml routes batches of 8+ and of 2+ differently) and for single tokens, GRAPH_RECOMPUTE, GET_TENSOR;
with flash attention on and off (off adds SOFT_MAX, CPY and F16 products). Its layers carry the
weight types llama.cpp's common files use, so MUL_MAT, GET_ROWS, RMS_NORM, MUL, ADD, ROPE, SWIGLU,
SET_ROWS and FLASH_ATTN_EXT all meet the argument types and array layouts of a real graph.

The graphs are built by the orchestrator's llama builder, which reproduces llama.cpp's graph node for
node; only this module of the worker imports it.
"""

from __future__ import annotations

import time

import numpy as np

from kernels.ggml import TYPE_TRAITS, GGMLType, contiguous_strides, nbytes
from .memory import MemoryBudget
from .session import Session, WorkerConfig

# one layer per weight type (the mixes of Q4_0/Q4_1/Q8_0/F16 files and of Q4_K_M: Q4_K with Q6_K
# ffn_down); the output head is Q8_0 as in SmolLM2's tied embeddings
LAYER_TYPES = (
    {"*": GGMLType.Q4_0},
    {"*": GGMLType.Q4_1},
    {"*": GGMLType.Q8_0},
    {"*": GGMLType.F16},
    {"*": GGMLType.Q4_K, "ffn_down": GGMLType.Q6_K, "attn_v": GGMLType.Q6_K},
)
OUTPUT_TYPE = GGMLType.Q8_0
N_EMBD, N_FF, N_HEAD, N_HEAD_KV, N_VOCAB, N_CTX = 256, 512, 4, 2, 256, 256  # K-quants need rows of 256
PROMPTS = (8, 2)  # tokens per prompt step; then two single-token steps (the second a recompute)
BUDGET = 64 << 20


class _Model:
    """What the orchestrator's Pipeline reads of a ModelFile, for a small random llama."""

    def __init__(self):
        from orchestrator.model import HParams, WeightInfo  # noqa: PLC0415 - only the warm-up needs them

        head_dim = N_EMBD // N_HEAD
        self.hparams = HParams(
            arch="llama", n_layer=len(LAYER_TYPES), n_embd=N_EMBD, n_ff=N_FF, n_head=N_HEAD, n_head_kv=N_HEAD_KV,
            head_dim_k=head_dim, head_dim_v=head_dim, n_rot=head_dim, n_vocab=N_VOCAB, n_ctx_train=N_CTX,
            n_ctx_orig=N_CTX, rms_eps=1e-5, rope_freq_base=10000.0, rope_freq_scale=1.0, rope_ext_factor=0.0,
            kq_scale=1.0 / np.sqrt(head_dim),
        )
        rng = np.random.default_rng(0)
        kv = N_HEAD_KV * head_dim
        shapes = {"attn_norm": (N_EMBD,), "attn_q": (N_EMBD, N_EMBD), "attn_k": (N_EMBD, kv),
                  "attn_v": (N_EMBD, kv), "attn_output": (N_EMBD, N_EMBD), "ffn_norm": (N_EMBD,),
                  "ffn_gate": (N_EMBD, N_FF), "ffn_up": (N_EMBD, N_FF), "ffn_down": (N_FF, N_EMBD)}
        self.weights = {}

        def add(name, type_, ne):
            ne = tuple(ne) + (1,) * (4 - len(ne))
            size = nbytes(type_, ne, contiguous_strides(type_, ne))
            if TYPE_TRAITS[type_].is_quantized:  # random blocks with small legacy-quant scales
                data = rng.integers(0, 256, size, dtype=np.uint8)
                _sane_scales(type_, data)
            else:
                values = 0.02 * rng.standard_normal(size // TYPE_TRAITS[type_].type_size)
                data = values.astype(_NUMPY[type_]).view(np.uint8)
            self.weights[name] = WeightInfo(name, type_, ne, data)

        for il, types in enumerate(LAYER_TYPES):
            for role, ne in shapes.items():
                type_ = GGMLType.F32 if role.endswith("norm") else types.get(role, types["*"])
                add(f"blk.{il}.{role}.weight", type_, ne)
        add("output_norm.weight", GGMLType.F32, (N_EMBD,))
        add("token_embd.weight", OUTPUT_TYPE, (N_EMBD, N_VOCAB))

    def layer_tensor_names(self, il: int) -> dict[str, str]:
        return {name.split(".")[2]: name for name in self.weights if name.startswith(f"blk.{il}.")}

    def output_tensor_names(self) -> dict[str, str]:
        return {"output_norm": "output_norm.weight", "output": "token_embd.weight"}

    def token_embeddings(self, tokens: list[int]) -> np.ndarray:
        rng = np.random.default_rng(len(tokens))
        return rng.standard_normal((len(tokens), N_EMBD)).astype(np.float32)


_NUMPY = {GGMLType.F32: np.float32, GGMLType.F16: np.float16}


def _sane_scales(type_: GGMLType, data: np.ndarray) -> None:
    """Give every block a small finite f16 scale where the format starts with one (legacy quants),
    so the products stay finite; K-quant super-block scales are left random (their f16 d sits at
    the end or start depending on the type, and NaNs there do not change which code runs)."""
    traits = TYPE_TRAITS[type_]
    if type_ in (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0):
        blocks = data.reshape(-1, traits.type_size)
        blocks[:, 0:2] = np.frombuffer(np.float16(0.001).tobytes(), np.uint8)
        if type_ in (GGMLType.Q4_1, GGMLType.Q5_1):
            blocks[:, 2:4] = np.frombuffer(np.float16(-0.001).tobytes(), np.uint8)


def warm_up() -> float:
    """Run the warm-up graphs; returns the seconds it took. Errors propagate: they are our bugs."""
    import numba  # noqa: PLC0415

    start = time.perf_counter()
    model = _Model()
    threads = numba.get_num_threads()
    # one thread: the compiled code is the same, and tiny parallel kernels on a busy machine spend
    # most of their time waking threads (6.7 s instead of 1.0 s measured with load ~15 on 2 cores)
    numba.set_num_threads(1)
    try:
        with np.errstate(all="ignore"):  # random K-quant scales may overflow; only the code paths matter
            for flash_attn in (True, False):
                _run(model, flash_attn)
    finally:
        numba.set_num_threads(threads)
    return time.perf_counter() - start


def _run(model: _Model, flash_attn: bool) -> None:
    """Upload, prompts and single tokens through a private session, as llama-completion drives a worker."""
    from orchestrator.client import InProcessClient  # noqa: PLC0415
    from orchestrator.runner import Pipeline  # noqa: PLC0415

    client = InProcessClient(Session(WorkerConfig(MemoryBudget(BUDGET))), "warm-up")
    try:
        pipe = Pipeline(model, [client], n_ctx=N_CTX, n_batch=max(PROMPTS), n_ubatch=max(PROMPTS),
                        flash_attn=flash_attn, log=lambda *args: None)
        for stage in pipe.stages:
            stage.upload(lambda n: None)
        for n in PROMPTS:
            logits = pipe.evaluate_prompt([1] * n)
        for _ in range(2):
            logits = pipe.evaluate_token(1)
        if logits.size != N_VOCAB:
            raise RuntimeError(f"warm-up produced {logits.shape} logits")
    finally:
        client.close()
