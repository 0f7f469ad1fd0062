"""Fixed fractions that the whole-subgroup placement misses are warned about once, at
construction, with both figures and the fix (hybrid_opt/placement/plan.py fraction_miss)."""

import warnings

import pytest
import torch

from hybrid_opt import HybridAdamW
from hybrid_opt.placement.plan import fraction_miss, fraction_plan


def _model():  # 467,856 elements: one subgroup at subgroup_numel=4Mi
    return torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 400))


def _build(**kw):
    kw.setdefault("subgroup_numel", 4 << 20)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with HybridAdamW(_model().parameters(), **kw) as opt:
            plan = repr(opt.plan)
    return plan, [str(w.message) for w in caught if "subgroup is placed whole" in str(w.message)]


@pytest.mark.parametrize(
    "kw, says",
    [
        (
            dict(offload_fraction=0.3),
            [
                "asked for 30% of the elements off the device",
                "the plan has 0% off",
                "nothing on the host tier",
            ],
        ),
        (
            dict(offload_fraction=0.5, nvme_fraction=0.25),
            ["the plan has 100% off the device (0% on nvme)", "nothing on the device or nvme tier"],
        ),
    ],
)
def test_a_request_rounded_away_by_whole_subgroups_warns_once_with_the_fix(tmp_path, kw, says):
    if kw.get("nvme_fraction"):
        kw = dict(kw, nvme_path=str(tmp_path))
    _, warned = _build(**kw)
    assert len(warned) == 1, warned
    for text in says + [
        "467,856 elements make 1 subgroup at subgroup_numel=4,194,304",
        "pass a smaller subgroup_numel (e.g. subgroup_numel=32,768)",
    ]:
        assert text in warned[0], (text, warned[0])


@pytest.mark.parametrize(
    "kw",
    [
        dict(offload_fraction=1.0),
        dict(offload_fraction=0.0),
        dict(offload_fraction=0.5, subgroup_numel=1 << 14),
        dict(offload_fraction="auto"),
    ],
)
def test_a_placement_close_to_the_request_or_chosen_by_auto_says_nothing(kw):
    assert _build(**kw)[1] == []


def test_the_threshold_is_five_percent_of_the_elements():
    # 20 subgroups of 5 %: 0.5 lands exactly; 0.52 lands on 0.5 (2 % off: quiet)
    numels, ranks = [100] * 20, list(range(20))
    assert fraction_miss(fraction_plan(numels, ranks, 0.52, 0.0), 0.52, 0.0, 100) is None
    # 4 subgroups of 25 %: 0.4 lands on 0.5 (10 % off: said)
    numels, ranks = [100] * 4, list(range(4))
    assert "the plan has 50% off" in fraction_miss(fraction_plan(numels, ranks, 0.4, 0.0), 0.4, 0.0, 100)


def test_the_suggested_subgroup_numel_is_smaller_than_the_one_passed():
    # 9 subgroups at 4,096 (33,088 elements): half the smallest share is 4,136, whose power of
    # two is today's 4,096; the fix must be a smaller one
    numels, ranks = [4096] * 8 + [320], list(range(9))
    why = fraction_miss(fraction_plan(numels, ranks, 0.55, 0.0), 0.55, 0.0, 4096)
    assert why is not None and "the plan has 50% off" in why
    assert "(e.g. subgroup_numel=2,048)" in why, why
