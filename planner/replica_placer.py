"""Where one replica goes (paper Alg. 2's inner step): each candidate start engine scored by
Phi* of the partial placement, the best start chosen, and the local search that polishes a plan.

Place in the data flow: `placement_optimizer.optimize` (Alg. 1 + Alg. 2) asks a `ReplicaPlacer`
for every replica's start engine and to polish a plan; the MILP's tests compare against it.
Phi* of a partial placement is the first DRF water level (`water_levels`: min over used
engines of C_e / n_e), so numpy scores all starts of a replica at once, the engines outside
its window through a sliding minimum over the doubled engine ring. On a cluster of several
nodes (`Problem.node_of`), among the starts of equal Phi* the one whose stages cross the
fewest node boundaries wins, so consecutive stages share a node where memory allows. With
`Problem.balance_compute`, `even_out` then swaps replicas of equal stage count where that evens
the engines' expected compute load without lowering Phi* (docs/plan.md, "Compute balance").
"""

from __future__ import annotations

from itertools import islice

import numpy as np

from paraflex.planner.problem import Problem

_TIE = 1e-9
_MAX_PAIRS = 256  # pair moves (swaps) tried per polish (even_out) round: bounds both on dense engines


def sliding_min(values: np.ndarray, width: int) -> np.ndarray:
    """out[x] = min(values[x : x + width]) for every x with a full window (van Herk/Gil-Werman)."""
    n = len(values)
    blocks = -(-n // width)
    padded = np.full(blocks * width, np.inf)
    padded[:n] = values
    grid = padded.reshape(blocks, width)
    prefix = np.minimum.accumulate(grid, axis=1).ravel()
    suffix = np.minimum.accumulate(grid[:, ::-1], axis=1)[:, ::-1].ravel()
    x = np.arange(n - width + 1)
    return np.minimum(suffix[x], prefix[x + width - 1])


class ReplicaPlacer:
    """Engine state (free capacity, stage counts) and the scored placement of one replica."""

    def __init__(self, problem: Problem):
        self.n = problem.num_engines
        self.ring = problem.ring
        self.kappa = float(problem.kappa_bytes)
        self._windows: dict[int, np.ndarray] = {}
        self.node_of = None if problem.node_of is None else np.asarray(problem.node_of)
        self._crossings: dict[int, np.ndarray] = {}
        self.stage_cap: int | None = None  # fill phase: no engine may hold more stages than this

    def windows(self, s: int) -> np.ndarray:
        """Row p = engines of a replica starting at p (all starts, P1)."""
        if s not in self._windows:
            starts = np.arange(self.n if self.ring else self.n - s + 1)
            self._windows[s] = (starts[:, None] + np.arange(s)[None, :]) % self.n
        return self._windows[s]

    def crossings(self, s: int) -> np.ndarray:
        """Row p = hops of a replica starting at p that cross nodes (zeros on one node)."""
        if s not in self._crossings:
            if self.node_of is None:
                self._crossings[s] = np.zeros(len(self.windows(s)), dtype=int)
            else:
                nodes = self.node_of[self.windows(s)]
                self._crossings[s] = (nodes[:, 1:] != nodes[:, :-1]).sum(axis=1)
        return self._crossings[s]

    def scores(self, cap: np.ndarray, cnt: np.ndarray, taken: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """Phi* after adding one replica at each start (row of `windows`); -inf where (4) breaks."""
        s = len(weights)
        idx = self.windows(s)
        inside = ((cap[idx] - weights[None, :]) / (cnt[idx] + 1)).min(axis=1)
        if s < self.n:  # engines outside window p are values[p + s : p + n] of the doubled ring
            level = water_levels(cap, cnt)
            outside = sliding_min(np.concatenate([level, level]), self.n - s)[idx[:, 0] + s]
            phi = np.minimum(inside, outside)
        else:
            phi = inside
        phi[taken[idx].any(axis=1)] = -np.inf
        if self.stage_cap is not None:
            phi[(cnt[idx] >= self.stage_cap).any(axis=1)] = -np.inf
        return phi

    def best_start(self, cap: np.ndarray, cnt: np.ndarray, taken: np.ndarray, weights: np.ndarray) -> tuple[int, float]:
        """Start engine maximising Phi* for one more replica; ties -> fewest hops between nodes,
        then lowest start. (-1, -inf) if none."""
        phi = self.scores(cap, cnt, taken, weights)
        best = phi.max()
        if not np.isfinite(best):
            return -1, -np.inf
        tied = np.flatnonzero(phi >= best - _TIE * max(1.0, abs(best)))
        crossings = self.crossings(len(weights))[tied]
        pick = tied[np.argmin(crossings)]  # (argmin: the first, lowest start, among the fewest)
        return int(self.windows(len(weights))[pick, 0]), float(best)

    def polish(self, cap: np.ndarray, cnt: np.ndarray, placed: list[list[int]], weights: list[np.ndarray], sweeps: int = 6) -> None:
        """Local search after the greedy, kept only while the engines' levels improve.

        Moves: (a) take one replica out and put it back at its best start; (b) take out two
        overlapping replicas, one of them on the (first) bottleneck engine, and put both back greedily
        (either order). A move is kept only if the sorted vector of engine levels C_e / n_e
        gets lexicographically larger (DRF's max-min, then the next bottleneck, ...), so Phi*
        never drops and kappa stays met. `placed[i]` (start engines of model i's replicas),
        `cap` and `cnt` are updated in place.
        """
        for _ in range(sweeps):
            moved = self._single_moves(cap, cnt, placed, weights)
            moved = self._pair_move(cap, cnt, placed, weights) or moved
            if not moved:
                return

    def even_out(self, cap: np.ndarray, cnt: np.ndarray, placed: list[list[int]], weights: list[np.ndarray],
                 works: list[np.ndarray], rounds: int = 64) -> np.ndarray:
        """Compute balance after the placement (`Problem.balance_compute`): swap the starts of two
        replicas of different models with the same stage count where that keeps Phi* and evens
        the engines' compute load (`works[i]`: the per-stage work of one replica of model i); the
        best swap of a round is made, as long as one lowers (highest engine load, sum of squared
        loads). Stage counts per engine, node crossings and (4) stay as they were. Candidates
        pair replicas on the most loaded engines with replicas on the least loaded, at most
        _MAX_PAIRS a round. `placed`, `cap` and `cnt` are updated in place; returns the loads."""
        load = np.zeros(self.n)
        for i, starts in enumerate(placed):
            for p in starts:
                load[self.windows(len(works[i]))[p]] += works[i]
        reps = [(i, j) for i, starts in enumerate(placed) for j in range(len(starts))]
        for _ in range(rounds):
            floor = water_levels(cap, cnt).min() * (1 - _TIE)
            now = _balance_key(load)
            rank = np.argsort(np.argsort(-load))  # 0 = the most loaded engine
            heat = {r: int(rank[self.windows(len(weights[r[0]]))[placed[r[0]][r[1]]]].min()) for r in reps}
            order = sorted(reps, key=heat.get)
            pairs = islice(((a, b) for a in order for b in reversed(order)
                            if a[0] != b[0] and len(weights[a[0]]) == len(weights[b[0]]) and heat[a] < heat[b]), _MAX_PAIRS)
            best = None
            for a, b in pairs:
                key = self._swap_key(cap, cnt, load, placed, weights, works, a, b, floor)
                if key is not None and key < now and (best is None or key < best[0]):
                    best = (key, a, b)
            if best is None:
                return load
            self._swap(cap, cnt, load, placed, weights, works, best[1], best[2])
        return load

    def _swap_key(self, cap, cnt, load, placed, weights, works, a, b, floor):
        """`_balance_key` after swapping replicas a and b ((model, replica) pairs), None where that
        breaks (4), memory or Phi*."""
        self._swap(cap, cnt, load, placed, weights, works, a, b)
        key = None
        s = len(weights[a[0]])
        ok = all(len(set(self.windows(s)[placed[i]].ravel().tolist())) == s * len(placed[i]) for i in (a[0], b[0]))
        if ok and (cap >= 0).all() and water_levels(cap, cnt).min() >= floor:
            key = _balance_key(load)
        self._swap(cap, cnt, load, placed, weights, works, a, b)  # (a swap undoes itself)
        return key

    def _swap(self, cap, cnt, load, placed, weights, works, a, b) -> None:
        (i, j), (k, m) = a, b
        pa, pb = placed[i][j], placed[k][m]
        self.shift(cap, cnt, weights[i], pa, -1, load, works[i])
        self.shift(cap, cnt, weights[k], pb, -1, load, works[k])
        self.shift(cap, cnt, weights[i], pb, +1, load, works[i])
        self.shift(cap, cnt, weights[k], pa, +1, load, works[k])
        placed[i][j], placed[k][m] = pb, pa

    def shift(self, cap: np.ndarray, cnt: np.ndarray, weights: np.ndarray, start: int, sign: int,
              load: np.ndarray | None = None, work: np.ndarray | None = None) -> None:
        """Add (sign=+1) or remove (sign=-1) one replica starting at `start` (and its `work` to `load`)."""
        win = self.windows(len(weights))[start]
        cap[win] -= sign * weights
        cnt[win] += sign
        if load is not None:
            load[win] += sign * work

    def taken(self, starts: list[int], num_stages: int) -> np.ndarray:
        """Engines already holding one of these replicas of a model (constraint 4)."""
        taken = np.zeros(self.n, dtype=bool)
        taken[self.windows(num_stages)[starts]] = True  # (every engine of every listed replica)
        return taken

    def _single_moves(self, cap, cnt, placed, weights) -> bool:
        moved = False
        for i, starts in enumerate(placed):
            idx = self.windows(len(weights[i]))
            for j, start in enumerate(starts):
                current = np.sort(water_levels(cap, cnt))
                self.shift(cap, cnt, weights[i], start, -1)
                phi = self.scores(cap, cnt, self.taken(starts[:j] + starts[j + 1:], len(weights[i])), weights[i])
                best_p, best_levels = start, current
                for p in np.flatnonzero(phi >= current[0] - _TIE * max(1.0, abs(current[0]))):
                    if p == start:
                        continue
                    self.shift(cap, cnt, weights[i], p, +1)
                    trial = np.sort(water_levels(cap, cnt))
                    self.shift(cap, cnt, weights[i], p, -1)
                    if lex_greater(trial, best_levels):
                        best_p, best_levels = int(idx[p, 0]), trial
                self.shift(cap, cnt, weights[i], best_p, +1)
                if best_p != start:
                    starts[j] = best_p
                    moved = True
        return moved

    def _pair_move(self, cap, cnt, placed, weights) -> bool:
        levels = water_levels(cap, cnt)
        floor = levels.min()
        bottleneck = {int(np.flatnonzero(levels <= floor + _TIE * max(1.0, abs(floor)))[0])}
        reps = [(i, j) for i, starts in enumerate(placed) for j in range(len(starts))]
        span = {(i, j): set(self.windows(len(weights[i]))[placed[i][j]].tolist()) for i, j in reps}
        pairs = [(a, b) for a in reps if span[a] & bottleneck for b in reps if b != a and span[a] & span[b]]
        for a, b in pairs[:_MAX_PAIRS]:
            current = np.sort(water_levels(cap, cnt))
            old = {a: placed[a[0]][a[1]], b: placed[b[0]][b[1]]}
            for r in (a, b):
                self.shift(cap, cnt, weights[r[0]], old[r], -1)
            best = None
            for first, second in ((a, b), (b, a)):
                new = {}
                for r in (first, second):
                    i, j = r
                    others = [p for jj, p in enumerate(placed[i]) if (i, jj) not in (a, b)]
                    others += [new[q] for q in new if q[0] == i]
                    start, _ = self.best_start(cap, cnt, self.taken(others, len(weights[i])), weights[i])
                    if start < 0:
                        break
                    new[r] = start
                    self.shift(cap, cnt, weights[i], start, +1)
                if len(new) == 2:
                    trial = np.sort(water_levels(cap, cnt))
                    if lex_greater(trial, current if best is None else best[1]):
                        best = (dict(new), trial)
                for r, start in new.items():
                    self.shift(cap, cnt, weights[r[0]], start, -1)
            chosen = best[0] if best is not None else old
            for r in (a, b):
                self.shift(cap, cnt, weights[r[0]], chosen[r], +1)
                placed[r[0]][r[1]] = chosen[r]
            if best is not None:
                return True
        return False


def water_levels(cap: np.ndarray, cnt: np.ndarray) -> np.ndarray:
    """Per engine C_e / n_e, +inf for engines without stages."""
    return np.where(cnt > 0, cap / np.maximum(cnt, 1), np.inf)


def lex_greater(a: np.ndarray, b: np.ndarray) -> bool:
    """a > b lexicographically, ignoring float noise."""
    differ = np.flatnonzero(~np.isclose(a, b, rtol=1e-9, atol=0.0))
    return bool(len(differ)) and bool(a[differ[0]] > b[differ[0]])


def _balance_key(load: np.ndarray) -> tuple[float, float]:
    """How uneven the engines' compute load is: (highest load, sum of squares), rounded so float
    noise cannot make a swap look better."""
    return (round(float(load.max()), 9), round(float((load ** 2).sum()), 9))
