"""Index dtype policies: the int32 or int64 an engine's layout uses for ids, positions and indices.

The contract's own layout (what `spec_runtime` produces) types token ids, positions and indices as
int64 and per-request counts as int32. Engines keep some of them as int32 (sglang's bonus tokens,
vLLM's flat draft ids) and would pay a copy per boundary to convert. An `IndexPolicy` declares, per
field of one phase class, the dtype (or, where an engine's own paths legitimately produce both, the
two dtypes) that field has in that engine: `check(..., index_dtypes=policy)` then accepts exactly
those. Only index fields (annotated int32 or int64) can be named, and only int32/int64 given: no
other check is loosened. Mixing the two dtypes of a field in one merge is refused by `check_merge`.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any, Union

import torch

from ._plan import FieldPlan, plan_for

INDEX_DTYPES = frozenset({torch.int32, torch.int64})
_NAMES = {torch.int32: "int32", torch.int64: "int64"}

DtypeSpec = Union[torch.dtype, tuple[torch.dtype, ...]]


class IndexPolicy:
    """The index dtypes of one engine's layout of one phase class.

    `dtypes` maps a field of `cls` to its dtype or a tuple of allowed dtypes; fields of a nested
    phase object (`VerifyOutput.draft_extend_input`) are named with a dot
    (`"draft_extend_input.input_ids"`). Fields not named keep the contract's annotation.
    """

    def __init__(self, cls: type, dtypes: Mapping[str, DtypeSpec], name: str = "") -> None:
        self.cls = cls
        self.name = name or f"{cls.__name__} policy"
        own: dict[str, DtypeSpec] = {}
        inner: dict[str, dict[str, DtypeSpec]] = {}
        for key, spec in dtypes.items():
            head, _, rest = key.partition(".")
            if rest:
                inner.setdefault(head, {})[rest] = spec
            else:
                own[key] = spec
        fields = {f.name: f for f in plan_for(cls).fields}
        self._plans = {key: _index_plan(cls, fields, key, spec) for key, spec in own.items()}
        self._nested: dict[str, IndexPolicy] = {}
        for head, sub in inner.items():
            f = fields.get(head)
            if f is None or f.kind != "phase":
                raise ValueError(f"{cls.__name__}.{head} is not a nested phase object; cannot set {sorted(sub)}")
            self._nested[head] = IndexPolicy(f.phase_cls, sub, f"{self.name}.{head}")

    def plans(self, cls: type) -> Mapping[str, FieldPlan]:
        """The replaced field plans (the hot path looks fields up here)."""
        return self._plans

    def nested(self, name: str) -> "IndexPolicy | None":
        """The policy of nested phase field `name`, if declared."""
        return self._nested.get(name)

    def dtypes(self) -> dict[str, tuple[str, ...]]:
        """Field -> allowed dtype names, nested fields dotted (for docs and mapping tables)."""
        out = {k: tuple(sorted(_NAMES[d] for d in p.dtypes)) for k, p in self._plans.items()}
        for head, sub in self._nested.items():
            out.update({f"{head}.{k}": v for k, v in sub.dtypes().items()})
        return out

    def __repr__(self) -> str:
        return f"IndexPolicy({self.cls.__name__}, {self.dtypes()})"


def _index_plan(cls: type, fields: Mapping[str, FieldPlan], key: str, spec: Any) -> FieldPlan:
    f = fields.get(key)
    if f is None:
        raise ValueError(f"{cls.__name__} has no field {key!r}; fields: {sorted(fields)}")
    if f.kind != "tensor" or not f.dtypes or not f.dtypes <= INDEX_DTYPES:
        raise ValueError(
            f"{cls.__name__}.{key} is not an index field (annotated {f.dtype_text or f.kind}); "
            "a policy may only choose between int32 and int64 for ids, positions, indices and counts"
        )
    allowed = frozenset(spec if isinstance(spec, tuple) else (spec,))
    if not allowed or not allowed <= INDEX_DTYPES:
        raise ValueError(f"{cls.__name__}.{key}: a policy allows only torch.int32 / torch.int64, got {spec!r}")
    text = " or ".join(_NAMES[d] for d in sorted(allowed, key=_NAMES.get))
    return dataclasses.replace(f, dtypes=allowed, dtype_text=text)
