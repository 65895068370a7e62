"""One worker's share of a qwen3moe graph, node for node as llama.cpp builds it (src/models/qwen3moe.cpp,
and llm_graph_context::build_moe_ffn in src/llama-graph.cpp).

The attention half is qwen3's (per-head RMS norms of Q and K before rope, no biases); the feed-forward is
a mixture of experts in place of the dense SwiGLU:
- the router: an F32 MUL_MAT of the normed rows by ffn_gate_inp (the logits, one per expert), SOFT_MAX;
- the top n_expert_used experts of each row: ggml_argsort_top_k, a descending ARGSORT and a view of
  its first n_expert_used columns (not ggml's TOP_K op);
- their probabilities, GET_ROWS from the probabilities seen as [1, n_expert, n_tokens], renormalized
  (norm_w): SUM_ROWS, CLAMP at F16's smallest normal (no division by zero), DIV;
- gate and up by MUL_MAT_ID of the 3-D expert weights, SWIGLU, down by MUL_MAT_ID, each expert's output
  times its weight (MUL);
- the sum over the chosen experts: a 2-D view per expert, added left to right (one expert: a CONT).
qwen3moe has no shared expert and llama.cpp reads no expert weight scale for it (so no SCALE node);
deepseek2 (orchestrator/graph/deepseek2.py) uses the same function with sigmoid gating, a selection bias
(exp_probs_b) and a weight scale, and its files may fuse gate and up into one ffn_gate_up_exps: one
MUL_MAT_ID whose result's first n_ff rows are gate and the next n_ff up (two views).
"""

from __future__ import annotations

from orchestrator.graph.ggml import Graph, Tensor
from orchestrator.graph.llama import LayerBuilder
from wire.ggml import GGMLUnaryOp

F16_MIN_NORMAL = 6.103515625e-5  # build_moe_ffn clamps the weight sums to this before dividing


class Qwen3MoeBuilder(LayerBuilder):
    """qwen3's layer (LayerBuilder: its Q/K norms come with the file) with the experts as feed-forward."""

    def _feed_forward(self, g: Graph, il: int, cur: Tensor) -> Tensor:
        """build_moe_ffn with qwen3moe's arguments: SiLU-gated experts, softmax gating, norm_w, no scale."""
        return moe_ffn(g, self.hp, self.w, il, cur)


def moe_ffn(g: Graph, hp, weights: dict[str, Tensor], il: int, cur: Tensor, gating: str = "softmax",
            probs_b: Tensor | None = None, norm_w: bool = True, w_scale: float = 0.0) -> Tensor:
    """llm_graph_context::build_moe_ffn with SiLU-gated experts: the gating (softmax or sigmoid), an optional
    selection bias added to the probabilities the top-k sees (not to the weights), norm_w, w_scale."""
    w = lambda role: weights[f"blk.{il}.{role}.weight"]  # noqa: E731
    n_embd, n_tokens = cur.ne[0], cur.ne[1]
    n_expert, n_used = hp.n_expert, hp.n_expert_used

    logits = g.mul_mat(w("ffn_gate_inp"), cur, f"ffn_moe_logits-{il}")  # [n_expert, n_tokens]
    if gating == "softmax":
        probs = g.soft_max_ext(logits, None, 1.0, 0.0, f"ffn_moe_probs-{il}")
    elif gating == "sigmoid":
        probs = g.unary(GGMLUnaryOp.SIGMOID, logits, f"ffn_moe_probs-{il}")
    else:
        raise ValueError(f"expert gating '{gating}' is not supported")
    selection = probs if probs_b is None else g.add(probs, probs_b, f"ffn_moe_probs_biased-{il}")
    selected = g.argsort_top_k(selection, n_used, f"ffn_moe_topk-{il}", f"ffn_moe_argsort-{il}")  # [n_used, n_tokens]
    weights_ = g.get_rows(g.reshape(probs, 1, n_expert, n_tokens), selected, f"ffn_moe_weights-{il}")

    if norm_w:
        weights_ = g.reshape(weights_, n_used, n_tokens)
        weights_sum = g.sum_rows(weights_, f"ffn_moe_weights_sum-{il}")  # [1, n_tokens]
        weights_sum = g.clamp(weights_sum, F16_MIN_NORMAL, float("inf"), f"ffn_moe_weights_sum_clamped-{il}")
        weights_ = g.div(weights_, weights_sum, f"ffn_moe_weights_norm-{il}")
        weights_ = g.reshape(weights_, 1, n_used, n_tokens)
    if w_scale not in (0.0, 1.0):
        weights_ = g.scale(weights_, w_scale, f"ffn_moe_weights_scaled-{il}")

    cur = g.reshape(cur, n_embd, 1, n_tokens)
    # llama.cpp creates up before gate; its graph (ggml_build_forward_expand from the output) runs gate first
    if f"blk.{il}.ffn_gate_up_exps.weight" in weights:  # fused: one MUL_MAT_ID, gate and up are views of it
        gate_up = g.mul_mat_id(w("ffn_gate_up_exps"), cur, selected, f"ffn_moe_gate_up-{il}")  # [2 n_ff, ...]
        n_ff, nb = gate_up.ne[0] // 2, (gate_up.nb[1], gate_up.nb[2])
        gate = g.view(gate_up, (n_ff, gate_up.ne[1], gate_up.ne[2]), nb, 0, f"ffn_moe_gate-{il}")
        up = g.view(gate_up, (n_ff, gate_up.ne[1], gate_up.ne[2]), nb, n_ff * gate_up.nb[0], f"ffn_moe_up-{il}")
    else:
        gate = g.mul_mat_id(w("ffn_gate_exps"), cur, selected, f"ffn_moe_gate-{il}")  # [n_ff, n_used, n_tokens]
        up = g.mul_mat_id(w("ffn_up_exps"), cur, selected, f"ffn_moe_up-{il}")
    cur = g.swiglu_split(gate, up, f"ffn_moe_swiglu-{il}")
    experts = g.mul_mat_id(w("ffn_down_exps"), cur, selected, f"ffn_moe_down-{il}")  # [n_embd, n_used, n_tokens]
    experts = g.mul(experts, weights_, f"ffn_moe_weighted-{il}")

    views = [g.view(experts, (n_embd, n_tokens), (experts.nb[2],), i * experts.nb[1]) for i in range(n_used)]
    out = views[0]
    for view in views[1:]:
        out = g.add(out, view, f"ffn_moe_out-{il}")
    if n_used == 1:  # the lone view is not contiguous
        out = g.cont(out, name=f"ffn_moe_out-{il}")
    return out
