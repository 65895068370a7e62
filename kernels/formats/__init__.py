"""ggml's number formats: block quantizations (quants, kquants, kv_quants), their dot products
(kquant_dot, kquant_lanes, float_dot, float_dot512) and the one table of numpy dequantizers (dequantize).
"""
