"""Which node each engine sits on, and the link a pipeline hop between two engines takes.

Place in the data flow: `ClusterConfig.topology()` (paraflex/config/cluster.py) builds it from
`cluster.nodes` and the two interconnects (`interconnect_*` between engines of one node,
`node_interconnect_*` between nodes). The planner reads `node_of` (through
`Problem.node_of`) to prefer replica windows whose consecutive stages share a node; the
simulator charges every hop with `hop_time(src, dst, nbytes)` and every token message back to
the first stage with `link(last, first).latency_s`; `paraflex serve` packs each node's engines
onto one Ray node (paraflex/serving/ray_nodes.py). Engines are numbered node by node: node 0
holds engines 0..k0-1, node 1 the next k1, and so on. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paraflex.costs.interconnect import Interconnect


def nodes_of(engines_per_node: tuple[int, ...]) -> tuple[int, ...]:
    """Engine -> node index, engines numbered node by node."""
    return tuple(node for node, k in enumerate(engines_per_node) for _ in range(k))


def cross_node_hops(node_of, engines: list[int]) -> int:
    """Hops of a replica (its engines in stage order) that cross nodes."""
    return sum(node_of[a] != node_of[b] for a, b in zip(engines, engines[1:]))


@dataclass(frozen=True)
class Topology:
    """Engines grouped into nodes, with the link inside a node and the link between nodes."""

    engines_per_node: tuple[int, ...]
    intra: Interconnect  # between two engines of one node
    inter: Interconnect  # between engines of different nodes
    node_of: tuple[int, ...] = field(init=False, repr=False, compare=False)  # engine -> node

    def __post_init__(self) -> None:
        if not self.engines_per_node or min(self.engines_per_node) < 1:
            raise ValueError(f"every node needs at least one engine: {self.engines_per_node}")
        object.__setattr__(self, "node_of", nodes_of(self.engines_per_node))

    @classmethod
    def one_node(cls, num_engines: int, link: Interconnect) -> "Topology":
        return cls((num_engines,), link, link)

    @property
    def num_engines(self) -> int:
        return len(self.node_of)

    @property
    def num_nodes(self) -> int:
        return len(self.engines_per_node)

    def node_engines(self) -> list[list[int]]:
        """The engine ids of each node, in order."""
        out: list[list[int]] = [[] for _ in self.engines_per_node]
        for e, node in enumerate(self.node_of):
            out[node].append(e)
        return out

    def link(self, src: int, dst: int) -> Interconnect:
        return self.intra if self.node_of[src] == self.node_of[dst] else self.inter

    def hop_time(self, src: int, dst: int, nbytes: int) -> float:
        """Seconds to move `nbytes` of hidden state from engine `src` to engine `dst`."""
        return self.link(src, dst).transfer_time(nbytes)

    def cross_node_hops(self, engines: list[int]) -> int:
        return cross_node_hops(self.node_of, engines)
