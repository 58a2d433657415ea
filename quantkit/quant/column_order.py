"""The order in which GPTQ walks the input columns, as permutations of diag(H).

GPTQ quantizes the columns one at a time and spreads each one's error over those not yet quantized, so the
columns that matter most (largest diag(H), the inputs' mean square) do best when they come first: act-order.
Plain act-order scatters each quantization group over the whole walk, so the checkpoint needs a non-monotonic
g_idx (a gather at run time). Group-aware reordering (GAR; Gafni et al., "Dual Precision Quantization",
CVPRW 2025, arXiv:2505.14638; GPTQModel's `act_group_aware`) keeps every group's columns together: the groups are
walked by decreasing importance (the largest diag(H) among their columns), and inside each group its columns by
decreasing diag(H). Group j of the walk is then exactly one original group, so its scale and zero can be stored
under the original group's index and g_idx stays column // group_size.

Every function returns `perm` with perm[position in the walk] = original column index.
"""

from __future__ import annotations

import torch


def group_aware_perm(diag: torch.Tensor, group_size: int) -> torch.Tensor:
    """diag [K] -> perm [K]: whole groups of `group_size` columns by decreasing max diag(H), each group's columns
    by decreasing diag(H). A last partial group (K not a multiple of group_size) stays last, sorted inside.
    Ties keep column order (stable sorts), so the walk does not depend on the sort's implementation."""
    k = diag.numel()
    full = k - k % group_size
    inside = torch.sort(diag[:full].view(-1, group_size), dim=1, descending=True, stable=True)  # [G, S] each
    order = torch.argsort(inside.values[:, 0], descending=True, stable=True)  # [G]: groups by their max
    base = torch.arange(0, full, group_size, device=diag.device).unsqueeze(1)  # [G, 1] first column of each group
    perm = (inside.indices + base)[order].reshape(-1)
    tail = torch.argsort(diag[full:], descending=True, stable=True) + full
    return torch.cat([perm, tail])


def walk_groups(perm: torch.Tensor, group_size: int) -> torch.Tensor:
    """The original group of each group of the walk, [ceil(K / group_size)], for a group-aware perm."""
    return perm[::group_size] // group_size
