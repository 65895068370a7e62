"""The compute graph of one worker's share of a llama-family model, node for node as llama.cpp builds it.

A worker owns a contiguous range of "blocks": 0..n_layer-1 are the repeating layers, block n_layer is
the output head (final norm and the vocabulary projection). The token embeddings are looked up on the
orchestrator, as llama.cpp keeps its input layer on the CPU; in the ring (orchestrator/pipeline/ring.py) the first
stage looks them up itself (GET_ROWS of token ids) and the last one ends in the greedy token (ARGMAX). Matching llama.cpp's ops, types and
shapes exactly is what makes the generated tokens identical to its own. Gemma 3's layer is in
orchestrator/graph/gemma3.py; what it shares with the stage around it is here: the token rows' scale,
the sliding-window layers' cache inputs and mask, their rope base, the final logit soft-capping.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from orchestrator.graph.ggml import Graph, Tensor, new_tensor
from orchestrator.graph.model import HParams
from wire import op_params
from wire.ggml import FLAG_INPUT, FLAG_OUTPUT, TYPE_TRAITS, GGMLOp, GGMLType, GGMLUnaryOp, row_size


@dataclass(frozen=True)
class Shape:
    """What makes two steps' graphs identical, so the second can be a GRAPH_RECOMPUTE."""

    n_tokens: int
    n_kv: int
    n_outputs: int
    n_kv_swa: int = 0  # cells the sliding-window layers attend (their cache is another one: llama.cpp's iSWA)
    # the serving engine's attention groups in row order, one attention node per group and layer
    # (orchestrator/pipeline/kv.py Group.shape: rows, first cell, cells, streams, stream stride); empty: one node,
    # all rows over cells [0, n_kv)
    groups: tuple[tuple[int, int, int, int, int], ...] = ()

    def attention_groups(self, swa: bool) -> tuple[tuple[int, int, int, int, int], ...]:
        return self.groups or ((self.n_tokens, 0, self.n_kv_swa if swa else self.n_kv, 1, 0),)


def mask_name(sfx: str, group: int) -> str:
    """The input holding a cache's attention mask for one group of rows."""
    return "kq_mask" + sfx + (f"_g{group}" if group else "")


@dataclass
class StageGraph:
    graph: Graph
    inputs: dict[str, Tensor]  # name -> input tensor the runner fills before each compute
    output: Tensor  # the activation handed to the next stage, or the logits
    constants: dict[str, np.ndarray] = field(default_factory=dict)  # inputs whose values never change
    extra: dict[str, Tensor] = field(default_factory=dict)  # more results to read back (a sampled draw's candidates)

    def outputs(self) -> list[Tensor]:
        """Every result read after the compute: what memory planning keeps (the output, then `extra`)."""
        return [self.output, *self.extra.values()]


def sample_tail(g: Graph, logits: Tensor, inputs: dict[str, Tensor], k: int) -> tuple[Tensor, dict[str, Tensor]]:
    """Each row's token drawn on the worker, by the Gumbel-max trick over its k most likely: the k highest
    logits, ranked highest first, plus the input `draw_noise` (k values a row: the temperature times
    Gumbel noise, which the caller draws), and the token whose sum is the largest. The token is then a
    draw from the softmax of those k logits over the temperature (the draft's sampler,
    engine/drafter.py, which does the same from logits it reads: the same token for the same noise).
    Also returns the ranked candidates ("ids", "logits") for the caller to read: they give the
    distribution the token was drawn from."""
    n_vocab, n_rows = logits.ne[0], logits.ne[1]
    ids = g.top_k(logits, k, "draw_top_ids")  # (k, rows), in no set order
    values = g.get_rows(g.reshape(logits, 1, n_vocab, n_rows), ids, "draw_top_logits")  # (1, k, rows)
    order = g.argsort(g.reshape(values, k, n_rows), True, "draw_order")
    ranked_ids = g.get_rows(g.reshape(ids, 1, k, n_rows), order, "draw_ids")  # (1, k, rows) I32
    ranked = g.get_rows(values, order, "draw_logits")  # (1, k, rows)
    inputs["draw_noise"] = new_tensor(GGMLType.F32, (k, n_rows), "draw_noise")
    pick = g.argmax(g.add(g.reshape(ranked, k, n_rows), inputs["draw_noise"], "draw_scores"), "draw_pick")
    token = g.get_rows(ranked_ids, g.reshape(pick, 1, n_rows), "result_token")  # (1, 1, rows)
    return g.reshape(token, n_rows), {"ids": ranked_ids, "logits": ranked}


