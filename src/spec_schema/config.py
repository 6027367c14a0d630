"""Algorithms, their traits, and the validated configuration of a speculative-decoding setup."""

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

DTypeName = Literal["float32", "bfloat16", "float16"]

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class SpecAlgorithm(str, enum.Enum):
    """The speculative-decoding algorithms of the contract."""

    EAGLE = "EAGLE"
    EAGLE3 = "EAGLE3"
    STANDALONE = "STANDALONE"

    @property
    def traits(self) -> "AlgorithmTraits":
        """This algorithm's row of the traits table (`TRAITS`)."""
        return TRAITS[self]


Capture = Literal["none", "final", "aux"]
DraftSequence = Literal["shifted", "own"]


@dataclass(frozen=True)
class AlgorithmTraits:
    """What differs between algorithms, as data. Code asks this table instead of branching on names.

    Attributes:
        draft_reads_hidden: the draft consumes hidden states (decode and extend phases).
        target_capture: what the target captures in prefill and verify for the draft-extend phase:
            "none", "final" (its post-norm last hidden state), or "aux" (the residual stream entering
            a few layers, concatenated; EAGLE-3 with aux on, otherwise "final").
        shares_lm_head: the draft scores tokens with the target's lm_head unless it carries its own
            (an EAGLE-3 head always has its own, over its draft vocabulary).
        draft_vocab_map: how draft-vocabulary ids become target ids: "identity" or "d2t" offsets.
        hot_token_map: the draft may score a hot subset of the target vocabulary instead (FR-Spec,
            sglang's `--speculative-token-map`: the shared lm_head cut to those rows, draft ids mapped
            back as `d2t` offsets); the draft's `draft_vocab_size` is then the map's size.
        has_aux_layers: the algorithm may capture several target layers (EAGLE-3).
        draft_sequence: what the draft's KV holds. "shifted" (EAGLE heads): the pairs (token
            t_{j+1}, target hidden state j) at position j, so the draft never reads t_0 and its KV
            ends one token before the root. "own" (STANDALONE): the target's own tokens at their
            own positions, from t_0 through the root (see `draft_kv_lead`).
    """

    draft_reads_hidden: bool
    target_capture: Capture
    shares_lm_head: bool
    draft_vocab_map: Literal["identity", "d2t"]
    has_aux_layers: bool
    draft_sequence: DraftSequence
    hot_token_map: bool = False

    @property
    def draft_kv_lead(self) -> int:
        """How many positions the draft's KV runs ahead of the target's committed KV at each
        iteration's start: 1 for "own" (the draft has also read the root, the newest token, whose
        KV the target computes only in the next verify), 0 for "shifted". The draft's rows of a
        draft-extend sit at `seq_lens - num_accept_tokens + lead + j` and its draft steps at
        `seq_lens + lead + step - 1`."""
        return 1 if self.draft_sequence == "own" else 0


TRAITS: Mapping[SpecAlgorithm, AlgorithmTraits] = {
    SpecAlgorithm.EAGLE: AlgorithmTraits(
        draft_reads_hidden=True,
        target_capture="final",
        shares_lm_head=True,
        draft_vocab_map="identity",
        has_aux_layers=False,
        draft_sequence="shifted",
        hot_token_map=True,
    ),
    SpecAlgorithm.EAGLE3: AlgorithmTraits(
        draft_reads_hidden=True,
        target_capture="aux",
        shares_lm_head=False,
        draft_vocab_map="d2t",
        has_aux_layers=True,
        draft_sequence="shifted",
    ),
    SpecAlgorithm.STANDALONE: AlgorithmTraits(
        draft_reads_hidden=False,
        target_capture="none",
        shares_lm_head=False,
        draft_vocab_map="identity",
        has_aux_layers=False,
        draft_sequence="own",
    ),
}


