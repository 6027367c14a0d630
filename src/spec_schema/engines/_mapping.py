"""Field mappings of engine classes to phase classes, as data (the adapters and the docs read them)."""

from dataclasses import dataclass
from typing import Optional

from ..policy import IndexPolicy


@dataclass(frozen=True)
class FieldMap:
    """Where one contract field lives in an engine's objects and how the view of it is made.

    `engine` is the attribute path as the engine spells it (`"draft_token"`, `"batch.seq_lens"`);
    `layout` says how the contract's view is taken from it (`"as is"`, `"view (bs, num_draft) of
    the flat (bs*num_draft,)"`); `dtype` is the engine's index dtype where the policy declares one.
    """

    contract: str
    engine: str
    layout: str = "as is"
    dtype: str = ""


@dataclass(frozen=True)
class ClassMap:
    """One engine class (or result) mapped onto one phase class."""

    engine_cls: str
    contract_cls: type
    fields: tuple[FieldMap, ...]
    policy: Optional[IndexPolicy] = None
    note: str = ""

    def engine_name(self, contract_field: str) -> str:
        """The engine attribute holding `contract_field` (the field itself when unmapped)."""
        for f in self.fields:
            if f.contract == contract_field:
                return f.engine
        return contract_field


def mapping_table(maps: "list[ClassMap] | tuple[ClassMap, ...]") -> str:
    """Markdown tables of the mappings, one per engine class (docs/engines.md embeds these)."""
    out = []
    for m in maps:
        out.append(f"**`{m.engine_cls}` -> `{m.contract_cls.__name__}`**" + (f": {m.note}" if m.note else ""))
        out.append("")
        out.append("| contract field | engine attribute | view | engine dtype |")
        out.append("|---|---|---|---|")
        for f in m.fields:
            out.append(f"| `{f.contract}` | `{f.engine}` | {f.layout} | {f.dtype or '-'} |")
        out.append("")
    return "\n".join(out)
