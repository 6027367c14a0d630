"""Defaults shared by the Python API and the CLI (no imports: the CLI reads them before torch loads)."""

DEFAULT_TEMPERATURE = 0.0
"""`SamplingParams().temperature` and `spec-runtime generate --temperature`: 0 = greedy, so the API and
the command decode the same way unless asked otherwise."""
