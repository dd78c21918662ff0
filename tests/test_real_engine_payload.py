"""The real-engine check's payload (testbed/real_engine/payload.py): real `pip download` from a local index of
wheels made here, pieces no larger than asked, and a join on the far side that takes nothing it cannot check."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT

from glm_infra.spec import pins
from testbed.real_engine import payload

KIB = 1024


def wheel(folder: Path, name: str, version: str, size: int) -> Path:
    """A pure-Python wheel pip accepts, carrying ``size`` incompressible bytes."""
    dist = name.replace("-", "_")
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{dist}/__init__.py", "")
        z.writestr(f"{dist}/blob.bin", os.urandom(size))
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


@pytest.fixture
def index(tmp_path) -> Path:
    d = tmp_path / "index"
    d.mkdir()
    wheel(d, "vllm", pins.VLLM, 300 * KIB)
    wheel(d, "nixl-cu13", pins.NIXL, 40 * KIB)
    wheel(d, "vllm-router", pins.VLLM_ROUTER, 40 * KIB)
    wheel(d, "pycountry", "26.2.16", 10 * KIB)
    wheel(d, "vllm", "0.32.0", 10 * KIB)  # another version beside the pinned one: never taken
    return d


REQS = [f"vllm=={pins.VLLM}", f"nixl-cu13=={pins.NIXL}", f"vllm-router=={pins.VLLM_ROUTER}", "pycountry==26.2.16"]


def build(out: Path, index: Path, piece: int = 64 * KIB) -> dict:
    return payload.build(out, piece, ["--no-index", "--find-links", str(index)], REQS)


def test_the_payload_is_the_pinned_wheels_in_checksummed_pieces_no_larger_than_asked(tmp_path, index):
    out = tmp_path / "payload"
    m = build(out, index)
    assert sorted(w["name"] for w in m["wheels"]) == sorted(
        [f"vllm-{pins.VLLM}-py3-none-any.whl", f"nixl_cu13-{pins.NIXL}-py3-none-any.whl",
         f"vllm_router-{pins.VLLM_ROUTER}-py3-none-any.whl", "pycountry-26.2.16-py3-none-any.whl"])
    pieces = sorted(out.glob("payload.tar.*"))
    assert len(pieces) >= 6 and all(p.stat().st_size <= 64 * KIB for p in pieces)
    assert [p.name for p in pieces] == [p["name"] for p in m["pieces"]]
    assert not (out / "payload.tar").exists()
    # sha256sum -c reads SHA256SUMS: every piece passes (the whole tar is not there to check here).
    check = subprocess.run(["sha256sum", "-c", "--ignore-missing", "SHA256SUMS"], cwd=out, capture_output=True, text=True)
    assert check.returncode == 0 and check.stdout.count(": OK") == len(pieces), check.stdout + check.stderr
    joined = hashlib.sha256(b"".join(p.read_bytes() for p in pieces)).hexdigest()
    assert f"{joined}  payload.tar" in (out / "SHA256SUMS").read_text()
    # A second build downloads nothing new and makes the same tar.
    again = build(out, index)
    assert again["tar"]["sha256"] == m["tar"]["sha256"]


def test_the_pins_are_the_projects_and_the_list_is_the_checked_in_resolution():
    reqs = payload.pinned()
    assert reqs[:4] == [f"vllm=={pins.VLLM}", f"nixl=={pins.NIXL}", f"nixl-cu13=={pins.NIXL}",
                        f"vllm-router=={pins.VLLM_ROUTER}"]
    rest = reqs[4:]
    assert len(rest) == 89 and all(r.count("==") == 1 for r in rest)
    assert not {r.split("==")[0] for r in rest} & {"torch", "flashinfer-python", "vllm"}


def test_join_checks_every_piece_and_unpacks_exactly_the_wheels(tmp_path, index):
    out = tmp_path / "payload"
    m = build(out, index)
    carried = tmp_path / "carried"  # what reached the GPU machine: the pieces and the manifest only
    carried.mkdir()
    for p in [*out.glob("payload.tar.*"), out / "MANIFEST.json", out / "SHA256SUMS"]:
        (carried / p.name).write_bytes(p.read_bytes())
    house = tmp_path / "wheelhouse"
    # The GPU side runs the file alone, with the standard library only.
    p = subprocess.run([sys.executable, "-I", str(ROOT / "testbed/real_engine/payload.py"), "join", "--pieces",
                        str(carried), "--out", str(house)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "4 wheels checked" in p.stdout
    for w in m["wheels"]:
        assert hashlib.sha256((house / w["name"]).read_bytes()).hexdigest() == w["sha256"]
    # pip takes them from there, offline.
    target = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(house),
                                "--target", str(target), "--no-deps", f"vllm=={pins.VLLM}"], capture_output=True, text=True)
    assert installed.returncode == 0, installed.stderr
    assert (target / "vllm" / "blob.bin").stat().st_size == 300 * KIB


@pytest.mark.parametrize("damage", ["missing", "corrupt", "truncated", "another-build"])
def test_a_piece_missing_or_damaged_is_named_and_nothing_is_unpacked(tmp_path, index, damage):
    out = tmp_path / "payload"
    build(out, index)
    victim = out / "payload.tar.002"
    if damage == "missing":
        victim.unlink()
        why = "payload.tar.002: missing"
    elif damage == "corrupt":
        data = bytearray(victim.read_bytes())
        data[100] ^= 0xFF
        victim.write_bytes(bytes(data))
        why = "payload.tar.002: corrupt"
    elif damage == "truncated":
        victim.write_bytes(victim.read_bytes()[:-1])
        why = "payload.tar.002: corrupt"
    else:  # every piece intact but the manifest of another build
        manifest = json.loads((out / "MANIFEST.json").read_text())
        manifest["tar"]["sha256"] = "0" * 64
        (out / "MANIFEST.json").write_text(json.dumps(manifest))
        why = "the pieces joined do not match its checksum"
    house = tmp_path / "wheelhouse"
    with pytest.raises(payload.PayloadError, match=why):
        payload.join(out, house)
    assert not house.exists() or not list(house.iterdir())


def test_a_pin_no_index_serves_fails_naming_it(tmp_path, index):
    with pytest.raises(payload.PayloadError, match="pip download failed"):
        payload.build(tmp_path / "p", 64 * KIB, ["--no-index", "--find-links", str(index)], ["vllm==9.9.9"])
    assert payload.main(["build", "--out", str(tmp_path / "q"), "--piece-mib", "0.001", "--", "--no-index"]) == 1
