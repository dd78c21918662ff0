"""The real-engine check's payload: the pinned wheels, in pieces small enough to carry one at a time to a GPU
machine with no network, each checksummed (issue 41).

    python3 -m testbed.real_engine.payload build --out DIR [--piece-mib 60] [pip download options…]
    python3 testbed/real_engine/payload.py join --pieces DIR --out WHEELHOUSE      (stdlib only: the GPU side)

build: ``pip download`` of vllm, nixl (with its CUDA 13 build, nixl-cu13) and vllm-router at glm_infra/spec/pins.py's versions and of
requirements.txt (their dependencies the GPU machine lacks), as wheels for CPython 3.12 on manylinux x86_64
(``--no-deps``: the list is the resolution); one tar of them cut into ``payload.tar.NNN`` pieces of at most
--piece-mib MiB; ``MANIFEST.json`` (the pins, every wheel with its sha256 and size, every piece) and
``SHA256SUMS`` (every piece and the whole tar, for ``sha256sum -c``). Wheels already downloaded are kept
(DIR/wheels), so a second build downloads nothing.

join: every piece listed must be there with its checksum (a missing or corrupt one is named, exit 1,
nothing extracted); then the whole tar's checksum, then each wheel's; the wheels land in WHEELHOUSE for
``pip install --no-index --find-links WHEELHOUSE``.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REQUIREMENTS = HERE / "requirements.txt"
TAR = "payload.tar"
MANIFEST = "MANIFEST.json"
SUMS = "SHA256SUMS"
MIB = 1 << 20
# What a wheel is built for on the GPU machine (Ubuntu 24.04, Python 3.12).
# pip matches a manylinux tag exactly: every glibc the machine's (Ubuntu 24.04: 2.39) covers; abi3 and pure wheels too.
TARGET = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
          "--abi", "cp312", "--abi", "abi3", "--abi", "none",
          *[a for n in range(17, 40) for a in ("--platform", f"manylinux_2_{n}_x86_64")],
          "--platform", "manylinux2014_x86_64", "--platform", "manylinux1_x86_64", "--platform", "linux_x86_64",
          "--platform", "any"]


class PayloadError(Exception):
    pass


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            h.update(block)
    return h.hexdigest()


def pinned() -> list[str]:
    """vllm, nixl (the package and its CUDA 13 build) and vllm-router at the project's pins, then the listed
    dependencies. Without the nixl package vLLM 0.33.0 says "NIXL is not available" and its NixlConnector
    cannot start (seen on the GPU machine, 2026-12-06)."""
    sys.path.insert(0, str(HERE.parents[1]))
    from glm_infra.spec import pins

    # nixl is the package vLLM imports (nixl._api, which loads the CUDA build's nixl_cu13): both, or no KV transfer.
    reqs = [f"vllm=={pins.VLLM}", f"nixl=={pins.NIXL}", f"nixl-cu13=={pins.NIXL}", f"vllm-router=={pins.VLLM_ROUTER}"]
    for line in REQUIREMENTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            reqs.append(line)
    return reqs


def download(requirements: list[str], wheels: Path, pip_options: list[str]) -> None:
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "off", "--dest", str(wheels),
           *TARGET, *pip_options, *requirements]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise PayloadError(f"pip download failed (exit {p.returncode}): {p.stderr.strip()[-2000:]}")


def build(out: Path, piece_bytes: int, pip_options: list[str], requirements: list[str] | None = None) -> dict:
    if piece_bytes < 4096:
        raise PayloadError(f"a piece of {piece_bytes} bytes is too small")
    requirements = requirements if requirements is not None else pinned()
    wheels = out / "wheels"
    download(requirements, wheels, pip_options)
    files = sorted(wheels.glob("*.whl"))
    names = {_project(f.name) for f in files}
    missing = [r for r in requirements if _project(r.split("==")[0]) not in names]
    if missing:
        raise PayloadError(f"no wheel downloaded for {', '.join(missing)}")
    for old in out.glob(f"{TAR}.*"):
        old.unlink()
    tar_path = out / TAR
    with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as tar:
        for f in files:
            info = tar.gettarinfo(str(f), arcname=f.name)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            with f.open("rb") as src:
                tar.addfile(info, src)
    pieces = []
    with tar_path.open("rb") as src:
        for n, block in enumerate(iter(lambda: src.read(piece_bytes), b"")):
            piece = out / f"{TAR}.{n:03d}"
            piece.write_bytes(block)
            pieces.append({"name": piece.name, "size": len(block), "sha256": hashlib.sha256(block).hexdigest()})
    whole = sha256_file(tar_path)
    tar_path.unlink()
    manifest = {
        "requirements": requirements,
        "wheels": [{"name": f.name, "size": f.stat().st_size, "sha256": sha256_file(f)} for f in files],
        "tar": {"name": TAR, "sha256": whole, "size": sum(p["size"] for p in pieces)},
        "pieces": pieces,
        "piece_bytes": piece_bytes,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    (out / SUMS).write_text("".join(f"{p['sha256']}  {p['name']}\n" for p in pieces) + f"{whole}  {TAR}\n")
    return manifest


def _project(name: str) -> str:
    """A distribution's name as wheels spell it (PEP 427: - . _ runs as one _, lower case)."""
    import re

    return re.sub(r"[-_.]+", "_", name.split("-", 1)[0] if name.endswith(".whl") else name).lower()


