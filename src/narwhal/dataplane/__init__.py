"""Data plane: the OpenAI-compatible prefill -> decode request path."""
