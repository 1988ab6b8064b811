"""Durable control-plane state: the handoff document and the lease."""
