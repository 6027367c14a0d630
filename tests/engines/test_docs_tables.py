"""docs/engines.md's mapping tables are the ones generated from the adapters' own mappings."""

from pathlib import Path

import pytest

from spec_schema.engines import mapping_table, sglang, vllm

DOC = Path(__file__).resolve().parents[2] / "docs" / "engines.md"


@pytest.mark.parametrize("engine", [sglang, vllm], ids=["sglang", "vllm"])
def test_the_docs_table_is_the_generated_one(engine):
    name = engine.__name__.rsplit(".", 1)[1]
    doc = DOC.read_text(encoding="utf-8")
    inside = doc.split(f"<!-- {name}-mapping:start -->\n")[1].split(f"\n<!-- {name}-mapping:end -->")[0]
    assert inside.strip() == mapping_table(engine.CLASS_MAPS).strip(), (
        f"docs/engines.md's {name} table drifted from spec_schema.engines.{name}.CLASS_MAPS: regenerate it "
        f"with mapping_table({name}.CLASS_MAPS)"
    )
