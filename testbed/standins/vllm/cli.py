"""The ``vllm`` command: ``vllm --version``, ``vllm serve MODEL [flags]`` and ``vllm download-kernels``.

``serve`` accepts exactly the flags glm-infra renders, so a misspelt or unsupported flag fails on
the simulated cluster (exit 2, argparse style) instead of being ignored. ``download-kernels`` does
what vLLM 0.33's does: install the FlashInfer kernels wheel matching the installed FlashInfer, with
the uv found on PATH (or pip), and records each run in ``<venv>/glm-sim-download-kernels.log``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from . import __version__
from .serve import ServeError, serve


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object: {text!r}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {text}")
    return value


def port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {text}")
    return value


def memory_fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1]: {text}")
    return value


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="directory of the staged weights")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--kv-transfer-config", type=json_object)
    p.add_argument("--chat-template-content-format", choices=["auto", "string", "openai"], default="auto")
    p.add_argument("--compilation-config", type=json_object)
    p.add_argument("--max-num-batched-tokens", type=positive_int)
    p.add_argument("-ep", "--enable-expert-parallel", action="store_true")
    p.add_argument("-tp", "--tensor-parallel-size", type=positive_int, default=1)
    p.add_argument("-dp", "--data-parallel-size", type=positive_int, default=1)
    # vLLM's default: one API server per DP rank (what -dp > 1 implies, seen with vLLM 0.33.0).
    p.add_argument("-asc", "--api-server-count", type=positive_int, default=None)
    p.add_argument("--tool-call-parser")
    p.add_argument("--enable-auto-tool-choice", action="store_true")
    p.add_argument("--reasoning-parser")
    p.add_argument("--gpu-memory-utilization", type=memory_fraction, default=0.9)
    p.add_argument("--enable-prompt-tokens-details", action="store_true")
    p.add_argument("--all2all-backend")
    p.add_argument("--speculative-config", type=json_object)
    p.add_argument("--shutdown-timeout", type=non_negative_int, default=0, metavar="SECONDS")
    p.add_argument("--fingerprint-mode")
    p.add_argument("--served-model-name", nargs="+", metavar="NAME")
    p.add_argument("--host", help="address to serve on (default: all)")
    p.add_argument("--port", type=port, default=8000)
    p.add_argument("--data-parallel-rpc-port", type=port)
    p.add_argument("--max-num-seqs", type=positive_int, default=256)
    # Default: the model's context, from its config.json, as vLLM takes it.
    p.add_argument("--max-model-len", type=positive_int, default=None)
    p.add_argument("--kv-cache-dtype", default="auto")


def build_parser() -> argparse.ArgumentParser:
    # No abbreviations: a rendered flag must be spelt out, as glm-infra writes it.
    parser = argparse.ArgumentParser(
        prog="vllm", description="vLLM stand-in of glm-infra's simulated cluster", allow_abbrev=False
    )
    parser.add_argument("--version", action="version", version=__version__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve_parser = commands.add_parser("serve", help="serve MODEL over the OpenAI-compatible API", allow_abbrev=False)
    add_serve_arguments(serve_parser)
    kernels = commands.add_parser("download-kernels", help="Install precompiled kernels for faster startup.",
                                  allow_abbrev=False)
    kernels.add_argument("--dry-run", action="store_true", help="Print the install commands without running them.")
    return parser


KERNELS_RECORD = "glm-sim-download-kernels.log"


def download_kernels(dry_run: bool) -> int:
    if importlib.util.find_spec("flashinfer") is None:
        print("FlashInfer is not installed; skipping its kernels.", flush=True)
        return 0
    flashinfer = importlib.metadata.version("flashinfer-python").split("+", 1)[0]
    uv = shutil.which("uv")
    installer = [uv, "pip", "install", "--python", sys.executable] if uv else [sys.executable, "-m", "pip", "install"]
    cmd = [*installer, "--upgrade", "--no-deps", f"flashinfer-cubin=={flashinfer}"]
    print("Command: " + " ".join(cmd), flush=True)
    rc = 0 if dry_run else subprocess.run(cmd, check=False).returncode
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "vllm": __version__,
             "flashinfer": flashinfer, "dry_run": dry_run, "command": cmd, "exit": rc}
    with (Path(sys.prefix) / KERNELS_RECORD).open("a") as record:
        record.write(json.dumps(entry) + "\n")
    return rc


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "download-kernels":
        return download_kernels(args.dry_run)
    try:
        return serve(args)
    except ServeError as e:
        print(f"vllm serve: error: {e}", file=sys.stderr, flush=True)
        return 1
