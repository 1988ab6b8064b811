"""Telemetry: Prometheus metrics and logs."""
