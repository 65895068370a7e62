"""What crosses the wire between orchestrator and worker, importable without numba: the RPC codec
(protocol, framing, record), ggml's numberings and their fact tables (ggml) and the hash that names
weights (hashing).

Both rpcserver and orchestrator stand on this package; it imports nothing else of ours.
"""
