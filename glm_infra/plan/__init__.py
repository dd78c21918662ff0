"""Pure planning over a stack model: instances onto hosts (topology), the ports each host opens (ports),
the KV-cache room per rank (capacity) and the cross-field rules a stack must keep (validate)."""
