"""glm-infra as a library: the wheel holds the package (templates, host programs, py.typed), imports
from an installed copy, declares ranges rather than pins, and its Args stay generated from the
stack models."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import tomllib
from conftest import ROOT


def test_the_wheel_imports_from_its_own_files(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--wheel-dir", str(tmp_path / "dist"), str(ROOT)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("glm_infra-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for required in ("glm_infra/py.typed", "glm_infra/agent/hostcheck/__main__.py", "glm_infra/agent/bundle.py",
                     "glm_infra/agent/canary/__main__.py", "glm_infra/agent/weights/__main__.py",
                     "glm_infra/roles/vllm/templates/vllm.service.j2", "glm_infra/templates/service.sh.j2",
                     "glm_infra/roles/monitoring/dashboards/glm-infra.json", "glm_infra/args.py",
                     # GLM-5.2's own config files, their provenance and licence (capacity planning)
                     "glm_infra/spec/checkpoints/nvidia--GLM-5.2-NVFP4/config.json",
                     "glm_infra/spec/checkpoints/nvidia--GLM-5.2-NVFP4/hf_quant_config.json",
                     "glm_infra/spec/checkpoints/nvidia--GLM-5.2-NVFP4/SOURCE.json",
                     "glm_infra/spec/checkpoints/LICENSES/Apache-2.0.txt"):
        assert required in names, required
    assert not any(n.startswith(("tests/", "testbed/", "stacks/", "scripts/")) for n in names)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                    str(wheel)], check=True, capture_output=True)
    probe = ("import glm_infra; from glm_infra import Cluster, Hosts, ClusterArgs; "
             "from glm_infra import render; print(glm_infra.__file__); print(render.hostcheck_source().splitlines()[0]); "
             "from glm_infra.spec import checkpoint as c; "
             "print(c.load_real_config(c.real_config_dir('nvidia/GLM-5.2-NVFP4')).config['max_position_embeddings'])")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env={"PYTHONPATH": str(target)},
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0].startswith(str(target)), "imported from the installed wheel, not the checkout"
    assert out[1] == "#!/usr/bin/env python3"
    assert out[2] == "1048576", "the installed copy reads the real config, its sha256 checked"


def program_pins() -> dict[str, str]:
    """constraints.txt as {name: version}; every line that is not a comment pins one exact version."""
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        requirement = line.split("#", 1)[0].strip()
        if requirement:
            assert requirement.count("==") == 1, f"constraints.txt: {line!r} does not pin one exact version"
            name, version = requirement.split("==")
            pins[name] = version
    return pins


def test_the_library_takes_ranges_and_the_program_pins():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for dep in meta["dependencies"]:
        assert "==" not in dep and ">=" in dep and "<" in dep, dep
    pins = program_pins()
    assert pins
    names = {name.lower().replace("_", "-") for name in pins}
    assert {"pulumi", "pulumi-command", "pydantic", "pyyaml", "jinja2"} <= names
    assert "-c constraints.txt" in (ROOT / "requirements.txt").read_text()


def test_cluster_args_are_generated_from_the_stack_models():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen-args"), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def fake_wheel(folder, name: str, version: str) -> None:
    """A wheel of ``name`` at ``version`` with metadata only: what an index offers once a newer release
    is out (pip resolves it from its metadata; --dry-run installs nothing)."""
    dist = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as whl:
        whl.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        whl.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: glm-infra-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{dist}/RECORD", "")


def test_pip_in_the_program_venv_keeps_the_pins(tmp_path):
    """The engine runs `pip install --upgrade pip setuptools wheel` in the provider's virtualenv (venv/,
    on `pulumi package add|get-schema ./provider`): with a newer release on the index, pip in venv/
    must keep the pinned versions (venv/pip.conf, written by scripts/lib/venv.sh), or it replaces pip
    under a concurrent `pulumi up`. And venv/ holds those pins."""
    pins = program_pins()
    installers = ("pip", "setuptools", "wheel")
    python = str(ROOT / "venv" / "bin" / "python")
    for name in installers:
        fake_wheel(tmp_path, name, "999.0")
    p = subprocess.run([python, "-m", "pip", "install", "--dry-run", "--upgrade", "--no-index", "--find-links",
                        str(tmp_path), "--disable-pip-version-check", *installers], capture_output=True, text=True)
    assert p.returncode == 0 and "Would install" not in p.stdout, p.stdout + p.stderr
    freeze = subprocess.run([python, "-m", "pip", "freeze", "--all"], capture_output=True, text=True, check=True)
    installed = dict(l.split("==") for l in freeze.stdout.splitlines() if "==" in l)
    assert {n: installed.get(n) for n in installers} == {n: pins[n] for n in installers}
