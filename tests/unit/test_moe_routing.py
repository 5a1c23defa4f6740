"""The softmax-topk router's options against written-out references of their papers' equations
(per-token loops in fp64 on fixed inputs): sigmoid scores and norm_topk, the expert bias of
auxiliary-loss-free balancing (DeepSeek-V3 sec. 2.1.2) and its update, the router z-loss (ST-MoE
eq. 5), the sequence-wise balance loss (DeepSeek-V3 eq. 17-20), shared experts with and without
Qwen2-MoE's gate, fine-grained experts, first dense layers, DeepSeek-V3's group-limited routing, and
the refused combinations.
Tolerance: 1e-12 relative on weights, 1e-10 on losses (fp64), assert_close's fp64 default on outputs."""

import math

import pytest
import torch
import torch.nn.functional as F

from teratrain.config import ConfigError
from teratrain.models import moe
from teratrain.models.transformer import build_model, count_params
from teratrain.parallel import ep_plan
from tests.helpers import expert_out, make_config, model_config
from tests.unit.test_moe import D, N, check, layer, logits, ranked, softmax, tokens


def sigmoid(v: list[float]) -> list[float]:
    return [1 / (1 + math.exp(-a)) for a in v]


@pytest.mark.parametrize("score, norm", [("softmax", False), ("sigmoid", True), ("sigmoid", False)])
def test_scores_choices_and_gate_weights(score, norm):
    """s = softmax or sigmoid of x W_r; the k largest; gates s_e, or s_e / sum of the chosen (norm_topk).
    aux: n sum_e f_e P_e with P_e the mean of s_e / sum_j s_j (DeepSeek-V3 eq. 19's s')."""
    m, x = layer(n=5, score=score, norm_topk=norm, top_k=3, aux_loss_weight=0.2), tokens()
    S = [(softmax if score == "softmax" else sigmoid)(v) for v in logits(m.router.weight, x)]
    experts = [ranked(s)[:3] for s in S]
    weights = [[s[e] / (sum(s[c] for c in ch) if norm else 1) for e in ch] for s, ch in zip(S, experts)]
    f = [sum(e.count(i) for e in experts) / (3 * N) for i in range(5)]
    aux = 5 * sum(f[i] * sum(s[i] / sum(s) for s in S) / N for i in range(5))
    check(m.router(x), experts, weights, [[True] * 3] * N, aux, 0.2)


def test_default_keeps_mixtrals_renormalised_softmax():
    """Unset norm_topk is true: the chosen softmax probabilities divided by their sum (as before)."""
    a, b = layer(n=4, seed=3), layer(n=4, seed=3, norm_topk=True)
    x = tokens()
    ra, rb = a.router(x), b.router(x)
    assert torch.equal(ra.experts, rb.experts) and torch.equal(ra.weights, rb.weights)
    torch.testing.assert_close(ra.weights.sum(-1), torch.ones(N, dtype=torch.float64))


def test_expert_bias_moves_the_choice_not_the_gates():
    """DeepSeek-V3 eq. 16: the top-k of s + b; the gates are s of the chosen, normalized."""
    m, x = layer(n=6, score="sigmoid", balance="bias", top_k=2), tokens()
    bias = torch.tensor([0.5, -0.5, 0.0, 0.3, -0.2, 0.1], dtype=torch.float64)
    m.router.expert_bias.copy_(bias)
    S = [sigmoid(v) for v in logits(m.router.weight, x)]
    experts = [ranked([s[i] + bias[i].item() for i in range(6)])[:2] for s in S]
    weights = [[s[e] / (s[a] + s[b]) for e in (a, b)] for s, (a, b) in zip(S, experts)]
    assert experts != [ranked(s)[:2] for s in S], "the bias must change some choice"
    check(m.router(x), experts, weights, [[True] * 2] * N, 0.0, 0.0)  # balance=bias: aux weight 0


def test_bias_update_is_rate_times_sign_of_mean_load_minus_load():
    m = layer(n=4, balance="bias", bias_rate=0.25)
    before = torch.tensor([0.1, 0.0, -0.1, 0.2], dtype=torch.float64)
    m.router.expert_bias.copy_(before)
    m.update_bias(torch.tensor([7.0, 1.0, 4.0, 4.0], dtype=torch.float64))  # mean 4
    assert m.router.expert_bias.tolist() == pytest.approx([0.1 - 0.25, 0.25, -0.1, 0.2], rel=1e-12)
    assert not m.router.expert_bias.requires_grad and "router.expert_bias" not in dict(m.named_parameters())
    assert "router.expert_bias" in m.state_dict()  # a buffer: saved, never stepped by the optimizer