def traits(algorithm: SpecAlgorithm | str) -> AlgorithmTraits:
    """The traits of one algorithm (accepts the enum or its name)."""
    return TRAITS[SpecAlgorithm(algorithm)]


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """The target layers an EAGLE-3 head reads when its config names none: 2, N//2 and N-3 (the
    EAGLE repo's, sglang's and vLLM's default); the first min(N, 3) layers of a target of fewer
    than 4 layers. The one place this default lives (the runtime's loader, the trainer and the
    tiny-model builder ask here)."""
    return (2, num_layers // 2, num_layers - 3) if num_layers >= 4 else tuple(range(min(num_layers, 3)))


class ModelDims(BaseModel):
    """The dimensions of one model that the contract depends on.

    For EAGLE-3 heads, `target_hidden_size` (when the head was trained on a target of another width),
    `draft_vocab_size`, `use_aux_hidden_state` and the aux layers (`aux_layer_ids` or
    `num_aux_hidden_states`) describe the head. Other models leave them unset.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    hidden_size: PositiveInt = Field(description="width of the model's residual stream")
    vocab_size: PositiveInt = Field(description="rows of the (input) embedding")
    dtype: DTypeName = Field("bfloat16", description="dtype of weights and hidden states")
    num_hidden_layers: Optional[PositiveInt] = Field(None, description="decoder layers, when known")
    target_hidden_size: Optional[PositiveInt] = Field(
        None, description="EAGLE-3 head: hidden size of the target it reads, when it differs"
    )
    draft_vocab_size: Optional[PositiveInt] = Field(
        None, description="EAGLE-3 head: size of the draft vocabulary its lm_head scores"
    )
    use_aux_hidden_state: bool = Field(True, description="EAGLE-3 head: reads concatenated aux layers")
    aux_layer_ids: Optional[tuple[int, ...]] = Field(
        None, description="EAGLE-3 head: target layers whose input residual stream is captured"
    )
    num_aux_hidden_states: Optional[PositiveInt] = Field(
        None, description="EAGLE-3 head: number of aux layers, when the ids are not given"
    )
    hc_mult: PositiveInt = Field(
        1,
        description="mHC hidden multiplier (DeepSeek-V4): the hidden stream this model hands across "
        "the target-draft boundary is hidden_size x hc_mult wide",
    )

    @model_validator(mode="after")
    def _consistent(self) -> "ModelDims":
        ids, n = self.aux_layer_ids, self.num_aux_hidden_states
        if ids is not None and n is not None and len(ids) != n:
            raise ValueError(
                f"aux_layer_ids {list(ids)} has {len(ids)} entries but num_aux_hidden_states is {n}"
            )
        if ids is not None and len(ids) == 0:
            raise ValueError("aux_layer_ids must not be empty")
        if self.draft_vocab_size is not None and self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"draft_vocab_size {self.draft_vocab_size} exceeds vocab_size {self.vocab_size}"
            )
        return self

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of this model's hidden states."""
        return _TORCH_DTYPES[self.dtype]

    @property
    def spec_hidden_size(self) -> int:
        """Width of the hidden stream that crosses the target-draft boundary: hidden_size x hc_mult."""
        return self.hidden_size * self.hc_mult

    @property
    def num_aux(self) -> int:
        """Aux layers an EAGLE-3 head reads: from the ids, else the count, else 3."""
        if self.aux_layer_ids is not None:
            return len(self.aux_layer_ids)
        return self.num_aux_hidden_states or 3

    @classmethod
    def from_hf_config(cls, cfg: Any, dtype: Optional[str | torch.dtype] = None) -> "ModelDims":
        """Read a transformers config object or a config.json dict (duck-typed).

        Reads `hidden_size`, `vocab_size`, `num_hidden_layers`, `torch_dtype`/`dtype`, and for
        EAGLE-3 heads `target_hidden_size`, `draft_vocab_size`, `num_aux_hidden_states` and
        `eagle_config.{eagle_aux_hidden_state_layer_ids, use_aux_hidden_state}`. `dtype` overrides
        the config's dtype (the dtype the model will run in). `hc_mult` is read only for the
        architectures whose engines widen the boundary stream by it (`HC_STREAM_ARCHITECTURES`).
        """
        d = _as_dict(cfg)
        eagle = d.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids") or d.get("eagle_aux_hidden_state_layer_ids")
        return cls(
            hidden_size=d["hidden_size"],
            vocab_size=d["vocab_size"],
            dtype=_dtype_name(dtype if dtype is not None else d.get("torch_dtype") or d.get("dtype")),
            num_hidden_layers=d.get("num_hidden_layers"),
            target_hidden_size=d.get("target_hidden_size"),
            draft_vocab_size=d.get("draft_vocab_size"),
            use_aux_hidden_state=bool(eagle.get("use_aux_hidden_state", True)),
            aux_layer_ids=tuple(ids) if ids else None,
            num_aux_hidden_states=d.get("num_aux_hidden_states"),
            hc_mult=_hc_mult(d),
        )


# sglang 0.5.23 srt/configs/model_config.py `resolve_spec_hidden_size`: DeepSeek-V4 and Qwen4-Exp carry
# the hc-flattened stream across the target->draft boundary; other hc models (HY V4) collapse it first.
# vLLM 0.33.0 v1/spec_decode/llm_base_proposer.py widens by hc_mult for DeepSeek-V4 configs only.
HC_STREAM_ARCHITECTURES = frozenset({
    "DeepseekV4ForCausalLM", "DeepseekV4ForCausalLMNextN", "DeepseekV4ForCausalLMDSpark",
    "Qwen4ExpForConditionalGeneration", "Qwen4ExpForCausalLMMTP",
})


def _hc_mult(d: Mapping[str, Any]) -> int:
    arch = (d.get("architectures") or [None])[0]
    mult = int(d.get("hc_mult") or 1)
    return mult if arch in HC_STREAM_ARCHITECTURES and mult > 1 else 1


def _as_dict(cfg: Any) -> dict[str, Any]:
    if isinstance(cfg, Mapping):
        return dict(cfg)
    if hasattr(cfg, "to_dict"):
        return dict(cfg.to_dict())
    return dict(vars(cfg))


def _dtype_name(dtype: Any) -> str:
    if dtype is None:
        return "bfloat16"
    if isinstance(dtype, torch.dtype):
        for name, value in _TORCH_DTYPES.items():
            if value == dtype:
                return name
        raise ValueError(f"unsupported dtype {dtype}; expected one of {sorted(_TORCH_DTYPES)}")
    name = str(dtype).removeprefix("torch.")
    return {"float": "float32", "half": "float16", "bf16": "bfloat16", "fp32": "float32"}.get(name, name)


def max_tree_nodes(num_steps: int, topk: int) -> int:
    """Largest useful tree (root included): the root, topk first-level nodes, topk^2 per later step."""
    return 1 + topk + (num_steps - 1) * topk * topk


def check_tree_shape(num_steps: int, topk: int, num_draft_tokens: int) -> None:
    """Raise ValueError unless the three numbers make a draft tree (SpecConfig's tree rule)."""
    n, k, s = num_draft_tokens, topk, num_steps
    if n < 2:
        raise ValueError(f"num_draft_tokens must be >= 2 (the root and one draft), got {n}")
    if k == 1 and n != s + 1:
        raise ValueError(
            f"topk 1 means a chain of num_steps + 1 = {s + 1} tokens, but num_draft_tokens is {n}"
        )
    limit = max_tree_nodes(s, k)
    if n > limit:
        raise ValueError(
            f"num_draft_tokens {n} exceeds the largest tree for num_steps {s} and topk {k}: "
            f"1 + topk + (num_steps - 1) * topk^2 = {limit}"
        )


class SpecConfig(BaseModel):
    """A speculative-decoding setup: the algorithm, both models' dims and the tree shape.

    `num_steps` is the draft depth, `topk` the branching factor, `num_draft_tokens` the tree size per
    request including the root. `topk == 1` means a chain of `num_steps + 1` nodes.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    algorithm: SpecAlgorithm
    target: ModelDims
    draft: ModelDims
    num_steps: PositiveInt = Field(description="draft depth: draft forward passes per iteration")
    topk: PositiveInt = Field(description="branching factor of the draft tree")
    num_draft_tokens: PositiveInt = Field(description="tree size per request, root included")

    @model_validator(mode="after")
    def _validate(self) -> "SpecConfig":
        self._check_tree()
        self._check_vocab()
        self._check_topk()
        self._check_aux()
        self._check_widths()
        return self

    def _check_tree(self) -> None:
        check_tree_shape(self.num_steps, self.topk, self.num_draft_tokens)

    def _check_vocab(self) -> None:
        t, d = self.target.vocab_size, self.draft.vocab_size
        if d != t:
            raise ValueError(
                f"{self.algorithm.value}: draft vocab_size {d} differs from the target's {t}; "
                "the draft must embed target token ids"
            )
        if self.target.draft_vocab_size is not None:
            raise ValueError("draft_vocab_size belongs to the draft (an EAGLE-3 head), not the target")
        if self.draft.draft_vocab_size is not None and not (self.traits.draft_vocab_map == "d2t"
                                                             or self.traits.hot_token_map):
            raise ValueError(
                f"{self.algorithm.value} drafts score the target vocabulary; draft_vocab_size "
                f"{self.draft.draft_vocab_size} is only valid for EAGLE3 (d2t) and EAGLE (a hot-token map)"
            )

    def _check_topk(self) -> None:
        # Every draft node keeps the topk best tokens of the draft's lm_head, which scores draft_vocab
        # of them (an EAGLE-3 head's draft_vocab_size, else the vocab_size): a top-k wider than that
        # has no candidates to fill it (torch.topk and both engines' draft steps fail on it).
        k, dv = self.topk, self.draft_vocab
        if k > dv:
            source = "draft_vocab_size" if self.draft.draft_vocab_size is not None else "vocab_size"
            raise ValueError(
                f"topk {k} exceeds the draft vocabulary of {dv} tokens (the draft's {source}): "
                f"a draft node has at most {dv} candidates"
            )

    def _check_aux(self) -> None:
        th = self.draft.target_hidden_size
        if th is not None and th != self.target.hidden_size:
            raise ValueError(
                f"{self.algorithm.value}: the draft head reads a target of hidden size {th} "
                f"(its target_hidden_size), but the target's hidden size is {self.target.hidden_size}"
            )
        ids, layers = self.draft.aux_layer_ids, self.target.num_hidden_layers
        if ids is None or layers is None or not self.traits.has_aux_layers:
            return
        bad = [i for i in ids if not 0 <= i < layers]
        if bad:
            raise ValueError(f"aux_layer_ids {bad} are outside the target's {layers} layers")

    def _check_widths(self) -> None:
        # Both engines size the draft's input from the *draft* config (sglang eagle_utils.
        # get_draft_input_from_target_hidden_dim; vLLM llm_base_proposer / llama_eagle3): a config
        # where that differs from what the target produces crashes them, so it is rejected here.
        alg, t, d = self.algorithm.value, self.target, self.draft
        if not self.traits.draft_reads_hidden:
            return
        if not self.use_aux:
            if t.spec_hidden_size != d.spec_hidden_size:
                raise ValueError(
                    f"{alg}{' (aux off)' if self.traits.has_aux_layers else ''}: the draft reads the "
                    f"target's hidden states of width {t.spec_hidden_size} as its own width "
                    f"{d.spec_hidden_size} (hidden_size x hc_mult); sglang and vLLM size that input "
                    "from the draft config, so the draft's width must equal the target's"
                )
            return
        if d.target_hidden_size is None and d.hidden_size != t.hidden_size:
            raise ValueError(
                f"{alg}: the head (hidden size {d.hidden_size}) has no target_hidden_size, so sglang "
                f"and vLLM size its fc input as {d.hidden_size} x {self.num_aux} aux layers, but the "
                f"target captures {t.hidden_size} x {self.num_aux}; set target_hidden_size={t.hidden_size}"
            )

    @property
    def traits(self) -> AlgorithmTraits:
        """The algorithm's row of the traits table."""
        return TRAITS[self.algorithm]

    @property
    def vocab(self) -> int:
        """Target vocabulary size."""
        return self.target.vocab_size

    @property
    def draft_vocab(self) -> int:
        """Vocabulary the draft's lm_head scores (an EAGLE-3 head's may be smaller)."""
        return self.draft.draft_vocab_size or self.draft.vocab_size

    @property
    def use_aux(self) -> bool:
        """Whether the target captures concatenated aux layers (EAGLE-3 with aux on)."""
        return self.traits.has_aux_layers and self.draft.use_aux_hidden_state

    @property
    def num_aux(self) -> int:
        """Aux layers captured by the target (1 when aux capture is off)."""
        return self.draft.num_aux if self.use_aux else 1

    @property
    def target_capture(self) -> Capture:
        """What the target captures in prefill and verify: "none", "final" or "aux"."""
        if not self.traits.draft_reads_hidden:
            return "none"
        return "aux" if self.use_aux else "final"

    def aux_layer_ids(self) -> tuple[int, ...]:
        """Target layers whose input residual stream EAGLE-3 captures: the config's, else
        `default_aux_layer_ids`."""
        if self.draft.aux_layer_ids is not None:
            return self.draft.aux_layer_ids
        n = self.target.num_hidden_layers
        if n is None:
            raise ValueError("target num_hidden_layers is needed to place the default aux layers")
        return default_aux_layer_ids(n)
