"""The `orchestrator` command: `orchestrator serve ...` is the HTTP server (serve_cli.py), anything else
generates text (cli.py)."""

import sys


def main() -> None:
    if sys.argv[1:2] == ["serve"]:
        from orchestrator.serve_cli import serve  # noqa: PLC0415 - each command imports only what it needs

        serve(args=sys.argv[2:], prog_name="orchestrator serve")
    else:
        from orchestrator.cli import main as generate  # noqa: PLC0415

        generate()
