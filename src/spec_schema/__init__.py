"""spec_schema: the typed contract of speculative decoding.

One frozen dataclass per phase (`DraftInput`, `VerifyInput`, `VerifyOutput`, `DraftExtendInput`;
the ragged chain form `ChainVerifyInput`, `ChainVerifyOutput`)
with jaxtyping axes; one width rule (`hidden_width`, `*.hidden_size_for`, `*.dtype_for`); strict
checking at construction and at `@boundary` functions when SPEC_STRICT is 1 or 2, and nothing at all
when it is unset. Depends on torch, jaxtyping, beartype and pydantic only.
"""

from . import _strict
from ._contract import (
    BOUNDARY_CALLS,
    boundary,
    check,
    check_merge,
    reference_checker,
    standing_aside,
    view_of,
)
from .chains import CHAIN_CLASSES, ChainVerifyInput, ChainVerifyOutput
from .config import (
    TRAITS,
    AlgorithmTraits,
    ModelDims,
    SpecAlgorithm,
    SpecConfig,
    default_aux_layer_ids,
    max_tree_nodes,
    traits,
)
from .errors import SpecContractError
from .model_dirs import spec_config_from_model_dirs
from .phases import DraftExtendInput, DraftInput, HiddenFloat, VerifyInput, VerifyOutput
from .policy import IndexPolicy
from .widths import Width, aux_layer_width, extend_width, hidden_width

STRICT_LEVEL: int = _strict.LEVEL
"""The strict level read from SPEC_STRICT at import: 0, 1 or 2."""

PHASE_CLASSES = (DraftInput, VerifyInput, VerifyOutput, DraftExtendInput)

__all__ = [
    "STRICT_LEVEL",
    "PHASE_CLASSES",
    "SpecAlgorithm",
    "AlgorithmTraits",
    "TRAITS",
    "traits",
    "ModelDims",
    "SpecConfig",
    "spec_config_from_model_dirs",
    "default_aux_layer_ids",
    "max_tree_nodes",
    "Width",
    "extend_width",
    "aux_layer_width",
    "hidden_width",
    "DraftInput",
    "VerifyInput",
    "VerifyOutput",
    "DraftExtendInput",
    "HiddenFloat",
    "CHAIN_CLASSES",
    "ChainVerifyInput",
    "ChainVerifyOutput",
    "SpecContractError",
    "boundary",
    "BOUNDARY_CALLS",
    "check",
    "check_merge",
    "view_of",
    "IndexPolicy",
    "reference_checker",
    "standing_aside",
]
__version__ = "0.1.0"
