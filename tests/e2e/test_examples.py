"""examples/cluster-from-inventory deployed on two simulated hosts through the real engine: addresses
from an inventory command at deploy time, its own topology, a chat completion through its router,
then destroy. Runs after the sim stack's modules (the hosts keep their driver and weights)."""

from __future__ import annotations

import json
import secrets
import shutil
import ssl
import urllib.request

from e2e.harness import ROOT, on_host, sh


def test_cluster_from_inventory_deploys_and_serves(toolchain, sim, tmp_path):
    root = tmp_path / "checkout"
    shutil.copytree(ROOT / "examples", root / "examples", ignore=shutil.ignore_patterns("node_modules", "sdks", "bin"))
    for name in ("venv", "scripts", "stacks"):
        (root / name).symlink_to(ROOT / name)
    project = root / "examples" / "cluster-from-inventory"
    env = {"PULUMI_BACKEND_URL": f"file://{tmp_path / 'state'}"}
    (tmp_path / "state").mkdir()
    key = secrets.token_hex(16)
    sh(f"cd {project} && pulumi stack init sim --secrets-provider passphrase", env=env)
    sh(f"cd {project} && pulumi config set -s sim --secret glm-example:apiKey {key}", env=env)
    # The inventory of the checkout this runs from (the copy above holds only the examples).
    sh(f"cd {project} && pulumi config set -s sim glm-example:inventoryCommand '{ROOT}/scripts/sim inventory'", env=env)
    try:
        out = sh(f"cd {project} && pulumi up -s sim --yes --skip-preview --non-interactive", env=env)
        assert "inventory" in out.stdout
        outputs = json.loads(sh(f"cd {project} && pulumi stack output -s sim --json --show-secrets", env=env).stdout)
        assert outputs["routerUrl"] == "https://10.88.0.12:8000"
        assert outputs["instances"]["prefill-0"] == {"host": "sim-1", "url": "http://10.88.0.11:8100",
                                                     "gpus": "0,1,2,3,4,5,6,7"}
        req = urllib.request.Request(
            f"{outputs['routerUrl']}/v1/chat/completions",
            data=json.dumps({"model": "glm-5.2", "messages": [{"role": "user", "content": "hi"}]}).encode(),
            headers={"content-type": "application/json", "authorization": f"Bearer {key}"})
        tls = ssl.create_default_context(cadata=outputs["routerCaCertificate"])
        with urllib.request.urlopen(req, timeout=60, context=tls) as r:
            assert json.load(r)["choices"][0]["message"]["content"]
        assert "do_remote_prefill=true" in on_host("sim-2", "journalctl -u glm-vllm-decode-0 --no-pager -o cat")
        sh(f"cd {project} && pulumi preview -s sim --expect-no-changes --non-interactive", env=env)
    finally:
        sh(f"cd {project} && pulumi destroy -s sim --yes --skip-preview --non-interactive", env=env, check=False)
        sh(f"cd {project} && pulumi stack rm -s sim --yes --force", env=env, check=False)
    for h in ("sim-1", "sim-2"):
        assert on_host(h, "systemctl list-units 'glm-*' --all --no-legend").strip() == ""
