"""The textbook ZeRO volumes the measurements are compared with (Rajbhandari et al., 2020).

Ψ parameters, N data-parallel ranks, mixed precision (2-byte parameters and gradients; fp32 master
and Adam m, v: 12 bytes per parameter):

=====  ===================  ==========================================
stage  model states / rank  bytes each rank sends per step
=====  ===================  ==========================================
0      16Ψ                  all-reduce of 2Ψ bytes
1      4Ψ + 12Ψ/N           reduce-scatter + all-gather: 2Ψ x 2 bytes
2      2Ψ + 14Ψ/N           the same
3      16Ψ/N                all-gather (fwd), all-gather (bwd), reduce-scatter: 3Ψ x 2 bytes
=====  ===================  ==========================================

The paper's traffic counts Ψ elements per collective; a ring collective of Ψ elements sends
``(N - 1) / N`` of that from each rank, which is what zkit's counters report, so the table shows
both ratios.
"""
from __future__ import annotations


def model_state_bytes(stage: int, psi: int, n: int) -> float:
    """Mixed-precision model-state bytes per rank."""
    if stage == 0:
        return 16.0 * psi
    if stage == 1:
        return 4.0 * psi + 12.0 * psi / n
    if stage == 2:
        return 2.0 * psi + 14.0 * psi / n
    if stage == 3:
        return 16.0 * psi / n
    raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")


def traffic_elements(stage: int, psi: int) -> int:
    """Elements moved per rank per step in the paper's accounting: 2Ψ, or 3Ψ at stage 3."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    return (3 if stage == 3 else 2) * psi


def ring_traffic_bytes(stage: int, psi: int, n: int, element_size: int) -> float:
    """What each rank sends on a ring: ``(N - 1) / N`` of the paper's volume."""
    return traffic_elements(stage, psi) * element_size * (n - 1) / n
