"""One worker's share of a Gemma 3 graph, node for node as llama.cpp builds it (src/models/gemma3.cpp).

What differs from the llama layer (orchestrator/graph/llama.py, which also holds what Gemma 3 shares with
the others: the token rows scaled by sqrt(n_embd), the sliding-window layers' own cache and mask, their
own rope base, the final logit soft-capping):
- Q and K get per-head RMS norms before rope, and Q is scaled by the attention scale before attention,
  which then scales by 1;
- the attention output and the feed-forward output each pass an RMS norm of their own (post-norms)
  before their residual add;
- the feed-forward is GEGLU: gelu(gate) * up, ggml's tanh-approximated gelu.
"""

from __future__ import annotations

from orchestrator.graph.ggml import Graph, Tensor
from orchestrator.graph.llama import LayerBuilder, Shape
from wire.ggml import GGMLGluOp


class Gemma3Builder(LayerBuilder):
    def _layer(self, g: Graph, il: int, inp: Tensor, inputs: dict[str, Tensor], shape: Shape) -> Tensor:
        hp, w = self.hp, lambda role: self.w[f"blk.{il}.{role}.weight"]
        cur = self._norm(g, inp, w("attn_norm"), f"attn_norm-{il}")
        q, k, v = self._qkv(g, il, cur, inputs["pos"], shape.n_tokens)
        q = g.scale(q, hp.kq_scale, f"Qcur_scaled-{il}")

        cur = self._attention(g, il, q, k, v, inputs, shape, kq_scale=1.0)
        cur = g.mul_mat(w("attn_output"), cur, f"attn_out-{il}")
        if il == hp.n_layer - 1:
            cur = g.get_rows(cur, inputs["out_ids"])
            inp = g.get_rows(inp, inputs["out_ids"])
        cur = self._norm(g, cur, w("post_attention_norm"), f"attn_post_norm-{il}")
        sa_out = g.add(cur, inp, f"sa_out-{il}")

        cur = self._norm(g, sa_out, w("ffn_norm"), f"ffn_norm-{il}")
        up = g.mul_mat(w("ffn_up"), cur, f"ffn_up-{il}")
        gate = g.mul_mat(w("ffn_gate"), cur, f"ffn_gate-{il}")
        cur = g.glu_split(GGMLGluOp.GEGLU, gate, up, f"ffn_geglu-{il}")
        cur = g.mul_mat(w("ffn_down"), cur, f"ffn_out-{il}")
        cur = self._norm(g, cur, w("post_ffw_norm"), f"ffn_post_norm-{il}")
        return g.add(cur, sa_out, f"l_out-{il}")
