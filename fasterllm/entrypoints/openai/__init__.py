"""The OpenAI-compatible server: protocol, serving, app, metrics."""
