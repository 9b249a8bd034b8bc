"""What it costs to bring a model's weights onto a GPU in the seed systems.

- Aegaeon (Appendix A.2, Eq. 4): T_switch = model size / host-link bandwidth * beta, beta = 0.625
  (the paper's profiled factor); the engine is never re-initialised (component reuse, §5.1).
- Prism (Fig. 9, H100, all optimisations): activation of a 1-8B model in 0.7 s, 14B in 1.3 s,
  70B (TP = 8) in 1.5 s. Between those sizes we interpolate linearly in parameters; below 8B
  it is 0.7 s and beyond 70B it grows in proportion to size.
"""

from __future__ import annotations

AEGAEON_BETA = 0.625
PRISM_ACTIVATION_POINTS = ((8e9, 0.7), (14e9, 1.3), (70e9, 1.5))  # (parameters, seconds), Fig. 9


def aegaeon_switch_time(weight_bytes: int, host_link_Bps: float, beta: float = AEGAEON_BETA) -> float:
    return weight_bytes / host_link_Bps * beta


def prism_activation_time(num_params: float) -> float:
    pts = PRISM_ACTIVATION_POINTS
    if num_params <= pts[0][0]:
        return pts[0][1]
    for (p0, t0), (p1, t1) in zip(pts, pts[1:]):
        if num_params <= p1:
            return t0 + (t1 - t0) * (num_params - p0) / (p1 - p0)
    p, t = pts[-1]
    return t * num_params / p
