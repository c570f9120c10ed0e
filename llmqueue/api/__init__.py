"""The HTTP layer: OpenAI-compatible views, API keys, validation, responses, the error mapping.

The GPU worker never imports this package (pyproject.toml's import-linter contracts)."""