def test_bias_balance_defaults_the_aux_weight_to_zero_unless_given():
    assert make_config("model.moe.num_experts=4", "model.moe.balance=bias").model.moe.aux_loss_weight == 0.0
    cfg = make_config("model.moe.num_experts=4", "model.moe.balance=bias", "model.moe.aux_loss_weight=0.1")
    assert cfg.model.moe.aux_loss_weight == 0.1


@pytest.mark.parametrize("router", ["softmax-topk", "switch-top1", "gshard-top2"])
def test_z_loss_is_the_mean_squared_logsumexp(router):
    m, x = layer(n=4, router=router, aux_loss_weight=0.0, z_loss_weight=0.05), tokens()
    z = sum(math.log(sum(math.exp(a) for a in v)) ** 2 for v in logits(m.router.weight, x)) / N
    assert m.router(x).aux_loss.item() == pytest.approx(0.05 * z, rel=1e-10)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_sequence_wise_balance_loss(score):
    """DeepSeek-V3 eq. 17-20 per sequence of T tokens, averaged over the sequences:
    f_i = n / (k T) sum_t 1(i chosen at t), P_i = (1/T) sum_t s_it / sum_j s_jt, loss = sum_i f_i P_i."""
    m, x = layer(n=4, score=score, aux_loss_kind="sequence", aux_loss_weight=1.0), tokens()
    S = [(softmax if score == "softmax" else sigmoid)(v) for v in logits(m.router.weight, x)]
    B, T, k, n = 3, N // 3, 2, 4
    total = 0.0
    for b in range(B):
        seq = S[b * T:(b + 1) * T]
        f = [n / (k * T) * sum(i in ranked(s)[:k] for s in seq) for i in range(n)]
        P = [sum(s[i] / sum(s) for s in seq) / T for i in range(n)]
        total += sum(fi * pi for fi, pi in zip(f, P))
    assert m.router(x, seq_len=T).aux_loss.item() == pytest.approx(total / B, rel=1e-10)
    m.train()
    m(x.view(B, T, D))
    assert m.aux_loss.item() == pytest.approx(total / B, rel=1e-10)  # the layer passes its sequences


