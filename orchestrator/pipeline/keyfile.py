"""`--rpc-key-file`: the pre-shared key our workers may ask for (protocol_spec.md §8.2).

One option for both commands (cli and serve_cli); it sets the key every RpcClient of the process
answers a keyed worker's challenge with, so nothing between the command line and the connections
needs to carry it.
"""

from __future__ import annotations

from pathlib import Path

import click

from wire.protocol import MIN_KEY_BYTES

from .client import RpcClient


KEY_FILE: str | None = None  # the file given, for the workers this process starts (worker_key_flags)


def _use_key(ctx, param, value):
    global KEY_FILE
    if value is None:
        return
    key = Path(value).read_bytes().strip()  # as rpc-server --key-file reads it
    if len(key) < MIN_KEY_BYTES:
        raise click.BadParameter(f"a key of {len(key)} bytes is too short (at least {MIN_KEY_BYTES})")
    RpcClient.key, KEY_FILE = key, value


def worker_key_flags() -> tuple[str, ...]:
    """rpc-server's flags for a worker this process starts beside keyed ones (`--rpc-draft local`): the
    same key, so that its pushes into them prove it."""
    return ("--key-file", KEY_FILE) if KEY_FILE is not None else ()


rpc_key_file_option = click.option(
    "--rpc-key-file", type=click.Path(exists=True, dir_okay=False), expose_value=False, callback=_use_key,
    help="pre-shared key for workers started with --key-file (same file; see docs/security.md)")
