"""The router: OpenAI-compatible HTTP API, worker choice, dispatch to P and D, admission, metrics."""
