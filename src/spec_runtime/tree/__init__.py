"""EAGLE-2 dynamic draft trees: multi-step expansion, tree layout, and tree verification.

Pure-torch reference, vectorized over the batch; Python loops run only over the draft depth
(``num_steps``) or the tree size (``num_draft``). Axis names follow DESIGN.md.

Flat score index (one number per draft candidate, per request)
----------------------------------------------------------------
Step 0 offers ``topk`` candidates (children of the root) with flat indices ``0 .. topk-1``.
Step ``i >= 1`` offers ``topk * topk`` candidates (``topk`` children of each of the ``topk``
frontier nodes chosen at step ``i-1``) with flat indices ``topk + (i-1)*topk**2 + j``, where
``j = branch * topk + c`` for child rank ``c`` of frontier branch ``branch``. So
``flat // topk - 1 - (i-1)*topk == branch`` and ``flat // topk == 0`` exactly for the root's children.

``parent_list`` (bs, topk*(num_steps-1)+1): entry 0 is -1 (the root); entries
``1 + (i-1)*topk + branch`` (``i >= 1``) hold the flat index of frontier node ``branch`` of step
``i-1``. The parent of candidate ``f`` is therefore ``parent_list[f // topk]`` (-1 = root).

Tree layout (DESIGN.md): node 0 is the root (the bonus token); node ``i >= 1`` is the candidate
``selected_index[i-1]``; ``selected_index`` is sorted ascending, so a parent precedes its children.

Modules: `frontier` (the expansion: `select_frontier`, `gather_branches`, `organize`), `layout`
(`build_tree`, `tree_layout`), `accept` (`verify_greedy`, `verify_tree_sampling`,
`verify_chain_rejection`, `simulated_accept`). Import the functions from this package.
"""

from .accept import (
    check_verify_shapes,
    simulated_accept,
    verify_chain_rejection,
    verify_greedy,
    verify_tree_sampling,
)
from .frontier import gather_branches, organize, select_frontier
from .layout import build_tree, check_build_tree_args, tree_layout

__all__ = [
    "select_frontier", "gather_branches", "organize", "build_tree", "check_build_tree_args", "tree_layout",
    "check_verify_shapes", "verify_greedy", "verify_tree_sampling", "verify_chain_rejection",
    "simulated_accept",
]
