"""Engines onto Ray nodes: consecutive engines packed on one node with Ray placement groups,
and the engine -> node map `paraflex serve` prints and /health reports.

Place in the data flow: `paraflex.serving.ray_startup.start_cluster` calls `reserve_nodes`
before it creates the engine actors, gives each actor its bundle (`EngineNodes.strategy`), and
hands the `EngineNodes` to `RayEngines`, which releases the groups when it stops.

Which engines share a node: the placement's `params.nodes` (engines per node, from the
config's `cluster.nodes`: the planner placed replicas inside those nodes and the simulator
charged their hops), or else the Ray cluster's own nodes: engines 0.. fill the node with the
most room first, then the next, so the consecutive engines a replica's stages run on (the
planner's windows) share a node except where one node ends. Each group of engines is one
STRICT_PACK placement group (one bundle per engine), so Ray puts the whole group on a single
node; two groups land on two nodes when no node holds both. Engines take one GPU (and one
CPU) each on GPUs, or an equal CPU share sized so that every group fits a node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from paraflex.errors import UserError

READY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class NodeRoom:
    """One alive Ray node's resources."""

    node_id: str
    ip: str
    cpus: float
    gpus: float


def alive_nodes() -> list[NodeRoom]:
    return [NodeRoom(n["NodeID"], n["NodeManagerAddress"], n["Resources"].get("CPU", 0.0),
                     n["Resources"].get("GPU", 0.0)) for n in ray.nodes() if n["Alive"]]


def engines_fitting(node: NodeRoom, cpu_share: float, use_gpu: bool) -> int:
    """How many engines of `cpu_share` CPUs (and one GPU each on GPUs) the node holds."""
    by_cpu = math.floor(node.cpus / cpu_share + 1e-9) if cpu_share > 0 else 10**9
    return min(by_cpu, int(node.gpus)) if use_gpu else by_cpu


def _pack(sizes: list[int], rooms: list[int]) -> bool:
    """Whether groups of these sizes fit these node rooms, one node per group (first fit, largest first)."""
    free = sorted(rooms, reverse=True)
    for size in sorted(sizes, reverse=True):
        for k, room in enumerate(free):
            if room >= size:
                free[k] -= size
                break
        else:
            return False
    return True


def _contiguous(num_engines: int, rooms: list[int]) -> list[list[int]]:
    """Engines 0.. in order over the nodes with the most room first."""
    groups, e = [], 0
    for room in sorted(rooms, reverse=True):
        if e >= num_engines:
            break
        take = min(room, num_engines - e)
        if take:
            groups.append(list(range(e, e + take)))
            e += take
    return groups if e == num_engines else []


def plan_groups(num_engines: int, planned: list[int] | None, nodes: list[NodeRoom],
                use_gpu: bool) -> tuple[float, list[list[int]]]:
    """(CPU share per engine, groups of engine ids each to share one node): the planned nodes
    (engines per node) when given, else contiguous engines over the Ray nodes; the largest CPU
    share up to 1 at which they fit. UserError naming the fix when they cannot fit."""
    total_cpus = sum(n.cpus for n in nodes)
    if use_gpu:
        shares = [1.0]
    else:
        top = min(1.0, total_cpus / num_engines)
        shares = sorted({top} | {n.cpus / k for n in nodes for k in range(1, num_engines + 1) if n.cpus / k < top},
                        reverse=True)
    for share in shares:
        share = math.floor(share * 1000) / 1000  # (shares must add up within a node)
        if share <= 0:
            break
        rooms = [engines_fitting(n, share, use_gpu) for n in nodes]
        if planned:
            if _pack(planned, rooms):
                return share, [list(range(sum(planned[:k]), sum(planned[:k + 1]))) for k in range(len(planned))]
        else:
            groups = _contiguous(num_engines, rooms)
            if groups:
                return share, groups
    unit = "GPU" if use_gpu else "CPU"
    held = [engines_fitting(n, 1.0 if use_gpu else 0.001, use_gpu) for n in nodes]
    if planned:
        raise UserError(f"the placement's nodes {planned} (engines per node, cluster.nodes) do not fit the Ray "
                        f"cluster's {len(nodes)} node(s) ({', '.join(f'{n.gpus if use_gpu else n.cpus:g} {unit}' for n in nodes)}); "
                        "set cluster.nodes to the engines each Ray node holds and plan again, or add nodes")
    raise UserError(f"{num_engines} engines need {num_engines} {unit}(s) in the Ray cluster; its nodes hold "
                    f"{sum(held)}; add nodes or use fewer engines")


class EngineNodes:
    """The placement groups holding the engines, and which node each engine runs on."""

    def __init__(self, groups: list[list[int]], pgs: list, cpu_share: float, use_gpu: bool) -> None:
        self.groups = groups
        self.pgs = pgs
        self.cpu_share = cpu_share
        self.use_gpu = use_gpu
        self._bundle = {e: (pg, k) for group, pg in zip(groups, pgs) for k, e in enumerate(group)}
        self.node_of: dict[int, dict] = {}  # engine -> {"node_id", "ip"} (`locate`)

    def strategy(self, engine: int) -> PlacementGroupSchedulingStrategy:
        pg, k = self._bundle[engine]
        return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=k)

    def locate(self) -> dict[int, dict]:
        """Which node holds each engine's bundle (read from Ray once the groups are ready)."""
        ips = {n.node_id: n.ip for n in alive_nodes()}
        for group, pg in zip(self.groups, self.pgs):
            bundles = ray.util.placement_group_table(pg)["bundles_to_node_id"]
            for k, e in enumerate(group):
                self.node_of[e] = {"node_id": bundles[k], "ip": ips.get(bundles[k], "?")}
        return self.node_of

    def describe(self) -> str:
        """One line: each node's engines, e.g. `0-1 on node 3f2a1c9e (10.0.0.1); 2-3 on ...`."""
        by_node: dict[str, list[int]] = {}
        for e in sorted(self.node_of):
            by_node.setdefault(self.node_of[e]["node_id"], []).append(e)
        return "; ".join(f"{_span(es)} on node {node[:8]} ({self.node_of[es[0]]['ip']})" for node, es in by_node.items())

    def release(self) -> None:
        for pg in self.pgs:
            remove_placement_group(pg)
        self.pgs = []


def _span(engines: list[int]) -> str:
    contiguous = engines == list(range(engines[0], engines[-1] + 1))
    return f"{engines[0]}-{engines[-1]}" if contiguous and len(engines) > 1 else ",".join(map(str, engines))


def reserve_nodes(num_engines: int, planned: list[int] | None, use_gpu: bool,
                  timeout_s: float = READY_TIMEOUT_S) -> EngineNodes:
    """One STRICT_PACK placement group per group of engines (`plan_groups`), ready."""
    share, groups = plan_groups(num_engines, planned, alive_nodes(), use_gpu)
    bundle = {"CPU": share, **({"GPU": 1} if use_gpu else {})}
    pgs = [placement_group([dict(bundle) for _ in g], strategy="STRICT_PACK", name=f"paraflex-engines-{g[0]}")
           for g in groups]
    nodes = EngineNodes(groups, pgs, share, use_gpu)
    try:
        ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=timeout_s)
        if len(ready) < len(pgs):
            raise UserError(f"Ray could not reserve room for the engine groups {[_span(g) for g in groups]} "
                            f"({bundle} per engine, one node per group) within {timeout_s:.0f} s: the nodes are "
                            "busy (other actors hold their CPUs/GPUs; `ray status`) or too small")
        nodes.locate()
    except BaseException:
        nodes.release()
        raise
    return nodes
