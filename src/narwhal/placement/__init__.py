"""Placement: where a request runs, by the KV blocks engines already hold and their load."""
