"""spec_runtime: a compact reference runtime for speculative decoding on Llama-family models."""

__all__: list[str] = []
