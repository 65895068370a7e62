"""The `orchestrator` command: `orchestrator serve ...` is the HTTP server (serving/cli.py), anything else
generates text (cli.py)."""

import signal
import sys


def _terminated(signum, frame) -> None:
    raise KeyboardInterrupt  # ends the run the way Ctrl-C does, local workers stopped on the way out


def main() -> None:
    # SIGTERM (kill, docker stop, systemd) shuts down as SIGINT does, as llama-server's does: without this
    # Python dies at once and the local workers it started live on, each holding its port and memory
    signal.signal(signal.SIGTERM, _terminated)
    if sys.argv[1:2] == ["serve"]:
        from orchestrator.serving.cli import serve  # noqa: PLC0415 - each command imports only what it needs

        serve(args=sys.argv[2:], prog_name="orchestrator serve")
    else:
        from orchestrator.cli import main as generate  # noqa: PLC0415

        generate()