@dataclass(frozen=True)
class ChainShape:
    """A chain's steps (build_chain), each one's Shape: what makes two chains' graphs identical."""

    steps: tuple[Shape, ...]


def build_chain(builder: "LayerBuilder", blocks: range, chain: ChainShape, sample: int = 0) -> StageGraph:
    """Several decode steps of a whole model in one graph, for a worker that holds all of it (the draft's
    chain, pipeline/chain.py): each step picks a token for each of its output rows (the most likely, or
    with `sample` a draw as in sample_tail), and each step after the first looks up, as its tokens, the
    picks its input `take` names (GET_ROWS of the step before's picks: rows may leave, and change order,
    from step to step). One GRAPH_COMPUTE thus makes them all; the steps' nodes run in order, so a step's
    attention reads the K and V the steps before it stored. Step i's inputs and constants are named
    "name@i"; its picks are extra "token@i" (and "ids@i", "logits@i" when sampled), the last step's also
    the output."""
    g = Graph()
    inputs: dict[str, Tensor] = {}
    constants: dict[str, np.ndarray] = {}
    extra: dict[str, Tensor] = {}
    picks = None
    for i, shape in enumerate(chain.steps):
        tokens = None
        if picks is not None:
            inputs[f"take@{i}"] = take = new_tensor(GGMLType.I32, (shape.n_tokens,), "inp_take")
            take.flags |= FLAG_INPUT
            taken = g.get_rows(g.reshape(picks, 1, picks.ne[0]), take, "inp_taken")
            tokens = g.reshape(taken, shape.n_tokens)
        sg = builder.build(blocks, shape, token_ids=True, greedy=not sample, sample=sample, graph=g, tokens=tokens)
        inputs.update({f"{name}@{i}": t for name, t in sg.inputs.items()})
        constants.update({f"{name}@{i}": v for name, v in sg.constants.items()})
        extra.update({f"{name}@{i}": t for name, t in sg.extra.items()})
        extra[f"token@{i}"] = picks = sg.output
    return StageGraph(g, inputs, picks, constants, extra)


def rotation_sizes(head_dim_k: int, head_dim_v: int, type_k: GGMLType, type_v: GGMLType) -> tuple[int, int]:
    """llama.cpp's attention rotation for a quantized KV cache (llama_kv_cache: n_rot_k, n_rot_v; 0 = none):
    Q and K, V, and the attention output are multiplied by an orthonormal Walsh-Hadamard matrix so that
    quantizing the cache loses less. K's rotation is the largest power of 2 from 64 dividing the head
    size, V's is 64; either only where the head size is a multiple of 64."""
    def size(head_dim: int, type_: GGMLType, grow: bool) -> int:
        if TYPE_TRAITS[type_].block_size == 1 or head_dim % 64:
            return 0
        n = 64
        while grow and head_dim % (2 * n) == 0:
            n *= 2
        return n

    return size(head_dim_k, type_k, True), size(head_dim_v, type_v, False)


def hadamard(n: int) -> np.ndarray:
    """ggml_gen_hadamard: the n x n Sylvester matrix scaled by 1/sqrt(n) (float32, as llama.cpp fills it)."""
    i = np.arange(n)
    bits, parity = i[:, None] & i[None, :], np.zeros((n, n), np.int64)  # entry (i, j): sign of popcount(i & j)
    while bits.any():
        parity ^= bits & 1
        bits >>= 1
    scale = np.float32(1.0 / float(np.sqrt(np.float32(n))))
    return np.where(parity == 1, -scale, scale).astype(np.float32)


