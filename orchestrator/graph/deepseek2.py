"""One worker's share of a deepseek2 graph (GLM-4.7-Flash, DeepSeek V2/V3) with multi-head latent attention,
node for node as llama.cpp builds it (src/models/deepseek2.cpp; build_attn with a K-only cache and
build_attn_mha's v_mla in src/llama-graph.cpp).

The attention, "absorbed" as llama.cpp runs an MLA file (split attn_k_b / attn_v_b):
- Q through its low rank (attn_q_a, an RMS norm, attn_q_b; or a plain attn_q), as heads of
  qk_nope + qk_rope; each head's nope part goes through attn_k_b (one matrix per head, MUL_MAT of the
  permuted rows), its rope part through ROPE, and the two are concatenated: kv_lora + qk_rope per head;
- one K row per token (MQA, one head): attn_kv_a_mqa's first kv_lora values RMS-normed, then its last
  qk_rope values roped; that row is all the cache holds (no V cache);
- V is a view of the cached K row's first kv_lora values; attention (flash or not) gives kv_lora values
  per head, which attn_v_b (per head) turns into the value head before attn_output;
- kq_scale is YaRN's mscale squared over the decompressed key head's root (orchestrator/graph/model.py).
The feed-forward is a dense SwiGLU for the leading layers, else the routed experts (moe_ffn: sigmoid or
softmax gating, exp_probs_b, norm and scale) plus the shared expert's SwiGLU.
"""

from __future__ import annotations

from orchestrator.graph.ggml import Graph, Tensor
from orchestrator.graph.llama import LayerBuilder, Shape
from orchestrator.graph.moe import moe_ffn
from wire import op_params
from wire.ggml import GGMLOp, row_size


