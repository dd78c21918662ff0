"""Component Args split into what is judged at once and what comes later (glm_infra.inputs), without
the Pulumi engine: stand-ins for unknown addresses, secrets taken out of what is validated."""

from __future__ import annotations

import pulumi
import pytest
from conftest import stack_file

from glm_infra import inputs
from glm_infra.stack import StackError, load_file

MODEL = {"repo": "nvidia/GLM-5.2-NVFP4", "revision": "0" * 40, "path": "/mnt/model/glm/GLM-5.2-NVFP4"}


class Later:
    """A value another resource produces (awaitable, like a Pulumi Output)."""

    def __await__(self):
        yield
        return "10.9.0.1"


def test_plain_args_are_left_as_they_are():
    args = {"hosts": [{"name": "a", "address": "10.0.0.1"}], "ssh": {"private_key_path": "/k"}, "model": dict(MODEL)}
    s = inputs.split(args)
    assert s.raw == args and not s.later and s.addresses == {} and s.mirror_url is None
    assert s.private_key_path == "/k" and s.secrets == {}
    assert args["hosts"][0]["address"] == "10.0.0.1", "the caller's dicts are not changed"


def test_later_addresses_and_mirror_get_stand_ins_from_a_documentation_range():
    a, b, m = Later(), Later(), Later()
    args = {"hosts": [{"name": "a", "address": a}, {"name": "b", "address": "10.0.0.2"}, {"name": "c", "address": b}],
            "ssh": {"user": "root"}, "model": {**MODEL, "source": "mirror", "mirrorUrl": m}}
    s = inputs.split(args)
    assert s.later and s.addresses == {"a": a, "c": b} and s.mirror_url is m
    assert [h["address"] for h in s.raw["hosts"]] == ["198.51.100.1", "10.0.0.2", "198.51.100.3"]
    assert s.raw["model"]["mirrorUrl"] == "http://198.51.100.254/mirror"
    assert args["hosts"][0]["address"] is a and args["model"]["mirrorUrl"] is m, "the caller's dicts are not changed"


@pytest.mark.parametrize("top, key, name", [("ssh", "private_key", "private_key"), ("ssh", "privateKey", "private_key"),
                                            ("model", "hf_token", "hf_token"), ("model", "hfToken", "hf_token"),
                                            ("router", "api_key", "router_api_key"), ("router", "apiKey", "router_api_key")])
def test_secrets_are_taken_out_of_what_is_validated(top, key, name):
    args = {"hosts": [{"name": "a", "address": "10.0.0.1"}], "ssh": {}, "model": dict(MODEL), "router": {"host": "a"}}
    args[top] = {**args[top], key: "s3cr3t"}
    s = inputs.split(args)
    assert s.secrets == {name: "s3cr3t"}
    assert s.raw[top][key] == "<secret>" and "s3cr3t" not in repr(s.raw)
    assert args[top][key] == "s3cr3t"


def test_load_validates_with_the_stack_messages():
    _, loaded = inputs.load({"hosts": [{"name": "a", "address": "10.0.0.1"}], "ssh": {"private_key": "k"},
                             "model": MODEL, "firewall": {"admin_cidrs": ["10.20.0.0/24"]}}, "Cluster 'x'")
    assert loaded.config.colocated is not None and loaded.config.ssh.private_key is not None
    with pytest.raises(StackError) as e:
        inputs.load({"hosts": [{"name": "a", "address": "10.0.0.1"}], "ssh": {"private_key": "k"}, "model": MODEL,
                     "colocated": {"hosts": ["a"], "tp": 0}}, "Cluster 'x'")
    assert str(e.value).splitlines()[1] == (
        "  Cluster 'x': glm-infra:colocated.tp: Input should be greater than or equal to 1 (got 0)")
    with pytest.raises(StackError, match=r"glm-infra:hostz: unknown key \(did you mean glm-infra:hosts\?\)"):
        inputs.load({"hostz": [], "hosts": [{"name": "a", "address": "10.0.0.1"}], "ssh": {"private_key": "k"},
                     "model": MODEL}, "x")
    from glm_infra.stack import load_dict

    with pytest.raises(StackError, match=r"\(args\): must be a mapping"):
        load_dict([], "x")  # type: ignore[arg-type]


def test_the_programs_args_hold_each_secret_as_a_secret_and_drop_the_unreadable():
    """program.cluster_args: a secret with its plaintext (a Pulumi run) becomes a secret Output; one
    read offline (ciphertext only) is left out; unset settings are left out."""
    from glm_infra.program import cluster_args
    from glm_infra.spec.config import SecretValue

    cfg = load_file(stack_file("sim")).config
    assert "api_key" not in cluster_args(cfg)["router"], "encrypted in the file, no plaintext offline"
    router = cfg.router.model_copy(update={"api_key": SecretValue("sk-1"), "tls_key": SecretValue(None),
                                           "tls_certificate": None})
    monitoring = cfg.monitoring.model_copy(update={"webhook_url": SecretValue("http://10.0.0.9/hook")})
    args = cluster_args(cfg.model_copy(update={"router": router, "monitoring": monitoring}))
    assert isinstance(args["router"]["api_key"], pulumi.Output) and isinstance(args["monitoring"]["webhook_url"], pulumi.Output)
    assert "tls_key" not in args["router"] and "tls_certificate" not in args["router"]
    assert "private_key" not in args["ssh"] and args["ssh"]["private_key_path"] == cfg.ssh.private_key_path
