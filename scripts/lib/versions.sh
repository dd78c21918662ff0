# shellcheck shell=bash
# Pinned versions of everything the toolchain and the simulated cluster build. One place to bump.

# Pulumi CLI (module github.com/pulumi/pulumi/pkg/v3, main package cmd/pulumi). 3.260.0, not a newer one:
# from 3.274.0 on (3.261-3.273 are not served here; 3.276.0 the newest that is) a preview feeds every step to
# a snapshot manager that serializes the whole snapshot each time and discards it (engine/update.go
# previewActions.OnResourceStepPre, for `import --preview-only`), so a preview grows with the square of the
# resource count: 24 hosts 55 s against 22 s on 3.260.0 (docs/PERFORMANCE.md, "Fleet-sized preview").
PULUMI_VERSION=3.260.0
# Python language host. Its module (github.com/pulumi/pulumi/sdk/python/cmd/pulumi-language-python/v3) is
# not served by the Go module proxy reachable here: scripts/toolchain builds it from the upstream source
# (GLM_INFRA_PLUGIN_SOURCES). Hosts since v3.80 honour Pulumi.yaml's `virtualenv`.
PULUMI_LANGHOST_VERSION=3.259.0
# Node.js language host: its module (github.com/pulumi/pulumi/sdk/nodejs/cmd/pulumi-language-nodejs/v3) is in
# the same situation; built from GLM_INFRA_PLUGIN_SOURCES too. It runs examples/typescript-cluster, whose
# @pulumi/pulumi and typescript are pinned in its package.json and package-lock.json.
PULUMI_NODEJS_LANGHOST_VERSION=3.259.0
# pulumi-resource-command, matching the pulumi-command Python SDK pinned in pyproject.toml.
PULUMI_COMMAND_VERSION=1.2.1
# llm-d-inference-sim, the vLLM stand-in of the simulated cluster.
LLM_D_SIM_VERSION=0.10.2
# Debian release of the simulated hosts' root file system.
SIM_DEBIAN_SUITE=bookworm