class DeepSeek2Builder(LayerBuilder):
    v_cache = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rotations = (0, 0)  # llama.cpp's K-only attention input has no Hadamard rotation, quantized or not

    def _layer(self, g: Graph, il: int, inp: Tensor, inputs: dict[str, Tensor], shape: Shape) -> Tensor:
        hp, n_tokens = self.hp, shape.n_tokens
        w = lambda role: self.w[f"blk.{il}.{role}.weight"]  # noqa: E731
        n_rope, n_lora = hp.n_rot, hp.n_lora_kv
        n_nope = hp.head_dim_k_mla - n_rope
        cur = self._norm(g, inp, w("attn_norm"), f"attn_norm-{il}")

        if f"blk.{il}.attn_q_a.weight" in self.w:
            q = g.mul_mat(w("attn_q_a"), cur, f"q-{il}")
            q = self._norm(g, q, w("attn_q_a_norm"), f"q-{il}")
            q = g.mul_mat(w("attn_q_b"), q, f"q-{il}")
        else:
            q = g.mul_mat(w("attn_q"), cur, f"q-{il}")
        q = g.reshape(q, hp.head_dim_k_mla, hp.n_head, n_tokens)

        kv_cmpr_pe = g.mul_mat(w("attn_kv_a_mqa"), cur, f"kv_cmpr_pe-{il}")  # [kv_lora + rope, n_tokens]
        row = kv_cmpr_pe.nb[1]
        kv_cmpr = g.view(kv_cmpr_pe, (n_lora, n_tokens), (row,), 0, f"kv_cmpr-{il}")
        k_pe = g.view(kv_cmpr_pe, (n_rope, 1, n_tokens), (row, row), row_size(kv_cmpr_pe.type, n_lora), f"k_pe-{il}")
        k_pe = self._rope(g, il, k_pe, inputs["pos"], None, f"k_pe-{il}")
        kv_cmpr = self._norm(g, kv_cmpr, w("attn_kv_a_norm"), f"kv_cmpr-{il}")

        q_nope = g.view(q, (n_nope, hp.n_head, n_tokens), (q.nb[1], q.nb[2]), 0, f"q_nope-{il}")
        q_pe = g.view(q, (n_rope, hp.n_head, n_tokens), (q.nb[1], q.nb[2]), row_size(q.type, n_nope), f"q_pe-{il}")
        q_pe = self._rope(g, il, q_pe, inputs["pos"], None, f"q_pe-{il}")
        q_nope = g.permute(q_nope, 0, 2, 1, 3)  # [nope, n_tokens, n_head]
        absorbed = g.mul_mat(w("attn_k_b"), q_nope, f"q_nope_absorbed-{il}")  # [kv_lora, n_tokens, n_head]
        absorbed = g.permute(absorbed, 0, 2, 1, 3)
        q = g.concat(absorbed, q_pe, 0, f"Qcur-{il}")  # [kv_lora + rope, n_head, n_tokens]
        k = g.concat(g.reshape(kv_cmpr, n_lora, 1, n_tokens), k_pe, 0, f"Kcur-{il}")  # [kv_lora + rope, 1, n_tokens]

        cur = self._attention(g, il, q, k, None, inputs, shape)
        cur = g.mul_mat(w("attn_output"), cur, f"attn_out-{il}")
        if il == hp.n_layer - 1:
            cur = g.get_rows(cur, inputs["out_ids"])
            inp = g.get_rows(inp, inputs["out_ids"])
        ffn_inp = g.add(cur, inp, f"ffn_inp-{il}")
        cur = self._norm(g, ffn_inp, w("ffn_norm"), f"ffn_norm-{il}")
        if il < hp.n_layer_dense_lead:
            cur = self._feed_forward(g, il, cur)
        else:
            moe = moe_ffn(g, hp, self.w, il, cur, hp.expert_gating, self.w.get(f"blk.{il}.exp_probs_b.bias"),
                          hp.expert_weights_norm, hp.expert_weights_scale)
            gate = g.mul_mat(w("ffn_gate_shexp"), cur, f"ffn_gate-{il}")
            up = g.mul_mat(w("ffn_up_shexp"), cur, f"ffn_up-{il}")
            shexp = g.mul_mat(w("ffn_down_shexp"), g.swiglu_split(gate, up, f"ffn_swiglu-{il}"), f"ffn_shexp-{il}")
            cur = g.add(moe, shexp, f"ffn_out-{il}")
        return g.add(cur, ffn_inp, f"l_out-{il}")

    def _attend(self, g: Graph, il: int, q: Tensor, cell0: int, n_kv: int, mask: Tensor, kq_scale: float,
                n_streams: int = 1, stride: int = 0) -> Tensor:
        """build_attn_mha over the K-only cache: V is the cached rows' first kv_lora values; attn_v_b (v_mla)
        decompresses each head's kv_lora values to its value head."""
        hp, (k_cache, _) = self.hp, self.kv[il]
        kt, kv_size = k_cache.type, k_cache.ne[1]
        nb = (row_size(kt, hp.head_dim_k), row_size(kt, hp.n_embd_k_gqa),
              row_size(kt, hp.n_embd_k_gqa * (stride if n_streams > 1 else kv_size)))
        offset = cell0 * row_size(kt, hp.n_embd_k_gqa)
        k_all = g.view(k_cache, (hp.head_dim_k, hp.n_head_kv, n_kv, n_streams), nb, offset)
        v_all = g.view(k_cache, (hp.n_lora_kv, hp.n_head_kv, n_kv, n_streams), nb, offset)
        v_mla = self.w[f"blk.{il}.attn_v_b.weight"]
        q = g.permute(q, 0, 2, 1, 3)
        k_all = g.permute(k_all, 0, 2, 1, 3)
        v_all = g.permute(v_all, 0, 2, 1, 3)
        if self.flash_attn:
            cur = g.flash_attn_ext(q, k_all, v_all, mask, kq_scale)  # [kv_lora, n_head, rows, streams]
            cur = g.mul_mat(v_mla, g.permute(cur, 0, 2, 1, 3), f"fattn_mla-{il}")
            cur = g.cont(g.permute(cur, 0, 2, 1, 3))
            return g.reshape(cur, cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3])
        kq = g.mul_mat(k_all, q, f"kq-{il}")
        kq.op_params = op_params.encode(GGMLOp.MUL_MAT, prec=op_params.PREC_F32)
        kq = g.soft_max_ext(kq, mask, kq_scale, 0.0, f"kq_soft_max-{il}")
        v = g.cont(g.transpose(v_all), name=f"v_cont-{il}")
        kqv = g.mul_mat(v, kq, f"kqv-{il}")
        kqv = g.mul_mat(v_mla, kqv, f"kqv_mla-{il}")
        cur = g.permute(kqv, 0, 2, 1, 3)
        return g.cont(cur, (cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3]))
