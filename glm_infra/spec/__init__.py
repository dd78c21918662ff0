"""The stack model and the facts it is checked against: pydantic models of a stack file (config),
pinned versions and the choices each accepts (pins, packages), where things land on a host (paths), and
the checkpoint's facts (checkpoint, checkpoints/). The bottom layer: it imports nothing else of glm_infra."""