def join(pieces_dir: Path, wheelhouse: Path) -> list[str]:
    """The wheels, checked piece by piece, as a whole and one by one; their names."""
    try:
        manifest = json.loads((pieces_dir / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise PayloadError(f"{pieces_dir / MANIFEST}: {e}") from None
    problems = []
    for p in manifest["pieces"]:
        path = pieces_dir / p["name"]
        if not path.is_file():
            problems.append(f"{p['name']}: missing (copy it from the payload folder)")
        elif path.stat().st_size != p["size"] or sha256_file(path) != p["sha256"]:
            problems.append(f"{p['name']}: corrupt ({path.stat().st_size} bytes, want {p['size']}; checksum differs)")
    if problems:
        raise PayloadError("; ".join(problems))
    whole = hashlib.sha256()
    buffer = io.BytesIO()
    for p in manifest["pieces"]:
        block = (pieces_dir / p["name"]).read_bytes()
        whole.update(block)
        buffer.write(block)
    if whole.hexdigest() != manifest["tar"]["sha256"]:
        raise PayloadError(f"{TAR}: the pieces joined do not match its checksum (pieces from two builds?)")
    buffer.seek(0)
    wheelhouse.mkdir(parents=True, exist_ok=True)
    wanted = {w["name"]: w for w in manifest["wheels"]}
    names = []
    with tarfile.open(fileobj=buffer, mode="r:") as tar:
        for member in tar.getmembers():
            if not member.isfile() or "/" in member.name or member.name not in wanted:
                raise PayloadError(f"{TAR}: unexpected member {member.name!r}")
            data = tar.extractfile(member).read()
            if hashlib.sha256(data).hexdigest() != wanted[member.name]["sha256"]:
                raise PayloadError(f"{member.name}: checksum differs from the manifest")
            tmp = wheelhouse / f".{member.name}.part"
            tmp.write_bytes(data)
            os.replace(tmp, wheelhouse / member.name)
            names.append(member.name)
    if sorted(names) != sorted(wanted):
        raise PayloadError(f"{TAR}: holds {len(names)} of the {len(wanted)} wheels listed")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="payload", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="download the pinned wheels and cut them into checksummed pieces")
    b.add_argument("--out", required=True, type=Path)
    b.add_argument("--piece-mib", type=float, default=60.0, help="largest piece in MiB (default 60)")
    b.add_argument("pip_options", nargs=argparse.REMAINDER, help="after --: options for pip download "
                                                                 "(--index-url, --find-links, --no-index)")
    j = sub.add_parser("join", help="check the pieces and unpack the wheels")
    j.add_argument("--pieces", required=True, type=Path)
    j.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            options = [o for o in args.pip_options if o != "--"]
            m = build(args.out, int(args.piece_mib * MIB), options)
            print(f"{len(m['wheels'])} wheels, {m['tar']['size'] / MIB:.1f} MiB in {len(m['pieces'])} pieces of at "
                  f"most {args.piece_mib:g} MiB under {args.out} ({SUMS}, {MANIFEST})")
        else:
            names = join(args.pieces, args.out)
            print(f"{len(names)} wheels checked into {args.out}: pip install --no-index --find-links {args.out} ...")
    except PayloadError as e:
        print(f"payload: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
