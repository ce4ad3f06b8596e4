"""Draft trees: several candidate continuations of one request, verified in one target pass.

A chain of drafts stops paying at its first wrong guess. A speculator that can name a few likely candidates
per position (Medusa's heads: each head's top-k tokens) does better with a **tree** of them (Medusa's "tree
attention", Cai et al. 2024; SpecInfer, Miao et al. 2024): the target scores every node in one pass, each node
attending only to the request's tokens and its own ancestors, and verification walks down the tree from the
request's last token, taking at each level the child the target accepts.

A tree of ``n`` nodes is given as ``parents``: for node ``j`` (in the order its tokens are drafted), the index of
its parent node, or -1 when its parent is the request's last token (the root). Parents come before their
children, and the children of one node hold distinct tokens. A chain is the tree ``[-1, 0, 1, ...]``.

The shape of a tree is configured as vLLM's ``speculative_token_tree``: each node is the path of candidate
ranks that leads to it from the root, ``[(0,), (1,), (0, 0)]`` being the top-1 and top-2 candidates for the
next token and the top-1 candidate after the top-1 one. How a step lays a tree out (KV slots, rotary
positions, the attention mask) is ``tokenmill.step_batch``'s; how a tree is accepted is
``tokenmill.speculative.rejection_sampler``'s; which accepted tokens keep their KV is :func:`num_in_place`.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence

__all__ = [
    "MAX_TREE_NODES",
    "TokenTree",
    "accepted_nodes",
    "check_parents",
    "chain_prefix",
    "depths",
    "is_chain",
    "num_in_place",
    "parse_token_tree",
    "path",
    "tree_parents",
]

#: The most nodes one tree may have (a step's attention mask holds one row of this many per tree token).
MAX_TREE_NODES = 64

#: A tree's shape: each node as the path of candidate ranks from the root, parents before children.
TokenTree = tuple[tuple[int, ...], ...]


def parse_token_tree(spec: str | Sequence[Sequence[int]]) -> TokenTree:
    """vLLM's ``speculative_token_tree`` (a string such as ``"[(0,), (1,), (0, 0)]"``, or the list itself) as a
    tuple of node paths. Raises ``ValueError`` saying what is wrong: not a list of tuples of non-negative
    integers, an empty or repeated path, a node listed before its parent, more than ``MAX_TREE_NODES``."""
    if isinstance(spec, str):
        try:
            spec = ast.literal_eval(spec)
        except (ValueError, SyntaxError):
            raise ValueError(f"speculative_token_tree must be a list of tuples such as '[(0,), (1,), (0, 0)]', "
                             f"got {spec!r}") from None  # fmt: skip
    if not isinstance(spec, list | tuple) or not spec:
        raise ValueError(f"speculative_token_tree must be a non-empty list of node paths, got {spec!r}")
    nodes: list[tuple[int, ...]] = []
    seen: set[tuple[int, ...]] = set()
    for node in spec:
        if (
            not isinstance(node, list | tuple)
            or not node
            or not all(isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0 for rank in node)
        ):
            raise ValueError(f"speculative_token_tree: each node is a non-empty tuple of candidate ranks (integers "
                             f">= 0) from the root, such as (0, 1); got {node!r}")  # fmt: skip
        path_ = tuple(node)
        if path_ in seen:
            raise ValueError(f"speculative_token_tree lists node {path_} twice")
        if len(path_) > 1 and path_[:-1] not in seen:
            raise ValueError(f"speculative_token_tree lists node {path_} before its parent {path_[:-1]}: list each "
                             "node after the one it extends")  # fmt: skip
        seen.add(path_)
        nodes.append(path_)
    if len(nodes) > MAX_TREE_NODES:
        raise ValueError(f"speculative_token_tree has {len(nodes)} nodes; at most {MAX_TREE_NODES} are supported")
    return tuple(nodes)


def tree_parents(tree: TokenTree) -> list[int]:
    """Each node's parent index (-1: the root) for a tree given as node paths."""
    index = {node: j for j, node in enumerate(tree)}
    return [index[node[:-1]] if len(node) > 1 else -1 for node in tree]


def check_parents(parents: Sequence[int], token_ids: Sequence[int]) -> None:
    """Raise ``ValueError`` unless ``parents`` describes a tree over ``token_ids`` as this module defines it."""
    if len(parents) != len(token_ids):
        raise ValueError(f"{len(parents)} parents for {len(token_ids)} draft tokens")
    if len(parents) > MAX_TREE_NODES:
        raise ValueError(f"a draft tree has at most {MAX_TREE_NODES} nodes, got {len(parents)}")
    children: set[tuple[int, int]] = set()
    for j, (parent, token) in enumerate(zip(parents, token_ids, strict=True)):
        if not -1 <= parent < j:
            raise ValueError(f"draft {j}'s parent is {parent}: it must be -1 (the request's last token) or an "
                             "earlier draft")  # fmt: skip
        if (parent, token) in children:
            raise ValueError(f"draft {j} repeats token {token} under the same parent ({parent})")
        children.add((parent, token))


def is_chain(parents: Sequence[int]) -> bool:
    return all(parent == j - 1 for j, parent in enumerate(parents))


def chain_prefix(parents: Sequence[int]) -> int:
    """How many leading nodes form a chain from the root (node j's parent is j - 1)."""
    count = 0
    while count < len(parents) and parents[count] == count - 1:
        count += 1
    return count


def depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth: 1 for a child of the root."""
    result: list[int] = []
    for parent in parents:
        result.append(1 if parent < 0 else result[parent] + 1)
    return result


def path(parents: Sequence[int], node: int) -> list[int]:
    """The nodes from the root's child down to ``node``, inclusive; empty for the root (-1)."""
    nodes: list[int] = []
    while node >= 0:
        nodes.append(node)
        node = parents[node]
    return nodes[::-1]


def accepted_nodes(parents: Sequence[int], token_ids: Sequence[int], accepted: Sequence[int]) -> list[int]:
    """The nodes a verification accepted, given the accepted tokens (the verified tokens less the target's
    last): the unique path whose tokens they are (siblings hold distinct tokens)."""
    nodes: list[int] = []
    current = -1
    for token in accepted:
        current = next(j for j in range(len(parents)) if parents[j] == current and token_ids[j] == token)
        nodes.append(current)
    return nodes


def num_in_place(nodes: Sequence[int]) -> int:
    """How many of the accepted ``nodes`` (a path from the root) had their KV written where the accepted
    tokens belong: node ``j`` is written ``j + 1`` slots after the root, so the first ``l`` keep theirs when
    they are nodes ``0 .. l-1``. The rest are recomputed in the next step, like an unfinished prompt chunk."""
    count = 0
    while count < len(nodes) and nodes[count] == count:
        count += 1
    return count
