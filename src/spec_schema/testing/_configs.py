"""Config and tree strategies of `spec_schema.testing.strategies` (the public module, which documents
them): `example_config`, `spec_configs`, `tree_parents`, `tree_arrays`, and the constants the phase
and corruption strategies share.
"""

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional, Union

from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from .. import ModelDims, SpecAlgorithm, SpecConfig
from ..config import max_tree_nodes

HISTORICAL_HIDDEN_PAIRS: Mapping[str, tuple[int, int]] = {
    "target 4096 / draft 2048": (4096, 2048),
    "target 4480 / draft 2048": (4480, 2048),
}
"""(target, draft) hidden sizes of the historical width bugs; `spec_configs(mismatched=True)` draws
one of them about half the time (the other half: small random pairs)."""

REAL_VOCAB_SIZES: tuple[int, ...] = (32000, 128256, 151936)
SMALL_VOCAB = 512
"""`draft_probs` (the only vocab-sized tensors) are generated only up to this vocabulary."""

DTYPE_NAMES: tuple[str, ...] = ("float32", "bfloat16", "float16")
CORRUPTION_KINDS: tuple[str, ...] = ("width", "dtype", "rank", "batch", "presence")
"""Kinds of `corrupted_inputs`: a config-known axis resized, a wrong dtype, an axis added or dropped,
the batch axis (bs / num_accepted) of one field resized, a hidden state None that the width rule
requires or a tensor where it requires None (STANDALONE)."""

_BATCH_AXES = frozenset({"bs", "num_accepted"})
_MAX_SEQ = 4096

ConfigLike = Union[SpecConfig, SearchStrategy]
IntLike = Union[int, SearchStrategy]

BATCH_SIZES = st.integers(0, 4)
"""Default `bs` of `phase_fields`/`phase_inputs`: idle (0) and live batches."""
_CORRUPT_SIZES = st.integers(0, 3)
_LIVE_SIZES = st.integers(1, 3)


# ---------------------------------------------------------------------------------------------
# configs