def group_limited(c: list[float], groups: int, kept: int, k: int) -> list[int]:
    """DeepSeek-V3's node-limited choice for one token of choice scores c: the experts in `groups`
    consecutive groups, a group scored by the sum of its 2 best c; the top k of the `kept` best groups."""
    size = len(c) // groups
    group_score = [sum(sorted(c[g * size:(g + 1) * size])[-2:]) for g in range(groups)]
    best = ranked(group_score)[:kept]
    return ranked([v if i // size in best else -math.inf for i, v in enumerate(c)])[:k]


@pytest.mark.parametrize("score, bias", [("softmax", False), ("sigmoid", True)])
def test_group_limited_routing_chooses_within_the_best_groups(score, bias):
    """12 experts in 3 groups of 4, top-3 within the 2 best groups, a group's score the sum of its 2
    best choice scores (s, or s + b under bias balance); the gates s of the chosen, normalized; the
    aux loss over the chosen experts as before."""
    n, G, M, k = 12, 3, 2, 3
    keys = dict(balance="bias") if bias else {}
    m, x = layer(n=n, score=score, top_k=k, expert_groups=G, max_groups=M, aux_loss_weight=0.2, **keys), tokens()
    b = [0.3 * math.sin(3 * i) for i in range(n)] if bias else [0.0] * n
    if bias:
        m.router.expert_bias.copy_(torch.tensor(b, dtype=torch.float64))
    S = [(softmax if score == "softmax" else sigmoid)(v) for v in logits(m.router.weight, x)]
    C = [[s[i] + b[i] for i in range(n)] for s in S]
    experts = [group_limited(c, G, M, k) for c in C]
    weights = [[s[e] / sum(s[j] for j in ch) for e in ch] for s, ch in zip(S, experts)]
    f = [sum(e.count(i) for e in experts) / (k * N) for i in range(n)]
    aux = n * sum(f[i] * sum(s[i] / sum(s) for s in S) / N for i in range(n))
    check(m.router(x), experts, weights, [[True] * k] * N, aux, 0.2)
    assert experts != [ranked(c)[:k] for c in C], "the group limit must change some choice"
    best_one = [ranked([max(c[g * 4:(g + 1) * 4]) for g in range(G)])[:M] for c in C]  # DeepSeek-V2's score
    assert any({e // 4 for e in ch} - set(g) for ch, g in zip(experts, best_one)), "top-2 sum must differ from max"


def test_expert_groups_without_a_limit_route_as_before():
    """max_groups unset keeps every group: the same choices and gates as the plain router."""
    a, b, x = layer(n=8, seed=4, expert_groups=4), layer(n=8, seed=4), tokens()
    ra, rb = a.router(x), b.router(x)
    assert torch.equal(ra.experts, rb.experts) and torch.equal(ra.weights, rb.weights)


def test_at_ep_equal_to_the_groups_a_token_reaches_at_most_max_groups_ranks():
    """Expert parallelism at ep = expert_groups holds one group per rank (ep_plan.local_experts), so
    each token's choices are sent to at most max_groups ranks; without the limit some reach more."""
    n, G, M, k = 12, 3, 1, 3
    x = tokens()
    rank_of = {e: r for r in range(G) for e in ep_plan.local_experts(n, G, r)}
    limited = layer(n=n, top_k=k, expert_groups=G, max_groups=M).router(x).experts.tolist()
    free = layer(n=n, top_k=k).router(x).experts.tolist()
    assert max(len({rank_of[e] for e in ch}) for ch in limited) == M
    assert max(len({rank_of[e] for e in ch}) for ch in free) > M


def swiglu(w1, w3, w2, x):
    return (F.silu(x @ w1.t()) * (x @ w3.t())) @ w2.t()


@pytest.mark.parametrize("gated", [False, True])
def test_shared_experts_add_to_the_routed_output(gated):
    """y = routed + sum_s E_s(x) (DeepSeek-MoE), or routed + sigmoid(x w_g) E(x) (Qwen2-MoE); two shared
    experts of width 3 are one MLP of width 6 whose halves are the experts."""
    m = layer(n=4, expert_d_ff=4, shared_experts=2, shared_d_ff=3, shared_gate=gated)
    x = tokens()
    r = m.router(x)
    sh = m.shared_expert
    assert m.experts.w1.shape == (4, 4, D) and sh.w1.weight.shape == (6, D)
    y = m(x.view(1, N, D)).view(N, D)
    for t in range(N):
        xt = x[t:t + 1]
        routed = sum(r.weights[t, j] * expert_out(m.experts, int(r.experts[t, j]), xt)[0] for j in range(2))
        shared = sum(swiglu(sh.w1.weight[h], sh.w3.weight[h], sh.w2.weight[:, h], xt)[0] for h in (slice(0, 3), slice(3, 6)))
        if gated:
            shared = shared * torch.sigmoid(xt @ m.shared_expert_gate.weight.t())[0]
        torch.testing.assert_close(y[t], routed + shared)


def test_first_dense_layers_compose_with_every():
    cfg = model_config(n_layers=8, moe=dict(num_experts=4, every=2, first_dense_layers=3))
    assert [cfg.moe.is_moe_layer(i) for i in range(8)] == [False, False, False, True, False, True, False, True]
    model = build_model(cfg)
    assert [isinstance(b.feed_forward, moe.MoE) for b in model.layers.values()] == [cfg.moe.is_moe_layer(i) for i in range(8)]


@pytest.mark.parametrize("keys", [dict(expert_d_ff=24, shared_experts=2), dict(shared_experts=1, shared_d_ff=40, shared_gate=True),
                                  dict(expert_d_ff=16, shared_experts=1, first_dense_layers=1, arch="gpt2")], ids=str)
def test_count_params_with_fine_grained_and_shared_experts(keys):
    arch = keys.pop("arch", "llama")
    cfg = model_config(arch=arch, moe=dict(num_experts=4, **keys))
    model = build_model(cfg)
    c = count_params(cfg)
    assert c["total"] == sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert c["expert"] == routed and c["total"] - c["active"] == routed // 2  # top-2 of 4: half the experts idle


@pytest.mark.parametrize("sets, words", [
    (["model.moe.router=switch-top1", "model.moe.score=sigmoid"], "model.moe.score"),
    (["model.moe.router=noisy-topk", "model.moe.balance=bias"], "model.moe.balance"),
    (["model.moe.router=gshard-top2", "model.moe.norm_topk=false"], "model.moe.norm_topk"),
    (["model.moe.router=hierarchical", "model.moe.num_experts=8", "model.moe.z_loss_weight=0.001"], "z_loss_weight"),
    (["model.moe.score=sigmoid", "model.moe.aux_loss_convention=transformers"], "aux_loss_convention"),
    (["model.moe.shared_gate=true"], "shared_experts"),
    (["model.moe.num_experts=4", "model.n_layers=2", "model.moe.first_dense_layers=2"], "first_dense_layers"),
    (["model.moe.router=switch-top1", "model.moe.expert_groups=2"], "model.moe.expert_groups"),
    (["model.moe.expert_groups=3"], "model.moe.expert_groups"),
    (["model.moe.expert_groups=2", "model.moe.max_groups=3"], "model.moe.max_groups"),
    (["model.moe.expert_groups=4", "model.moe.max_groups=1", "model.moe.top_k=3"], "model.moe.top_k"),
])
def test_bad_combinations_are_one_sentence(sets, words):
    with pytest.raises(ConfigError) as e:
        make_config("model.moe.num_experts=8", *sets)
    assert words in str(e.value) and "\n" not in str(e.value)
