"""Build a wheel from a package directory, and write a find-links index; stdlib only.

    wheels.py build --name N --version V --tag T --package DIR --out OUT [--summary S]
                    [--console-script NAME=MODULE:FUNC] [--executable DEST=SOURCE] [--requires REQ]
    wheels.py index OUT_DIR

Wheels are reproducible (sorted entries, fixed timestamps), so an unchanged source gives the same file.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import html
import re
import urllib.parse
import zipfile
from pathlib import Path

# Zip's earliest representable time: the same inputs give byte-identical wheels.
FIXED_DATE = (1980, 1, 1, 0, 0, 0)
REGULAR_FILE = 0o100644
EXECUTABLE_FILE = 0o100755


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def package_files(package: Path) -> dict[str, tuple[Path, int]]:
    """Wheel path -> (source, mode) of every file of the package, without bytecode caches."""
    files = {}
    for source in sorted(package.rglob("*")):
        if source.is_file() and "__pycache__" not in source.parts and source.suffix != ".pyc":
            files[f"{package.name}/{source.relative_to(package).as_posix()}"] = (source, REGULAR_FILE)
    return files


def build(args: argparse.Namespace) -> Path:
    files = package_files(Path(args.package))
    for spec in args.executable:
        dest, _, source = spec.partition("=")
        files[dest] = (Path(source), EXECUTABLE_FILE)

    # File names carry the normalised name (flashinfer-python -> flashinfer_python), METADATA the real one.
    stem = re.sub(r"[-_.]+", "_", args.name).lower()
    dist_info = f"{stem}-{args.version}.dist-info"
    metadata = [
        "Metadata-Version: 2.1",
        f"Name: {args.name}",
        f"Version: {args.version}",
        f"Summary: {args.summary}",
        "Requires-Python: >=3.10",
    ]
    metadata += [f"Requires-Dist: {r}" for r in args.requires]
    wheel = [
        "Wheel-Version: 1.0",
        "Generator: glm-infra testbed/standins/wheels.py",
        f"Root-Is-Purelib: {'true' if args.tag.endswith('-any') else 'false'}",
        f"Tag: {args.tag}",
    ]
    generated = {
        f"{dist_info}/METADATA": "\n".join(metadata) + "\n",
        f"{dist_info}/WHEEL": "\n".join(wheel) + "\n",
    }
    if args.console_script:
        scripts = [f"{name} = {target}" for name, _, target in (s.partition("=") for s in args.console_script)]
        generated[f"{dist_info}/entry_points.txt"] = "[console_scripts]\n" + "\n".join(scripts) + "\n"

    out = Path(args.out) / f"{stem}-{args.version.replace('-', '_')}-{args.tag}.whl"
    partial = out.with_suffix(".partial")
    record = []

    def entry(path: str, mode: int) -> zipfile.ZipInfo:
        info = zipfile.ZipInfo(path, FIXED_DATE)
        info.external_attr = mode << 16  # keeps the simulator executable once installed
        info.compress_type = zipfile.ZIP_DEFLATED
        return info

    with zipfile.ZipFile(partial, "w") as whl:
        contents = [(path, source.read_bytes(), mode) for path, (source, mode) in sorted(files.items())]
        contents += [(path, text.encode(), REGULAR_FILE) for path, text in generated.items()]
        for path, data, mode in contents:
            whl.writestr(entry(path, mode), data)
            record.append(f"{path},{record_hash(data)},{len(data)}")
        record.append(f"{dist_info}/RECORD,,")
        whl.writestr(entry(f"{dist_info}/RECORD", REGULAR_FILE), "\n".join(record) + "\n")
    partial.replace(out)
    return out


def index(args: argparse.Namespace) -> Path:
    """A plain HTML page linking every wheel (with its sha256, which pip and uv verify)."""
    out_dir = Path(args.out_dir)
    links = []
    for wheel in sorted(out_dir.glob("*.whl")):
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        href = f"{urllib.parse.quote(wheel.name)}#sha256={digest}"
        links.append(f'    <a href="{html.escape(href)}">{html.escape(wheel.name)}</a><br>')
    page = ["<!DOCTYPE html>", "<html>", "  <head><title>glm-infra wheels</title></head>", "  <body>"]
    page += links + ["  </body>", "</html>"]
    target = out_dir / "index.html"
    partial = target.with_name(target.name + ".partial")
    partial.write_text("\n".join(page) + "\n")
    partial.replace(target)  # a host installing meanwhile reads the old page or the new, never half of one
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    b = commands.add_parser("build")
    b.add_argument("--name", required=True)
    b.add_argument("--version", required=True)
    b.add_argument("--tag", required=True, help="python-abi-platform, e.g. py3-none-any")
    b.add_argument("--package", required=True, help="directory of the import package")
    b.add_argument("--out", required=True)
    b.add_argument("--summary", default="")
    b.add_argument("--console-script", action="append", default=[], metavar="NAME=MODULE:FUNC")
    b.add_argument("--executable", action="append", default=[], metavar="DEST=SOURCE")
    b.add_argument("--requires", action="append", default=[], metavar="REQUIREMENT", help="a Requires-Dist line")
    i = commands.add_parser("index")
    i.add_argument("out_dir")
    args = parser.parse_args()
    print(build(args) if args.command == "build" else index(args))


if __name__ == "__main__":
    main()