def example_config(
    algorithm: Union[SpecAlgorithm, str] = SpecAlgorithm.EAGLE,
    *,
    target_hidden: int = 64,
    draft_hidden: Optional[int] = None,
    vocab: int = 128,
    num_steps: int = 3,
    topk: int = 2,
    num_draft_tokens: int = 6,
    target_dtype: str = "float32",
    draft_dtype: str = "bfloat16",
    num_aux: Optional[int] = 3,
    draft_vocab: Optional[int] = None,
) -> SpecConfig:
    """A small deterministic config with mismatched widths and dtypes (target 64 f32, draft 32 bf16).

    `draft_hidden` None: 32, except for EAGLE, whose head must be as wide as its target (SpecConfig
    rejects anything else, as the engines would). EAGLE-3 heads get `target_hidden_size`,
    `num_aux_hidden_states = num_aux` (None: the default of 3) and a draft vocabulary of
    `draft_vocab` (default: half the vocabulary).
    """
    algorithm = SpecAlgorithm(algorithm)
    if draft_hidden is None:
        draft_hidden = target_hidden if algorithm is SpecAlgorithm.EAGLE else 32
    head: dict[str, Any] = {}
    if algorithm is SpecAlgorithm.EAGLE3:
        head = {"draft_vocab_size": draft_vocab or max(1, vocab // 2), "num_aux_hidden_states": num_aux,
                "target_hidden_size": target_hidden}
    return SpecConfig(
        algorithm=algorithm,
        target=ModelDims(
            hidden_size=target_hidden, vocab_size=vocab, dtype=target_dtype, num_hidden_layers=8
        ),
        draft=ModelDims(
            hidden_size=draft_hidden, vocab_size=vocab, dtype=draft_dtype, num_hidden_layers=1, **head
        ),
        num_steps=num_steps,
        topk=topk,
        num_draft_tokens=num_draft_tokens,
    )


def _hidden_pairs(mismatched: bool) -> SearchStrategy:
    small = st.integers(2, 12).map(lambda k: 8 * k)
    if not mismatched:
        named = st.sampled_from(sorted({t for t, _ in HISTORICAL_HIDDEN_PAIRS.values()}))
        return st.one_of(named, small).map(lambda h: (h, h))
    pairs = st.tuples(small, small).filter(lambda p: p[0] != p[1])
    return st.one_of(st.sampled_from(list(HISTORICAL_HIDDEN_PAIRS.values())), pairs)


@st.composite
def spec_configs(
    draw: Any,
    algorithms: Iterable[Union[SpecAlgorithm, str]] = tuple(SpecAlgorithm),
    mismatched: bool = True,
) -> SpecConfig:
    """Valid `SpecConfig`s of the given algorithms.

    `mismatched=True`: target and draft hidden sizes differ (4096/2048, 4480/2048, or small
    multiples of 8 in 16..96) wherever the engines allow it: an EAGLE head, and an EAGLE-3 head with
    aux capture off, read the target's stream as their own width, so theirs are equal (see
    `SpecConfig`); `False`: they are equal. EAGLE-3 heads read 2-4 aux layers (given as
    `aux_layer_ids`, `num_aux_hidden_states`, both, or neither: the default 3), carry
    `target_hidden_size` when their width differs (sometimes when it does not), always have a draft
    vocabulary smaller than the target's (and at least topk), and have aux capture on or off. num_steps 1-5, topk 1-4, num_draft_tokens valid for both; each model's dtype
    is drawn on its own from float32/bfloat16/float16.
    """
    algorithm = SpecAlgorithm(draw(st.sampled_from([SpecAlgorithm(a) for a in algorithms])))
    target_h, draft_h = draw(_hidden_pairs(mismatched))
    vocab = draw(st.one_of(st.integers(16, 256), st.sampled_from(REAL_VOCAB_SIZES)))
    num_steps, topk = draw(st.integers(1, 5)), draw(st.integers(1, 4))
    if topk == 1:
        num_draft = num_steps + 1
    else:
        num_draft = draw(st.integers(2, min(max_tree_nodes(num_steps, topk), 16)))
    layers = draw(st.none() | st.integers(4, 48))
    head: dict[str, Any] = {}
    if algorithm is SpecAlgorithm.EAGLE3:
        num_aux = draw(st.integers(2, 4))
        given = draw(st.sampled_from(["ids", "count", "both", "default"]))
        if given == "default":
            num_aux = 3
        if given in ("ids", "both"):
            layers = (
                layers if layers is not None and layers >= num_aux else draw(st.integers(max(4, num_aux), 48))
            )
            ids = draw(st.lists(st.integers(0, layers - 1), min_size=num_aux, max_size=num_aux, unique=True))
            head["aux_layer_ids"] = tuple(sorted(ids))
        if given in ("count", "both"):
            head["num_aux_hidden_states"] = num_aux
        head["use_aux_hidden_state"] = draw(st.booleans())
        head["draft_vocab_size"] = draw(st.integers(topk, vocab - 1))  # topk <= the draft vocabulary
        if target_h != draft_h or draw(st.booleans()):
            head["target_hidden_size"] = target_h
    if algorithm is SpecAlgorithm.EAGLE or head.get("use_aux_hidden_state") is False:
        draft_h = target_h
    return SpecConfig(
        algorithm=algorithm,
        target=ModelDims(
            hidden_size=target_h,
            vocab_size=vocab,
            dtype=draw(st.sampled_from(DTYPE_NAMES)),
            num_hidden_layers=layers,
        ),
        draft=ModelDims(
            hidden_size=draft_h,
            vocab_size=vocab,
            dtype=draw(st.sampled_from(DTYPE_NAMES)),
            num_hidden_layers=draw(st.none() | st.integers(1, 2)),
            **head,
        ),
        num_steps=num_steps,
        topk=topk,
        num_draft_tokens=num_draft,
    )


# ---------------------------------------------------------------------------------------------
# trees


@st.composite
def tree_parents(draw: Any, num_draft: int, num_steps: int, topk: int) -> list[int]:
    """A random draft tree as a parent list: node 0 is the root (parent -1), node i's parent is < i,
    no node is deeper than `num_steps` and none has more than `topk` children."""
    parents, depth, children = [-1], [0], [0]
    for i in range(1, num_draft):
        free = [p for p in range(i) if depth[p] < num_steps and children[p] < topk]
        p = draw(st.sampled_from(free))
        parents.append(p)
        depth.append(depth[p] + 1)
        children.append(0)
        children[p] += 1
    return parents


def tree_arrays(parents: Sequence[int]) -> dict[str, list[Any]]:
    """The layout of DESIGN.md for one request's tree: `depth`, `mask` (node i attends j: j is i or an
    ancestor), `next_token` (first child or -1) and `next_sibling` (next child of the parent or -1)."""
    n = len(parents)
    depth = [0] * n
    mask = [[False] * n for _ in range(n)]
    next_token, next_sibling = [-1] * n, [-1] * n
    for i in range(n):
        j = i
        while j != -1:
            mask[i][j] = True
            j = parents[j]
        if i:
            p = parents[i]
            depth[i] = depth[p] + 1
            if next_token[p] == -1:
                next_token[p] = i
            else:
                c = next_token[p]
                while next_sibling[c] != -1:
                    c = next_sibling[c]
                next_sibling[c] = i
    return {"depth": depth, "mask": mask, "next_token": next_token, "next_sibling": next_sibling}
