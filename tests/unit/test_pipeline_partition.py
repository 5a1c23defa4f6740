"""Layer partitioning: the count rule, the PipeDream dynamic program against brute force, and a
measured model whose uneven blocks the profiled split balances better than equal counts."""

import itertools
import math
import random
import time

import pytest
import torch
from torch import nn

from teratrain.parallel.pipeline.partition import partition, profile_layers, split_layers, stage_totals


def test_split_by_count_gives_the_remainder_to_the_first_stages():
    for n in range(1, 40):
        for s in range(1, n + 1):
            bounds = split_layers(n, s)
            sizes = [len(r) for r in bounds]
            assert [i for r in bounds for i in r] == list(range(n))  # contiguous, in order, all of them
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
            assert sizes[-1] == n // s  # the last stage (head + loss) never gets an extra block
    with pytest.raises(ValueError, match="each stage needs a block"):
        split_layers(3, 4)


def brute_force(time_s, S, mem, cap, first, last, cross):
    """Least max-stage time over every contiguous split (None if none fits the cap)."""
    n, best = len(time_s), None
    for cuts in itertools.combinations(range(1, n), S - 1):
        edges = (0, *cuts, n)
        bounds = [range(a, b) for a, b in zip(edges, edges[1:])]
        times = stage_totals(bounds, time_s, first[0], last[0])
        mems = stage_totals(bounds, mem, first[1], last[1])
        if max(mems) > cap:
            continue
        cost = max(times + [2 * cross[c - 1] for c in cuts])
        best = cost if best is None else min(best, cost)
    return best


def test_dynamic_program_finds_the_exact_optimum():
    rng = random.Random(0)
    for _ in range(400):
        n = rng.randint(1, 9)
        S = rng.randint(1, min(n, 4))
        time_s = [rng.choice([rng.uniform(0.1, 1.0), rng.uniform(1, 8)]) for _ in range(n)]
        mem = [rng.uniform(1, 10) for _ in range(n)]
        first, last = (rng.uniform(0, 2), rng.uniform(0, 5)), (rng.uniform(0, 4), rng.uniform(0, 5))
        cross = [rng.choice([0.0, rng.uniform(0, 3)]) for _ in range(n)]
        cap = rng.choice([math.inf, rng.uniform(5, 40)])
        want = brute_force(time_s, S, mem, cap, first, last, cross)
        if want is None:
            with pytest.raises(ValueError, match="fits"):
                partition(time_s, S, memory_bytes=mem, memory_cap_bytes=cap, first=first, last=last, boundary_s=cross)
            continue
        bounds = partition(time_s, S, memory_bytes=mem, memory_cap_bytes=cap, first=first, last=last,
                           boundary_s=cross)
        assert [i for r in bounds for i in r] == list(range(n)) and len(bounds) == S and all(bounds)
        assert max(stage_totals(bounds, mem, first[1], last[1])) <= cap
        got = max(stage_totals(bounds, time_s, first[0], last[0]) + [2 * cross[r.start - 1] for r in bounds[1:]])
        assert got == pytest.approx(want)


def test_head_and_embedding_count_on_their_stages():
    """Equal blocks, an expensive head: the last stage should take fewer blocks."""
    bounds = partition([1.0] * 8, 2, last=(4.0, 0.0))
    assert [len(r) for r in bounds] == [6, 2]
    bounds = partition([1.0] * 8, 2, first=(4.0, 0.0))
    assert [len(r) for r in bounds] == [2, 6]


def _block(width: int, hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))


def test_profile_counts_parameters_and_saved_activations():
    torch.manual_seed(0)
    layer = nn.Linear(32, 64)
    x = torch.randn(8, 32)
    (cost,) = profile_layers([layer], x, repeats=1)
    assert cost.param_bytes == (32 * 64 + 64) * 4
    assert cost.activation_bytes == x.numel() * 4  # a linear saves its input (its weight is not counted)
    assert cost.time_s > 0


def test_profiled_split_balances_uneven_blocks_better_than_equal_counts():
    """Four wide blocks then eight narrow ones (32x fewer FLOPs), on 4 stages: equal counts put 3
    wide blocks on stage 0; the dynamic program gives each wide block its own stage. Measured:
    each stage's blocks run forward + backward as one module, the slowest stage compared (CPU time of
    this one-thread process, so other processes on the machine do not blur it)."""
    torch.manual_seed(0)
    width = 128
    layers = [_block(width, 16 * width) for _ in range(4)] + [_block(width, width // 2) for _ in range(8)]
    x = torch.randn(128, width)
    costs = profile_layers(layers, x, repeats=7, clock=time.process_time)  # one thread (conftest): CPU time, least of 7
    profiled = partition([c.time_s for c in costs], 4)
    equal = split_layers(len(layers), 4)
    assert [len(r) for r in profiled] != [len(r) for r in equal]

    def slowest(bounds):
        stages = [nn.Sequential(*(layers[i] for i in r)) for r in bounds]
        inputs, h = [], x
        for stage in stages:
            inputs.append(h)
            with torch.no_grad():
                h = stage(h)
        return max(profile_layers([stage], inp, repeats=7, clock=time.process_time)[0].time_s
                   for stage, inp in zip(stages, inputs))

    assert slowest(profiled) < 0.75 * slowest(equal)  # 0.43 measured on a loaded 2-core machine; (1 + 8/32) / 3 by FLOPs