class LayerBuilder:
    """Builds one stage's graph over weights and caches that already live on its worker."""

    output_rows_apart = False  # the logits one row at a time (runner.Pipeline.place: on llama.cpp's workers)
    v_cache = True  # False: V is a view of the K cache (deepseek2's MLA), no V cache and no v_idxs input

    def __init__(self, hp: HParams, weights: dict[str, Tensor], kv: dict[int, tuple[Tensor, Tensor]],
                 flash_attn: bool):
        self.hp, self.w, self.kv, self.flash_attn = hp, weights, kv, flash_attn
        kv_types = next(((k.type, (v or k).type) for k, v in kv.values()), (GGMLType.F16, GGMLType.F16))
        self.rotations = rotation_sizes(hp.head_dim_k, hp.head_dim_v, *kv_types)

    def build(self, blocks: range, shape: Shape, *, token_ids: bool = False, greedy: bool = False,
              logit_bias: bool = False, sample: int = 0, graph: Graph | None = None,
              tokens: Tensor | None = None) -> StageGraph:
        """The stage's graph; token_ids: its input is token ids, looked up in token_embd here; greedy: its
        output is each row's ARGMAX of the logits (plus the input `logit_bias` if asked); sample (k > 0):
        each row's token drawn from its k most likely (sample_tail). `graph`: the nodes go on in it (a
        chain's next step); `tokens`: the ids looked up are that tensor's (the step before's picks), not
        an input."""
        hp, g = self.hp, graph if graph is not None else Graph()
        extra: dict[str, Tensor] = {}
        n_tokens = shape.n_tokens
        inputs: dict[str, Tensor] = {}
        constants: dict[str, np.ndarray] = {}
        layers = [il for il in blocks if il < hp.n_layer]
        # a stage holding only the output head receives the rows already picked by out_ids
        n_rows = n_tokens if layers else shape.n_outputs
        if token_ids and tokens is None:
            inputs["tokens"] = tokens = new_tensor(GGMLType.I32, (n_tokens,), "inp_tokens")
        elif not token_ids:
            inputs["embd"] = new_tensor(GGMLType.F32, (hp.n_embd, n_rows), "inp_embd")
        if layers:
            inputs["pos"] = new_tensor(GGMLType.I32, (n_tokens,), "inp_pos")
            # each cache the stage's layers use (the global one, the sliding-window one): where the batch's
            # K/V go, and the mask over its attended cells
            for sfx in ("", "_swa"):
                if not any(self.hp.is_swa(il) == (sfx == "_swa") for il in layers):
                    continue
                inputs["k_idxs" + sfx] = new_tensor(GGMLType.I64, (n_tokens,), "attn_inp_k_idxs" + sfx)
                if self.v_cache:
                    n_v_idxs = n_tokens if self.flash_attn else n_tokens * hp.n_embd_v_gqa
                    inputs["v_idxs" + sfx] = new_tensor(GGMLType.I64, (n_v_idxs,), "attn_inp_v_idxs" + sfx)
                mask_type = GGMLType.F16 if self.flash_attn else GGMLType.F32
                for i, (n_rows, _, n_kv, n_streams, _) in enumerate(shape.attention_groups(sfx == "_swa")):
                    name = mask_name(sfx, i)
                    ne = (n_kv, 1, 1, n_streams) if n_streams > 1 else (n_kv, n_rows, 1, 1)
                    inputs[name] = new_tensor(mask_type, ne, "attn_inp_" + name)
                    if n_streams > 1 and "stream_gather" not in inputs:
                        inputs["stream_gather"] = new_tensor(GGMLType.I32, (n_streams,), "attn_inp_stream_gather")
                        inputs["stream_scatter"] = new_tensor(GGMLType.I32, (n_rows,), "attn_inp_stream_scatter")
            for name, n in zip(("k_rot", "v_rot"), self.rotations):
                if n:
                    inputs[name] = new_tensor(GGMLType.F32, (n, n), f"attn_inp_{name}")
                    constants[name] = hadamard(n)
        if hp.n_layer - 1 in layers:
            inputs["out_ids"] = new_tensor(GGMLType.I32, (shape.n_outputs,), "out_ids")

        if token_ids:
            cur = g.get_rows(self.w["token_embd.weight"], tokens, "inp_embd")
        else:
            cur = inputs["embd"]
        if 0 in layers and hp.embd_scale != 1.0:  # llama.cpp scales the token rows by a per-row input
            inputs["scale_rows"] = new_tensor(GGMLType.F32, (1, n_tokens), "inp_scale_rows")
            constants["scale_rows"] = np.full((n_tokens, 1), hp.embd_scale, np.float32)
            cur = g.mul(cur, inputs["scale_rows"], "inp_scaled")
        for il in layers:
            cur = self._layer(g, il, cur, inputs, shape)
        if hp.n_layer in blocks:
            cur = self._norm(g, cur, self.w["output_norm.weight"], "result_norm")
            cur = self._output(g, cur)
            if (bias := self.w.get("output.bias")) is not None:  # qwen2 may carry one
                cur = g.add(cur, bias, "result_output_b")
            if cap := hp.final_logit_softcap:
                cur = g.scale(g.unary(GGMLUnaryOp.TANH, g.scale(cur, 1.0 / cap)), cap, "result_output")
            if logit_bias:
                inputs["logit_bias"] = new_tensor(GGMLType.F32, (hp.n_vocab,), "logit_bias")
                cur = g.add(cur, inputs["logit_bias"], "result_biased")
            if greedy:
                cur = g.argmax(cur, "result_token")
            elif sample:
                cur, extra = sample_tail(g, cur, inputs, sample)
        for t in inputs.values():
            t.flags |= FLAG_INPUT
        for t in (cur, *extra.values()):
            t.flags |= FLAG_OUTPUT
        return StageGraph(g, inputs, cur, constants, extra)

    def _output(self, g: Graph, x: Tensor) -> Tensor:
        """The logits of x's rows; with output_rows_apart, one product per row, joined."""
        w = self._output_weight()
        if not self.output_rows_apart or x.ne[1] <= 1:
            return g.mul_mat(w, x, "result_output")
        rows = [g.mul_mat(w, g.view(x, (x.ne[0], 1), (x.nb[1],), i * x.nb[1]), f"result_output-{i}")
                for i in range(x.ne[1])]
        out = rows[0]
        for row in rows[1:]:
            out = g.concat(out, row, 1, "result_output")
        return out

    def _output_weight(self) -> Tensor:
        output = self.w.get("output.weight")
        return output if output is not None else self.w["token_embd.weight"]

    def _norm(self, g: Graph, x: Tensor, weight: Tensor, name: str) -> Tensor:
        return g.mul(g.rms_norm(x, self.hp.rms_eps, "norm"), weight, name)

    def _layer(self, g: Graph, il: int, inp: Tensor, inputs: dict[str, Tensor], shape: Shape) -> Tensor:
        """llama's layer (qwen2's and qwen3's too: optional biases, optional Q/K norms); a subclass with
        another feed-forward overrides only _feed_forward."""
        cur = self._norm(g, inp, self.w[f"blk.{il}.attn_norm.weight"], f"attn_norm-{il}")
        q, k, v = self._qkv(g, il, cur, inputs["pos"], shape.n_tokens)
        cur = self._attention(g, il, q, k, v, inputs, shape)
        cur = self._linear(g, il, "attn_output", cur, "attn_out")
        if il == self.hp.n_layer - 1:
            cur = g.get_rows(cur, inputs["out_ids"])
            inp = g.get_rows(inp, inputs["out_ids"])
        ffn_inp = g.add(cur, inp, f"ffn_inp-{il}")
        cur = self._norm(g, ffn_inp, self.w[f"blk.{il}.ffn_norm.weight"], f"ffn_norm-{il}")
        cur = self._feed_forward(g, il, cur)
        return g.add(cur, ffn_inp, f"l_out-{il}")

    def _linear(self, g: Graph, il: int, role: str, x: Tensor, name: str) -> Tensor:
        """blk.il.role.weight times x, plus the layer's bias for it if the file has one."""
        t = g.mul_mat(self.w[f"blk.{il}.{role}.weight"], x, f"{name}-{il}")
        if (bias := self.w.get(f"blk.{il}.{role}.bias")) is not None:
            t = g.add(t, bias, f"{name}_b-{il}")
        return t

    def _qkv(self, g: Graph, il: int, cur: Tensor, pos: Tensor, n_tokens: int) -> tuple[Tensor, Tensor, Tensor]:
        """Q, K and V of the normed rows, as [head_dim, n_head, n_tokens]: Q and K through their per-head
        RMS norms where the file has them (qwen3, gemma3), then rope."""
        hp = self.hp
        q = g.reshape(self._linear(g, il, "attn_q", cur, "Qcur"), hp.head_dim_k, hp.n_head, n_tokens)
        k = g.reshape(self._linear(g, il, "attn_k", cur, "Kcur"), hp.head_dim_k, hp.n_head_kv, n_tokens)
        v = g.reshape(self._linear(g, il, "attn_v", cur, "Vcur"), hp.head_dim_v, hp.n_head_kv, n_tokens)
        freq_factors = self._rope_factors(il)
        if (q_norm := self.w.get(f"blk.{il}.attn_q_norm.weight")) is not None:
            q = self._norm(g, q, q_norm, f"Qcur_normed-{il}")
        q = self._rope(g, il, q, pos, freq_factors, f"Qcur-{il}")
        if (k_norm := self.w.get(f"blk.{il}.attn_k_norm.weight")) is not None:
            k = self._norm(g, k, k_norm, f"Kcur_normed-{il}")
        k = self._rope(g, il, k, pos, freq_factors, f"Kcur-{il}")
        return q, k, v

    def _feed_forward(self, g: Graph, il: int, cur: Tensor) -> Tensor:
        """llm_graph_context::build_ffn (LLM_FFN_SILU, LLM_FFN_PAR) with the llama arch's optional biases."""
        gate = self._linear(g, il, "ffn_gate", cur, "ffn_gate")
        up = self._linear(g, il, "ffn_up", cur, "ffn_up")
        cur = g.swiglu_split(gate, up, f"ffn_swiglu-{il}")
        return self._linear(g, il, "ffn_down", cur, "ffn_out")

    def _rope_factors(self, il: int) -> Tensor | None:
        """llama_model::get_rope_factors: the layer's rope_freqs (one tensor for all layers in llama 3 files)."""
        factors = self.w.get(f"blk.{il}.rope_freqs.weight")
        return factors if factors is not None else self.w.get("rope_freqs.weight")

    def _rope(self, g: Graph, il: int, x: Tensor, pos: Tensor, freq_factors: Tensor | None, name: str) -> Tensor:
        hp = self.hp
        base, scale = ((hp.rope_freq_base_swa, hp.rope_freq_scale_swa) if hp.is_swa(il)
                       else (hp.rope_freq_base, hp.rope_freq_scale))
        return g.rope_ext(x, pos, freq_factors, hp.n_rot, hp.rope_mode, hp.n_ctx_orig, base, scale,
                          hp.rope_ext_factor, hp.rope_attn_factor, hp.rope_beta_fast, hp.rope_beta_slow, name)

    @staticmethod
    def _rotate(g: Graph, x: Tensor, rot: Tensor) -> Tensor:
        """llama_mul_mat_hadamard: x's rows of rot.ne[0] elements times the rotation, x's shape kept."""
        n, count = rot.ne[0], x.ne[0] * x.ne[1] * x.ne[2] * x.ne[3]
        rows = g.reshape(x, n, count // n) if x.is_contiguous() else g.cont(x, (n, count // n))
        res = g.mul_mat(rot, rows)
        res.op_params = op_params.encode(GGMLOp.MUL_MAT, hint=op_params.HINT_SRC0_IS_HADAMARD)
        return g.reshape(res, *x.ne)

    def _attention(self, g: Graph, il: int, q: Tensor, k: Tensor, v: Tensor, inputs: dict[str, Tensor],
                   shape: Shape, kq_scale: float | None = None) -> Tensor:
        """llama.cpp's build_attn with a unified KV cache: store this batch's K/V, then attend, each group of
        rows over its cells (one group: all rows over n_kv cells); a sliding-window layer uses its own
        cache's cells, inputs and masks."""
        hp, (k_cache, v_cache) = self.hp, self.kv[il]
        kq_scale = hp.kq_scale if kq_scale is None else kq_scale
        sfx = "_swa" if hp.is_swa(il) else ""
        n_tokens, kv_size = shape.n_tokens, k_cache.ne[1]
        if "k_rot" in inputs:
            q, k = self._rotate(g, q, inputs["k_rot"]), self._rotate(g, k, inputs["k_rot"])
        if "v_rot" in inputs:
            v = self._rotate(g, v, inputs["v_rot"])

        g.set_rows(k_cache, g.view(k, (hp.n_embd_k_gqa, n_tokens), (k.nb[2],), 0), inputs["k_idxs" + sfx])
        if not self.v_cache:
            pass
        elif self.flash_attn:
            g.set_rows(v_cache, g.view(v, (hp.n_embd_v_gqa, n_tokens), (v.nb[2],), 0), inputs["v_idxs" + sfx])
        else:  # the V cache is transposed: one set_rows row per element
            v_rows = g.reshape(v, hp.n_embd_v_gqa, n_tokens)
            g.set_rows(g.reshape(v_cache, 1, hp.n_embd_v_gqa * kv_size), g.reshape(v_rows, 1, hp.n_embd_v_gqa * n_tokens),
                       inputs["v_idxs" + sfx])
        outs, row0 = [], 0
        for i, (n_rows, cell0, n_kv, n_streams, stride) in enumerate(shape.attention_groups(bool(sfx))):
            mask = inputs[mask_name(sfx, i)]
            if n_streams > 1:  # one row per stream, gathered from the batch's rows and scattered back
                rows = g.get_rows(g.reshape(q, q.ne[0] * q.ne[1], n_tokens), inputs["stream_gather"])
                qg = g.reshape(rows, q.ne[0], q.ne[1], 1, n_streams)
                out = self._attend(g, il, qg, cell0, n_kv, mask, kq_scale, n_streams, stride)
                outs.append(g.get_rows(out, inputs["stream_scatter"]))
            else:
                qg = g.view(q, (q.ne[0], q.ne[1], n_rows, 1), (q.nb[1], q.nb[2], q.nb[2] * n_rows), row0 * q.nb[2])
                outs.append(self._attend(g, il, qg, cell0, n_kv, mask, kq_scale))
            row0 += n_rows
        cur = outs[0]
        for part in outs[1:]:
            cur = g.concat(cur, part, 1, f"kqv_out-{il}")
        return self._rotate(g, cur, inputs["v_rot"]) if self.flash_attn and "v_rot" in inputs else cur

    def _attend(self, g: Graph, il: int, q: Tensor, cell0: int, n_kv: int, mask: Tensor, kq_scale: float,
                n_streams: int = 1, stride: int = 0) -> Tensor:
        """q [head_dim, n_head, rows, streams] over the cache's cells [cell0, cell0 + n_kv), stream s
        shifted by s * stride cells: [head_dim_v * n_head, rows * streams]."""
        hp, (k_cache, v_cache) = self.hp, self.kv[il]
        kv_size = k_cache.ne[1]
        kt, vt = k_cache.type, v_cache.type
        k_all = g.view(k_cache, (hp.head_dim_k, hp.n_head_kv, n_kv, n_streams),
                       (row_size(kt, hp.head_dim_k), row_size(kt, hp.n_embd_k_gqa),
                        row_size(kt, hp.n_embd_k_gqa * (stride if n_streams > 1 else kv_size))),
                       cell0 * row_size(kt, hp.n_embd_k_gqa))
        if self.flash_attn:
            v_all = g.view(v_cache, (hp.head_dim_v, hp.n_head_kv, n_kv, n_streams),
                           (row_size(vt, hp.head_dim_v), row_size(vt, hp.n_embd_v_gqa),
                            row_size(vt, hp.n_embd_v_gqa * (stride if n_streams > 1 else kv_size))),
                           cell0 * row_size(vt, hp.n_embd_v_gqa))
        else:  # V transposed: element j of cell c at j * kv_size + c
            v_all = g.view(v_cache, (n_kv, hp.n_head_kv, hp.head_dim_v, n_streams),
                           (row_size(vt, kv_size * hp.head_dim_v), row_size(vt, kv_size),
                            row_size(vt, stride if n_streams > 1 else kv_size * hp.n_embd_v_gqa)), row_size(vt, cell0))
        q = g.permute(q, 0, 2, 1, 3)
        k_all = g.permute(k_all, 0, 2, 1, 3)
        v_all = g.permute(v_all, 0, 2, 1, 3)
        if self.flash_attn:
            cur = g.flash_attn_ext(q, k_all, v_all, mask, kq_scale)
            return g.reshape(cur, cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3])
        kq = g.mul_mat(k_all, q, f"kq-{il}")
        kq.op_params = op_params.encode(GGMLOp.MUL_MAT, prec=op_params.PREC_F32)
        kq = g.soft_max_ext(kq, mask, kq_scale, 0.0, f"kq_soft_max-{il}")
        kqv = g.mul_mat(v_all, kq, f"kqv-{il}")
        cur = g.permute(kqv, 0, 2, 1, 3)
        return g.cont(cur, (cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3]))
