"""The pre-shared key of `rpc-server --key-file`: a challenge-response, never the key on the wire.

The worker draws a fresh nonce per connection (AUTH_NONCE); the client proves it holds the key with
protocol.auth_proof, an HMAC-SHA256 over the nonce (AUTH_PROOF). A recorded proof is worthless on
another connection, since its nonce differs. protocol_spec.md §8.2 has the commands; docs/security.md
what this protects against.
"""

from __future__ import annotations

import hmac
from pathlib import Path

from wire.protocol import MIN_KEY_BYTES, auth_proof


def load_key(path: str | Path) -> bytes:
    """The key file's bytes, surrounding whitespace stripped (so `openssl rand -hex 32 > key` works)."""
    key = Path(path).read_bytes().strip()
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"{path}: a key of {len(key)} bytes is too short (at least {MIN_KEY_BYTES}; "
                         f"e.g. openssl rand -hex 32 > {path})")
    return key


def verify(key: bytes, nonce: bytes, mac: bytes) -> bool:
    return hmac.compare_digest(auth_proof(key, nonce), mac)
