"""Mixture-of-experts routers against written-out references of their papers' equations (per-token
loops on fixed inputs, in fp64), the layer's output against its definition, and gradients through
the router (autograd against finite differences)."""

import math

import pytest
import torch

from teratrain.config import ConfigError
from teratrain.models import moe, routers
from teratrain.models.transformer import build_model, count_params
from tests.helpers import expert_out, make_config, model_config, one_rank_moe

N, D = 12, 6  # tokens, width


def layer(n=4, router="softmax-topk", seed=0, **keys) -> moe.MoE:
    """An MoE layer in fp64 (router too) with a random router (the noisy routers' zero init would tie
    every gate)."""
    cfg = model_config(d_model=D, n_heads=3, n_kv_heads=3, d_ff=5,
                       moe=dict(num_experts=n, router=router, router_dtype="compute", **keys))
    m = moe.MoE(cfg, layer=0).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    return m


def tokens(seed=1) -> torch.Tensor:
    return torch.randn(N, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def softmax(v: list[float]) -> list[float]:
    m = max(v)
    e = [math.exp(a - m) for a in v]
    return [a / sum(e) for a in e]


def logits(W: torch.Tensor, x: torch.Tensor) -> list[list[float]]:
    return [[sum(W[i, c].item() * x[t, c].item() for c in range(x.shape[1])) for i in range(W.shape[0])]
            for t in range(x.shape[0])]


def ranked(v: list[float]) -> list[int]:
    return sorted(range(len(v)), key=lambda i: -v[i])


def cv2(v: list[float]) -> float:
    mean = sum(v) / len(v)
    return sum((a - mean) ** 2 for a in v) / len(v) / (mean ** 2 + 1e-10)


def phi(z: float) -> float:
    return 0.5 * (1 + math.erf(z / math.sqrt(2)))


def check(r: routers.Routing, experts, weights, routed, aux, weight: float):
    assert r.experts.tolist() == experts
    kept = r.routed.tolist()
    assert kept == routed
    for t in range(N):
        for j, ok in enumerate(routed[t]):
            if ok:
                assert r.weights[t, j].item() == pytest.approx(weights[t][j], rel=1e-12)
    assert r.aux_loss.item() == pytest.approx(weight * aux, rel=1e-10)


def test_softmax_topk_with_capacity():
    m, x = layer(n=4, router="softmax-topk", capacity_factor=1.0, aux_loss_weight=0.3), tokens()
    P = [softmax(v) for v in logits(m.router.weight, x)]
    experts = [ranked(p)[:2] for p in P]
    weights = [[p[e] / (p[a] + p[b]) for e in (a, b)] for p, (a, b) in zip(P, experts)]
    cap, used, routed = math.ceil(1.0 * 2 * N / 4), [0] * 4, [[False, False] for _ in range(N)]
    for j in range(2):  # first choices before second ones, token order within each
        for t in range(N):
            routed[t][j] = used[experts[t][j]] < cap
            used[experts[t][j]] += 1
    f = [sum(e.count(i) for e in experts) / (2 * N) for i in range(4)]
    aux = 4 * sum(f[i] * sum(p[i] for p in P) / N for i in range(4))
    check(m.router(x), experts, weights, routed, aux, 0.3)
    assert not all(all(r) for r in routed), "the fixed input must overflow some expert"


def test_switch_top1_capacity_and_aux():
    """Fedus et al. eq. 4-5: aux = alpha * n * sum_i f_i P_i; capacity = factor * tokens / experts."""
    m, x = layer(n=4, router="switch-top1", capacity_factor=1.0, aux_loss_weight=0.01), tokens()
    P = [softmax(v) for v in logits(m.router.weight, x)]
    experts = [[ranked(p)[0]] for p in P]
    cap, used, routed = math.ceil(N / 4), [0] * 4, []
    for (e,) in experts:
        routed.append([used[e] < cap])
        used[e] += 1
    f = [sum(e == [i] for e in experts) / N for i in range(4)]
    aux = 4 * sum(f[i] * sum(p[i] for p in P) / N for i in range(4))
    check(m.router(x), experts, [[p[e]] for p, (e,) in zip(P, experts)], routed, aux, 0.01)
    assert not all(r[0] for r in routed)


def test_gshard_top2_algorithm_1_with_groups_and_random_routing():
    """Lepikhin et al. Algorithm 1 per local group: capacity 2S/E per group (factor 1), first choices
    first, the second with probability 2 * g2, aux = 1/E sum_e c_e/S m_e averaged over groups."""
    E, G = 4, 2
    m, x = layer(n=E, router="gshard-top2", groups=G, aux_loss_weight=0.1), tokens()
    m.router.train()
    rnd = torch.rand(N, generator=torch.Generator().manual_seed(7), dtype=torch.float64).tolist()
    S = N // G
    experts, weights, routed, aux = [], [], [], 0.0
    for g in range(G):
        gates = [softmax(v) for v in logits(m.router.weight, x[g * S:(g + 1) * S])]
        C, c, combine = 2 * S // E, [0] * E, {}
        for s, gs in enumerate(gates):
            e1, e2 = ranked(gs)[:2]
            g1, g2 = gs[e1] / (gs[e1] + gs[e2]), gs[e2] / (gs[e1] + gs[e2])
            experts.append([e1, e2])
            weights.append([g1, g2])
            combine[s] = [c[e1] < C, False]
            c[e1] += 1
        m_e = [sum(gs[e] for gs in gates) / S for e in range(E)]
        aux += sum(c[e] / S * m_e[e] for e in range(E)) / E / G
        for s, gs in enumerate(gates):
            e2 = experts[g * S + s][1]
            if 2 * weights[g * S + s][1] > rnd[g * S + s]:
                combine[s][1] = c[e2] < C
                c[e2] += 1
        routed += [combine[s] for s in range(S)]
    r = m.router(x, torch.Generator().manual_seed(7))
    check(r, experts, weights, routed, aux, 0.1)
    assert sum(map(sum, routed)) < 2 * N


def _noisy_reference(clean, raw_noise, noise_logits, k):
    """Shazeer et al. eqs. 3-5 and 8-10 for one token: gates and each expert's Pr(in the top k)."""
    sd = [math.log1p(math.exp(v)) for v in noise_logits]
    H = [c + z * s for c, z, s in zip(clean, raw_noise, sd)]
    top = ranked(H)[:k]
    g = softmax([H[i] for i in top])
    G = [0.0] * len(H)
    for i, v in zip(top, g):
        G[i] = v
    load = []
    for i in range(len(H)):
        others = sorted((H[j] for j in range(len(H)) if j != i), reverse=True)
        load.append(phi((clean[i] - others[k - 1]) / sd[i]))  # kth_excluding(H, k, i)
    return top, g, G, load


def test_noisy_topk_importance_and_smooth_load():
    n, k = 5, 2
    m, x = layer(n=n, router="noisy-topk", top_k=k, aux_loss_weight=0.2), tokens()
    m.router.train()
    z = torch.randn(N, n, generator=torch.Generator().manual_seed(3), dtype=torch.float64).tolist()
    clean, noise = logits(m.router.weight, x), logits(m.router.w_noise, x)
    ref = [_noisy_reference(c, zz, nl, k) for c, zz, nl in zip(clean, z, noise)]
    importance = [sum(G[i] for _, _, G, _ in ref) for i in range(n)]
    load = [sum(L[i] for _, _, _, L in ref) for i in range(n)]
    r = m.router(x, torch.Generator().manual_seed(3))
    check(r, [top for top, *_ in ref], [g for _, g, *_ in ref], [[True] * k] * N, cv2(importance) + cv2(load), 0.2)


def test_hierarchical_eqs_12_to_14():
    a, b, k = 2, 3, 1
    m, x = layer(n=a * b, router="hierarchical", groups=a, top_k=k, aux_loss_weight=0.5), tokens()
    m.router.train()
    gen = torch.Generator().manual_seed(5)
    z_p = torch.randn(N, a, generator=gen, dtype=torch.float64).tolist()
    z_s = torch.randn(N, a, b, generator=gen, dtype=torch.float64).tolist()
    clean, noise = logits(m.router.weight, x), logits(m.router.w_noise, x)
    experts, weights = [], []
    imp = [[0.0] * b for _ in range(a)]
    load_p, load_s, members = [0.0] * a, [[0.0] * b for _ in range(a)], [0] * a
    for t in range(N):
        top, g, Gp, Lp = _noisy_reference(clean[t][:a], z_p[t], noise[t][:a], k)
        sec = [_noisy_reference(clean[t][a + i * b:a + (i + 1) * b], z_s[t][i], noise[t][a + i * b:a + (i + 1) * b], k)
               for i in range(a)]
        experts.append([i * b + j for i in top for j in sec[i][0]])
        weights.append([gi * gj for gi, i in zip(g, top) for gj in sec[i][1]])
        for i in range(a):
            load_p[i] += Lp[i]
            for j in range(b):
                imp[i][j] += Gp[i] * sec[i][2][j]
                if Gp[i] > 0:
                    load_s[i][j] += sec[i][3][j]
            members[i] += Gp[i] > 0
    load = [load_p[i] * load_s[i][j] / max(members[i], 1) for i in range(a) for j in range(b)]
    aux = cv2([v for row in imp for v in row]) + cv2(load)
    r = m.router(x, torch.Generator().manual_seed(5))
    check(r, experts, weights, [[True] * k * k] * N, aux, 0.5)


@pytest.mark.parametrize("router, keys", [("softmax-topk", dict(capacity_factor=0.75)), ("switch-top1", {}),
                                          ("gshard-top2", dict(groups=3)), ("noisy-topk", {}),
                                          ("hierarchical", dict(groups=2, top_k=1))])
def test_layer_output_is_the_gated_sum_and_dropped_tokens_pass_through(router, keys):
    m = layer(n=4, router=router, **keys)
    m.train()
    m.routing_seed = 11
    x = tokens().view(3, 4, D)
    y = m(x).view(N, D)
    r = m.router(x.view(N, D), m._generator(x.device))
    for t in range(N):
        want = sum(r.weights[t, j] * expert_out(m.experts, int(r.experts[t, j]), x.view(N, D)[t:t + 1])[0]
                   for j in range(r.experts.shape[1]) if r.routed[t, j])
        torch.testing.assert_close(y[t], want if torch.is_tensor(want) else torch.zeros(D, dtype=torch.float64))
    stats = m.pop_stats()
    assert stats["load"].tolist() == torch.bincount(r.experts[r.routed], minlength=4).double().tolist()
    assert stats["dropped"].item() == int(r.attempted) - r.routed.sum().item()
    assert not any(v.any() for v in m.pop_stats().values())  # reset to zeros


@pytest.mark.parametrize("router, keys", [("softmax-topk", dict(capacity_factor=1.0)), ("switch-top1", {}),
                                          ("gshard-top2", {}), ("noisy-topk", {}),
                                          ("hierarchical", dict(groups=2, top_k=1))])
def test_gradients_through_the_router_match_finite_differences(router, keys):
    """d(sum(y * c) + aux)/d(x, W_g, W_noise) by autograd equals central differences (fp64): the
    gates, the aux losses and the smooth load carry the router's gradient."""
    m = layer(n=4, router=router, **keys)
    m.train()
    m.routing_seed = 2  # the same noise and random routing at every evaluation
    x = tokens().view(2, 6, D).requires_grad_()
    c = torch.randn(2, 6, D, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    params = [p for n, p in m.router.named_parameters()]

    def f(x, *ws):
        with torch.no_grad():
            for p, w in zip(params, ws):
                p.copy_(w)
        return (m(x) * c).sum() + m.aux_loss

    ws = [p.detach().clone().requires_grad_() for p in params]
    out = (m(x) * c).sum() + m.aux_loss
    grads = torch.autograd.grad(out, [x] + params)
    eps = 1e-6
    for i, (t, g) in enumerate(zip([x] + ws, grads)):
        flat = t.detach().clone().view(-1)
        for j in range(0, flat.numel(), max(1, flat.numel() // 7)):
            args = [x.detach()] + [w.detach() for w in ws]
            hi, lo = flat.clone(), flat.clone()
            hi[j] += eps
            lo[j] -= eps
            args[i] = hi.view(t.shape)
            f_hi = f(*args).item()
            args[i] = lo.view(t.shape)
            f_lo = f(*args).item()
            assert g.view(-1)[j].item() == pytest.approx((f_hi - f_lo) / (2 * eps), rel=1e-5, abs=1e-7)
    assert all(g.abs().sum() > 0 for g in grads)


def test_model_loss_adds_the_aux_losses_in_training_only():
    cfg = model_config(moe=dict(num_experts=4, every=2, aux_loss_weight=0.5))
    model = build_model(cfg, dtype=torch.float64)
    x = torch.randint(0, 50, (2, 9))
    model.train()
    total = model(x[:, :-1], x[:, 1:])
    aux = model.layers[1].feed_forward.aux_loss
    model.eval()
    ce = model(x[:, :-1], x[:, 1:])
    assert not hasattr(model.layers[0].feed_forward, "router")  # every=2: layers 1, 3, ... hold experts
    torch.testing.assert_close(total, ce + aux)
    assert aux.item() > 0


def test_transformers_convention_is_mixtrals_load_balancing_loss():
    """aux_loss_convention=transformers, aux_loss_weight = router_aux_loss_coef: the model's aux loss is
    coef x transformers' own load_balancing_loss_func (imported) over every layer's router logits,
    value and gradient; for one layer alone theirs is top_k times ours."""
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    coef, k = 0.02, 2
    cfg = model_config(n_layers=3, moe=dict(num_experts=4, top_k=k, aux_loss_weight=coef,
                                            aux_loss_convention="transformers"))
    model = build_model(cfg)
    routers = [block.feed_forward.router for block in model.layers.values()]
    inputs = []
    for r in routers:
        r.register_forward_pre_hook(lambda m, args: inputs.append(args[0]))
    model.train()
    x = torch.randint(0, 50, (2, 9))
    model(x[:, :-1], x[:, 1:])
    logits = tuple(torch.nn.functional.linear(h, r.weight) for h, r in zip(inputs, routers))
    theirs = coef * mixtral.load_balancing_loss_func(logits, 4, k)
    mine = moe.aux_loss(model)
    torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=0)
    weights = [r.weight for r in routers]
    for a, b in zip(torch.autograd.grad(mine, weights, retain_graph=True), torch.autograd.grad(theirs, weights)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-9)
    for h, r, lg in zip(inputs, routers, logits):  # one layer: theirs = k x ours (f: share of the N*k choices)
        ours = r(h.detach()).aux_loss / r.aux_weight
        torch.testing.assert_close(mixtral.load_balancing_loss_func((lg,), 4, k), k * ours, rtol=1e-6, atol=0)


@pytest.mark.parametrize("keys", [dict(), dict(router="switch-top1", every=2), dict(router="noisy-topk"),
                                  dict(router="hierarchical", num_experts=8, top_k=1), dict(arch="gpt2")], ids=str)
def test_count_params_equals_the_module(keys):
    arch = keys.pop("arch", "llama")
    cfg = model_config(arch=arch, moe=dict(num_experts=keys.pop("num_experts", 4), **keys))
    model = build_model(cfg)
    assert count_params(cfg)["total"] == sum(p.numel() for p in model.parameters())


def test_mixtral_preset_total_and_active_parameters():
    """Jiang et al. 2024: 46.7B parameters, 12.9B active per token (embeddings included)."""
    cfg = make_config("model.preset=mixtral-8x7b").model
    c = count_params(cfg)
    assert c["total"] == 46_702_792_704
    assert c["active"] == c["matmul"] + c["embedding"] + (cfg.n_layers * 2 + 1) * cfg.d_model  # + norms
    assert round(c["active"] / 1e9, 1) == 12.9


@pytest.mark.parametrize("sets, words", [
    (["model.moe.num_experts=4", "model.moe.router=switch-top1", "model.moe.top_k=2"], "top_k"),
    (["model.moe.num_experts=4", "model.moe.top_k=5"], "exceeds"),
    (["model.moe.num_experts=6", "model.moe.router=hierarchical", "model.moe.groups=4"], "groups"),
    (["model.moe.num_experts=4", "model.moe.noise=0.5"], "noise"),
    (["model.moe.top_k=4"], "model.moe.top_k is set but model.moe.num_experts is 1"),
    (["model.moe.shared_experts=2"], "model.moe.shared_experts is set but model.moe.num_experts is 1"),
    (["model.moe.num_experts=4", "model.moe.every=9"], "every"),
    (["model.moe.nm_experts=4"], "did you mean 'model.moe.num_experts'"),
])
def test_bad_moe_config_is_one_sentence(sets, words):
    with pytest.raises(ConfigError) as e:
        make_config(*sets)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_preset_moe_keys_merge_with_given_ones():
    cfg = make_config("model.preset=mixtral-8x7b", "model.moe.capacity_factor=1.5")
    assert (cfg.model.moe.num_experts, cfg.model.moe.k, cfg.model.moe.capacity) == (8, 2, 1.5)
    assert make_config("model.preset=moe-tiny", "model.moe.num_experts=1").model.moe.num_experts == 1  # MoE off


@pytest.mark.parametrize("sets, words", [
    (["parallel.ep=2"], "needs a mixture-of-experts model"),
    (["model.preset=moe-tiny", "parallel.ep=3"], "must divide model.moe.num_experts"),
    (["model.preset=moe-tiny", "parallel.ep=2", "parallel.sync=local-sgd"], "parallel.sync=local-sgd"),
    (["model.preset=moe-tiny", "parallel.pp=2", "model.moe.aux_loss_convention=transformers"],
     "aux_loss_convention=ours with parallel.pp>1"),
])
def test_expert_parallel_layouts_refused_with_one_sentence(sets, words):
    from teratrain.parallel.support import check_supported

    with pytest.raises(ConfigError) as e:
        check_supported(make_config(*sets))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_layouts_group_rows_by_key_on_the_device():
    """grouped_layout: group g's rows consecutive from a multiple of `align`, in input order, rows of
    key G (nowhere) in none; slotted_layout: group g in slots [g * slot, ...). `dest` and `src` are
    each other's inverse on the sent rows; dispatch reads zero where a buffer row holds none."""
    from teratrain.models.permute import dispatch, grouped_layout, slotted_layout

    key = torch.tensor([2, 0, 3, 2, 0, 2])  # 3 groups; 3 = nowhere
    lay = grouped_layout(key, 3)
    assert lay.dest.tolist() == [2, 0, 0, 3, 1, 4] and lay.offsets.tolist() == [2, 2, 5] and lay.rows == 7
    assert lay.src.tolist() == [1, 4, 0, 3, 5, 6, 6] and lay.counts.tolist() == [2, 0, 3]
    lay = grouped_layout(key, 3, align=4)  # groups of 2, 0, 3 rows start at 0, 4, 4
    assert lay.dest.tolist() == [4, 0, 0, 5, 1, 6] and lay.offsets.tolist() == [4, 4, 8] and lay.rows == 16
    x = torch.arange(1.0, 7.0).unsqueeze(1)
    assert dispatch(x, lay).squeeze(1).tolist() == [2, 5, 0, 0, 1, 4, 6, 0] + [0] * 8  # no row: zero
    assert dispatch(x[::2], lay, k=2).squeeze(1).tolist() == [1, 5, 0, 0, 1, 3, 5, 0] + [0] * 8  # row i of x[i // 2]
    slots = slotted_layout(key, 3, slot=3)
    assert slots.dest.tolist() == [6, 0, 0, 7, 1, 8] and slots.rows == 9
    assert slots.src.tolist() == [1, 4, 6, 6, 6, 6, 0, 3, 5] and slots.offsets.tolist() == [3, 6, 9]
    assert grouped_layout(torch.zeros(0, dtype=torch.long), 2).offsets.tolist() == [0, 0]


@pytest.mark.parametrize("ranked", ["count", "sort"])
@pytest.mark.parametrize("m, groups, align", [(1, 1, 1), (37, 4, 1), (64, 8, 8), (200, 16, 8), (5, 8, 4)])
def test_grouped_layout_against_its_definition(m, groups, align, ranked, monkeypatch):
    """grouped_layout against its definition written row by row: group g's rows in input order from the
    group's start (its predecessors' rows rounded up to `align`), dest 0 and no buffer row for key G. Each
    row's rank in its group from the running count of one-hot keys, or from the stable sort that takes
    over past RANKED_MAX."""
    from teratrain.models import permute
    from teratrain.models.permute import grouped_layout

    if ranked == "sort":
        monkeypatch.setattr(permute, "RANKED_MAX", 0)

    key = torch.randint(0, groups + 1, (m,), generator=torch.Generator().manual_seed(m))
    rows = m + groups * (align - 1) + 1
    dest, src, ends, start = [0] * m, [m] * rows, [], 0
    for g in range(groups):
        members = [i for i in range(m) if key[i] == g]
        for rank, i in enumerate(members):
            dest[i], src[start + rank] = start + rank, i
        start += -(-len(members) // align) * align
        ends.append(start)
    lay = grouped_layout(key, groups, align)
    assert (lay.dest.tolist(), lay.src.tolist(), lay.offsets.tolist(), lay.rows) == (dest, src, ends, rows)
    assert lay.counts.tolist() == [int((key == g).sum()) for g in range(groups)] and lay.sent.tolist() == (key < groups).tolist()
    assert lay.counts.is_contiguous()  # expert parallelism exchanges them


@pytest.mark.parametrize("k", [1, 2])
def test_a_layout_known_to_send_every_row_masks_nothing_and_moves_the_same(k):
    """grouped_layout(every=True), where no key is G: the same layout, `sent` None, and dispatch / combine
    give the same values and gradients without masking; the MoE layer says so where nothing can be dropped."""
    from teratrain.models.permute import combine, dispatch, grouped_layout

    g = torch.Generator().manual_seed(0)
    n, d = 6, 3
    key = torch.randint(0, 3, (n * k,), generator=g)
    masked, every = grouped_layout(key, 3, align=4), grouped_layout(key, 3, align=4, every=True)
    for f in ("dest", "src", "offsets", "counts"):
        assert torch.equal(getattr(masked, f), getattr(every, f)), f
    assert masked.sent.all() and every.sent is None
    x = torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(masked.rows, d, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.rand(n, k, generator=g, dtype=torch.float64, requires_grad=True)
    cb, co = torch.randn(masked.rows, d, generator=g, dtype=torch.float64), torch.randn(n, d, generator=g, dtype=torch.float64)
    got = [torch.autograd.grad((dispatch(x, lay, k) * cb).sum() + (combine(y, lay, w, k) * co).sum(), [x, y, w])
           for lay in (masked, every)]
    for a, b in zip(*got):
        assert torch.equal(a, b)
    dropless = moe.MoE(model_config(d_model=8, n_heads=2, n_kv_heads=2, d_ff=12,
                                    moe=dict(num_experts=4, router="softmax-topk", capacity_factor=0.0)), layer=0)
    capped = moe.MoE(model_config(d_model=8, n_heads=2, n_kv_heads=2, d_ff=12,
                                  moe=dict(num_experts=4, router="softmax-topk", capacity_factor=1.0)), layer=0)
    flat = torch.randn(10, 8, generator=g)
    assert (dropless.router(flat).every, capped.router(flat).every) == (True, False)


@pytest.mark.parametrize("k", [2, 8])
def test_combine_in_bf16_keeps_its_dtype_and_tracks_fp64(k):
    """The eager combine's batched GEMMs in bf16 (the compute dtype): output and gradients in bf16, within bf16's
    rounding of the same combine in fp64 (tolerance fixed before the run: 2e-2 relative to each tensor's largest)."""
    from teratrain.models.permute import combine, grouped_layout

    g = torch.Generator().manual_seed(1)
    n, d = 16, 64
    key = torch.randint(0, 4, (n * k,), generator=g)  # 4 = nowhere
    lay = grouped_layout(key, 4, align=8)
    y64 = torch.randn(lay.rows, d, generator=g, dtype=torch.float64)
    w64, co = torch.rand(n, k, generator=g, dtype=torch.float64), torch.randn(n, d, generator=g, dtype=torch.float64)
    out = []
    for dtype in (torch.float64, torch.bfloat16):
        y, w = y64.to(dtype).requires_grad_(), w64.to(dtype).requires_grad_()
        z = combine(y, lay, w, k)
        gy, gw = torch.autograd.grad((z * co.to(dtype)).sum(), [y, w])
        assert {z.dtype, gy.dtype, gw.dtype} == {dtype}
        out.append((z, gy, gw))
    for want, got in zip(*out):
        assert (got.double() - want).abs().max() <= 2e-2 * want.abs().max()


@pytest.mark.parametrize("k", [1, 2, 8])
def test_permutations_backward_are_gathers_equal_to_autograds_indexing(k):
    """dispatch / combine against the same maps written with advanced indexing (whose backward is an
    accumulating index_put_), values and gradients, with rows not sent, padding and empty groups (k = 8:
    fine-grained routing, the combine's batched GEMMs over 8 rows a token)."""
    from teratrain.models.permute import combine, dispatch, grouped_layout

    g = torch.Generator().manual_seed(0)
    n, d = 5, 3
    key = torch.tensor([1, 3, 0, 3, 1, 1, 3, 1, 0, 3] * 4)[:n * k]  # 3 groups, 3 = nowhere; group 2 empty
    lay = grouped_layout(key, 3, align=4)
    x = torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(lay.rows, d, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.rand(n, k, generator=g, dtype=torch.float64, requires_grad=True)
    cb = torch.randn(lay.rows, d, generator=g, dtype=torch.float64)
    co = torch.randn(n, d, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((dispatch(x, lay, k) * cb).sum() + (combine(y, lay, w, k) * co).sum(), [x, y, w])
    sent = key < 3
    src = torch.full((lay.rows,), n, dtype=torch.long)
    src[lay.dest[sent]] = torch.arange(n * k)[sent] // k
    buf = torch.cat([x, x.new_zeros(1, d)])[src]
    mine = torch.where(sent.unsqueeze(1), y[lay.dest], 0.0) * torch.where(sent, w.flatten(), 0.0).unsqueeze(1)
    want = torch.autograd.grad((buf * cb).sum() + (mine.view(n, k, d).sum(1) * co).sum(), [x, y, w])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("kernel", ["loop", "grouped"])
def test_no_scatter_add_in_the_layers_backward(kernel):
    """Forward and backward of a layer with capacity drops and biases run no accumulating index_put
    (advanced indexing's backward: sorted, each run of equal rows walked serially on CUDA), no
    index_add and no scatter_add: every data movement is a gather."""
    from torch.utils._python_dispatch import TorchDispatchMode

    if kernel == "grouped" and getattr(torch, "_grouped_mm", None) is None:
        pytest.skip("this torch has no grouped GEMM")

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    cfg = model_config(d_model=8, n_heads=2, n_kv_heads=2, d_ff=16, bias=True,
                       moe=dict(num_experts=8, router="softmax-topk", capacity_factor=0.5))
    m = moe.MoE(cfg, layer=0).train()
    m.kernel = kernel
    x = torch.randn(1, 10, 8, requires_grad=True)
    with Ops() as ops:
        (m(x).sum() + m.aux_loss).backward()
    assert "aten.index_select" in ops.seen and m.pop_stats()["dropped"] > 0
    assert not ops.seen & {"aten.index_put", "aten.index_put_", "aten._index_put_impl_", "aten.index_add",
                           "aten.index_add_", "aten.scatter_add", "aten.scatter_add_"}


def reference_forward(m: moe.MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer as first written: the routed choices (nonzero, a read-back), sorted by expert, each
    expert on its rows (split by counts read back), outputs weighted and summed per token."""
    d = x.shape[-1]
    flat = x.reshape(-1, d)
    r = m.router(flat, m._generator(x.device))
    K = r.experts.shape[1]
    choice = r.routed.flatten().nonzero().squeeze(1)
    expert_of = r.experts.flatten()[choice]
    choice = choice[torch.argsort(expert_of, stable=True)]
    counts = torch.bincount(r.experts.flatten()[choice], minlength=m.num_experts).tolist()
    token = choice // K
    ys = torch.cat([expert_out(m.experts, e, rows) for e, rows in enumerate(flat[token].split(counts))])
    w = r.weights.flatten()[choice].unsqueeze(1)
    return ys.new_zeros(flat.shape).index_add(0, token, ys * w).view(x.shape), r.aux_loss


@pytest.mark.parametrize("tokens", [3, 10])
@pytest.mark.parametrize("kernel", ["loop", "grouped"])
@pytest.mark.parametrize("router, keys", [("softmax-topk", {}), ("softmax-topk", dict(capacity_factor=0.5)),
                                          ("switch-top1", dict(capacity_factor=0)), ("switch-top1", {}),
                                          ("gshard-top2", dict(groups=2)), ("noisy-topk", dict(capacity_factor=1.0)),
                                          ("hierarchical", dict(groups=2, top_k=1, capacity_factor=1.0))])
def test_dispatch_equals_the_per_expert_loop_with_its_gradients(router, keys, kernel, tokens):
    """Outputs and the gradients of x, the router and every expert equal the first version's (fp32,
    1e-5), with and without capacity; 3 tokens of at most 2 choices leave experts of the 8 without a
    row; `grouped` runs torch._grouped_mm (its CPU kernel, whose rows past the last group really are
    uninitialized memory)."""
    if kernel == "grouped" and getattr(torch, "_grouped_mm", None) is None:
        pytest.skip("this torch has no grouped GEMM")
    cfg = model_config(d_model=8, n_heads=2, n_kv_heads=2, d_ff=12, bias=router == "switch-top1",
                       moe=dict(num_experts=8, router=router, **keys))
    m = moe.MoE(cfg, layer=0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    m.train()
    m.routing_seed, m.kernel = 4, kernel
    x = torch.randn(1, tokens, 8, generator=g, requires_grad=True)
    c = torch.randn(1, tokens, 8, generator=g)
    params = [x] + list(m.parameters())
    y = m(x)
    got = torch.autograd.grad((y * c).sum() + m.aux_loss, params)
    load = m.pop_stats()["load"]
    y_ref, aux = reference_forward(m, x)
    want = torch.autograd.grad((y_ref * c).sum() + aux, params, allow_unused=True)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    for p, a, b in zip(params, got, want):
        torch.testing.assert_close(a, torch.zeros_like(a) if b is None else b, rtol=1e-5, atol=1e-6)
    assert (load == 0).any() or tokens > 3


class _OneRank:
    """A mesh whose `ep` group is one process: the exchange's all-to-alls are copies."""

    def group(self, axis):
        return None


@pytest.mark.parametrize("kernel", ["loop", "grouped"])
@pytest.mark.parametrize("keys", [dict(capacity_factor=0.75), dict(capacity_factor=0)])
def test_chunked_exchange_equals_the_layer_without_one(keys, kernel):
    """The expert-parallel exchange (parallel/expert.py) on a group of one, cut into 1, 3 and 7
    chunks (7: empty chunks, more than some experts' rows), padded (a capacity) and dropless: outputs
    and every gradient equal the layer's own dispatch (fp32, 1e-5). The chunk layouts, each chunk's
    rows and keys, and the weights stacked once for all chunks are checked here; the collectives by
    tests/dist/test_expert_parallel.py."""
    from teratrain.parallel.expert import ExpertExchange

    if kernel == "grouped" and getattr(torch, "_grouped_mm", None) is None:
        pytest.skip("this torch has no grouped GEMM")
    m, x, c, params = one_rank_moe(kernel, **keys)

    def run(exchange):
        m.exchange = exchange
        y = m(x)
        return [y, *torch.autograd.grad((y * c).sum() + m.aux_loss, params)]

    want = run(None)
    for chunks in (1, 3, 7):
        for a, b in zip(run(ExpertExchange(_OneRank(), 1, 4, chunks)), want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_chunked_exchange_schedule_overlaps_forward_and_backward(monkeypatch):
    """The order the pipelined exchange issues its work in, forward and backward (what the overlap
    rests on, parallel/expert.py): every dispatch launched before the first expert pass, piece c's
    experts after its own landing only, its combine launched right after them; in backward every
    combine's reverse launched first, then per piece (last first) its landing, its experts' backward
    and its dispatch's reverse launch, the dispatches landed last."""
    from teratrain.parallel import comm
    from teratrain.parallel.expert import ExpertExchange

    log, names = [], {}
    start, finish, run = comm.RowExchange.start, comm.RowExchange.finish, moe.MoE.run_local

    def logged_start(ex, x, reverse=False):
        log.append(("launch", names.setdefault(id(ex), len(names))))
        return start(ex, x, reverse)

    def logged_finish(ex):
        log.append(("land", names[id(ex)]))
        return finish(ex)

    def logged_run(m, x, key, k=1, stacks=None, every=False):
        piece = sum(1 for e in log if e[0] == "experts")
        log.append(("experts", piece))
        y, lay = run(m, x, key, k, stacks, every)
        y.register_hook(lambda g: log.append(("experts backward", piece)))
        return y, lay

    monkeypatch.setattr(comm.RowExchange, "start", logged_start)
    monkeypatch.setattr(comm.RowExchange, "finish", logged_finish)
    monkeypatch.setattr(moe.MoE, "run_local", logged_run)
    cfg = model_config(d_model=8, n_heads=2, n_kv_heads=2, d_ff=12,
                       moe=dict(num_experts=4, router="softmax-topk", capacity_factor=1.0))
    m = moe.MoE(cfg, layer=0)
    m.exchange = ExpertExchange(_OneRank(), 1, 4, 3)
    y = m(torch.randn(1, 12, 8, requires_grad=True))
    forward, log[:] = list(log), []
    y.sum().backward()
    # exchanges 0-2: the dispatches of pieces 0-2, 3-5: their combines
    assert forward == [("launch", 0), ("launch", 1), ("launch", 2),
                       ("land", 0), ("experts", 0), ("launch", 3), ("land", 1), ("experts", 1), ("launch", 4),
                       ("land", 2), ("experts", 2), ("launch", 5), ("land", 3), ("land", 4), ("land", 5)]
    assert log == [("launch", 5), ("launch", 4), ("launch", 3),
                   ("land", 5), ("experts backward", 2), ("launch", 2), ("land", 4), ("experts backward", 1),
                   ("launch", 1), ("land", 3), ("experts backward", 0), ("launch", 0),
                   ("land", 2), ("land", 1), ("land", 0)]


def test_grouped_mm_loop_op_equals_torchs_grouped_mm_with_gradients():
    """models/grouped_loop.py, the grouped GEMM compiled fp32 runs use: each group's rows times its
    weight (an empty group and rows past the last group included), and its registered backward, equal
    torch's _grouped_mm and autograd through it (fp32, 1e-6); torch.library.opcheck checks the fake
    function and the autograd registration."""
    if getattr(torch, "_grouped_mm", None) is None:
        pytest.skip("this torch has no grouped GEMM")
    from teratrain.models.grouped_loop import grouped_mm_loop

    g = torch.Generator().manual_seed(0)
    x = torch.randn(11, 8, generator=g, requires_grad=True)  # strides of 16 bytes, as torch's op requires
    w = torch.randn(3, 8, 4, generator=g, requires_grad=True)
    offs = torch.tensor([4, 4, 9], dtype=torch.int32)  # group 1 empty, rows 9-10 past the last group
    up = torch.randn(11, 4, generator=g)
    got = grouped_mm_loop(x, w, offs)
    ref = torch._grouped_mm(x, w, offs=offs)
    assert torch.allclose(got[:9], ref[:9], atol=1e-6) and not got[9:].any()
    gx, gw = torch.autograd.grad((got[:9] * up[:9]).sum(), [x, w])
    rx, rw = torch.autograd.grad((ref[:9] * up[:9]).sum(), [x, w])
    assert torch.allclose(gx[:9], rx[:9], atol=1e-6) and not gx[9:].any()  # torch's: undefined past the groups
    assert torch.allclose(gw, rw, atol=1e-6)
    torch.library.opcheck(grouped_mm_loop, (x, w, offs))


@pytest.mark.parametrize("graphed", [False, True])
def test_graphed_statistics_leave_the_replays_memory_after_each_micro_batch(graphed):
    """Under CUDA graphs (train.compile_mode=reduce-overhead) the statistics a forward sums are the graph's
    outputs, in its pool: the next step's replay read them as inputs after overwriting them (on 2 x
    H200: "accessing tensor output of CUDAGraphs that has been overwritten"). train_step copies them out
    after each micro-batch, same values, into the tensors start_stats made, whose addresses the graph
    recorded (a new address each step made the graph record again every step); popping zeroes them in place.
    Ungraphed it leaves them where the forward put them."""
    from teratrain.optim.engine import LocalEngine, train_step

    cfg = make_config("model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2",
                      "model.d_ff=64", "model.vocab_size=50", "model.seq_len=16", "model.moe.num_experts=4")
    model = build_model(cfg.model, dtype=torch.float32)
    layers = moe.moe_layers(model)
    for _, m in layers:
        m.start_stats(torch.device("cpu"), graphed=graphed)
    made = {key: dict(m.stats) for key, m in layers}  # the tensors start_stats made
    written = {}  # what each layer's forward left, by layer
    for key, m in layers:
        m.register_forward_hook(lambda mod, args, out, key=key: written.__setitem__(key, dict(mod.stats)))
    engine = LocalEngine(model, cfg.optim, cfg.memory, 1.0, False)
    x = torch.randint(0, 50, (2, 17))
    train_step(model, engine, [(x[:, :-1], x[:, 1:])] * 2, "fp32", 1e-3)
    popped = {}
    for key, m in layers:
        assert m.stats["forwards"].item() == 2
        for name, value in m.stats.items():
            torch.testing.assert_close(value, written[key][name])
            assert value is (made[key][name] if graphed else written[key][name]), (key, name)
        popped[key] = m.pop_stats()
        assert popped[key]["forwards"].item() == 2 and m.stats["forwards"].item() == 0
        assert not graphed or all(v is made[key][name] for name, v in m.stats.items())
    train_step(model, engine, [(x[:, :-1], x[:, 1:])], "fp32", 1e-3)  # the sums start again from zero
    for key, m in layers:
        assert m.stats["forwards"].item() == 1 and popped[key]["forwards"].item() == 2
        assert not graphed or all(v is made[key][name] for name, v in m.stats.items())


@pytest.mark.parametrize("k, capacity", [(2, 0.0), (3, 0.6)])
def test_compiled_layer_equals_eager_with_gradients(k, capacity):
    """Compiled, the layer sums each token's k expert outputs (combine) and the k gradients of its rows
    (dispatch's backward) as k gathers added elementwise (models/permute.py `_by_choice`), not as a gather
    of all N * k rows reduced over k: the output and every gradient (input, router, experts) equal eager's
    in fp64 (1e-10), nothing dropped and with choices dropped for capacity (zero rows, zero gates)."""
    m = layer(n=4, top_k=k, capacity_factor=capacity)
    x = tokens().requires_grad_()
    up = torch.randn(N, D, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def run(fn):
        out = fn(x)
        grads = torch.autograd.grad((out * up).sum(), [x, *m.parameters()])
        return out.detach(), grads

    ref, ref_grads = run(m)
    got, got_grads = run(torch.compile(m, backend="aot_eager"))
    if capacity:
        assert m.pop_stats()["dropped"] > 0
    assert torch.allclose(got, ref, atol=1e-10)
    for g, r in zip(got_grads, ref_grads):
        assert torch.allclose(g, r, atol=1e-10)
