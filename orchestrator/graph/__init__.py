"""Building ggml graphs: the GGUF model, one builder per architecture, the compute-buffer planner."""
