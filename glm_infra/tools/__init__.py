"""The glm-infra command line and what it runs: validate, plan, render, capacity (cli), doctor, the SLA
gate (sla, sla_plot), the pull-request review (review) and the stack file's JSON Schema (schema)."""
