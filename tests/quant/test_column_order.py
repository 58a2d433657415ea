"""The column orders of GPTQ: group-aware act-order (GAR) keeps each group whole, as the rule says."""

import pytest
import torch

from quantkit.quant.column_order import group_aware_perm, walk_groups


def random_diag(k: int, seed: int) -> torch.Tensor:
    return torch.rand(k, generator=torch.Generator().manual_seed(seed)) * 10


@pytest.mark.parametrize("k,group", [(128, 32), (96, 32), (100, 32), (64, 64), (20, 8)])
def test_every_group_stays_together_and_the_walk_follows_the_rule(k, group):
    diag = random_diag(k, seed=k + group)
    perm = group_aware_perm(diag, group)
    assert sorted(perm.tolist()) == list(range(k))  # a permutation
    runs = perm.split(group)
    full = k // group
    for run in runs:  # every run of `group` positions is one original group, columns by decreasing diag(H)
        assert len({int(c) // group for c in run}) == 1
        assert torch.equal(diag[run], diag[run].sort(descending=True).values)
    maxes = [float(diag[run].max()) for run in runs[:full]]  # full groups by decreasing max diag(H)
    assert maxes == sorted(maxes, reverse=True)
    if k % group:  # the partial group stays last
        assert int(runs[-1][0]) // group == full
    assert walk_groups(perm, group).tolist() == [int(run[0]) // group for run in runs]


def test_the_walk_by_hand():
    # groups of 2: group 0 = (1, 5) max 5, group 1 = (9, 2) max 9, group 2 = (3, 4) max 4
    diag = torch.tensor([1.0, 5.0, 9.0, 2.0, 3.0, 4.0])
    assert group_aware_perm(diag, 2).tolist() == [2, 3, 1, 0, 5, 4]
    assert walk_groups(group_aware_perm(diag, 2), 2).tolist() == [1, 0, 2]


def test_ties_keep_column_order():
    assert group_aware_perm(torch.ones(8), 4).tolist() == list(range(8))


def test_one_group_is_act_order_inside_it():
    diag = random_diag(48, seed=1)
    assert torch.equal(group_aware_perm(diag, 48), torch.argsort(diag, descending=True, stable=True))
