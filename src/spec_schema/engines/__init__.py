"""Adapters that check engines' own speculative-decoding objects against the contract.

`spec_schema.engines.sglang` and `spec_schema.engines.vllm` present an engine's objects as views of
the phase classes (never copies) and check them; each imports its engine only when called. Their
field mappings are data (`ClassMap`), from which docs/engines.md's tables are generated.
`spec_schema.engines.sglang_plugin` is the `sglang.srt.plugins` entry point that installs the sglang
checks in every engine process under SPEC_STRICT.
"""

from ._mapping import ClassMap, FieldMap, mapping_table

__all__ = ["ClassMap", "FieldMap", "mapping_table"]
