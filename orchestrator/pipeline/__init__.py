"""Running graphs across workers: the RPC client, placement, the KV cache, push links, the ring and the
ways of running a step (waves, stepwise)."""
