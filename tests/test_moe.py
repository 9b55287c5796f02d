"""The mixture-of-experts MLP (tricorn/model/moe.py) against a naive per-token reference, in float64."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tricorn.config import ModelConfig
from tricorn.model.moe import MoEMLP, Router, capacity, set_aux_loss_scale, update_expert_bias
from tricorn.model.spec import local_spec
from tricorn.model.transformer import GPTModel, moe_mlp

# float64 throughout: the layer and the reference differ only in summation order, ~1e-15 relative.
TOL = 1e-10


def cfg_for(**kw) -> ModelConfig:
    base = dict(hidden_size=16, ffn_hidden_size=24, num_experts=4, moe_router_topk=2, swiglu=True, disable_bias_linear=True)
    return ModelConfig(**{**base, **kw})


def make(cfg: ModelConfig, seed: int = 0) -> MoEMLP:
    torch.manual_seed(seed)
    layer = moe_mlp(cfg, local_spec()).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.5)
    return layer


def expert_ffn(layer: MoEMLP, e: int, x: torch.Tensor) -> torch.Tensor:
    h = layer.experts.w1[e] @ x
    h = F.silu(h[0::2]) * h[1::2] if layer.experts.swiglu else F.gelu(h)
    return layer.experts.w2[e] @ h


def reference(layer: MoEMLP, x: torch.Tensor, kept_rule=None) -> torch.Tensor:
    """Token by token: scores, top-k, renormalise, weighted sum of the chosen experts' FFNs (plus the shared expert)."""
    cfg_k = layer.router.topk
    tokens = x.reshape(-1, x.shape[-1])
    outs = []
    choices = []
    for t in range(tokens.shape[0]):
        logits = layer.router.weight @ tokens[t]
        if layer.router.score_function == "softmax":
            scores = logits.softmax(-1)
            picked = sorted(range(len(scores)), key=lambda e: -scores[e].item())[:cfg_k]
        else:
            scores = logits.sigmoid()
            bias = layer.router.expert_bias if layer.router.expert_bias is not None else torch.zeros_like(scores)
            picked = sorted(range(len(scores)), key=lambda e: -(scores[e] + bias[e]).item())[:cfg_k]
        weights = scores[picked]
        if cfg_k > 1 or layer.router.score_function == "softmax":
            weights = weights / weights.sum()
        choices.append((picked, weights))
    kept = kept_rule(choices) if kept_rule else {(t, j) for t in range(len(choices)) for j in range(cfg_k)}
    for t, (picked, weights) in enumerate(choices):
        out = torch.zeros_like(tokens[t])
        for j, e in enumerate(picked):
            if (t, j) in kept:
                out = out + weights[j] * expert_ffn(layer, e, tokens[t])
        outs.append(out)
    out = torch.stack(outs).view_as(x)
    if layer.shared_expert is not None:
        out = out + layer.shared_expert(x)
    return out


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"moe_router_topk": 1, "swiglu": False},
        {"moe_shared_expert_intermediate_size": 8},
        {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True},
    ],
)
def test_dropless_matches_per_token_reference(kw):
    cfg = cfg_for(**kw)
    layer = make(cfg)
    if layer.router.expert_bias is not None:
        layer.router.expert_bias.copy_(torch.tensor([0.5, -0.5, 0.2, 0.0]))
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    out = layer(x)
    ref = reference(layer, x)
    torch.testing.assert_close(out, ref, rtol=TOL, atol=TOL)
    g = torch.randn_like(out)
    trained = [x, *(p for p in layer.parameters() if p.requires_grad)]  # not the expert bias
    grads = torch.autograd.grad(out, trained, g)
    ref_grads = torch.autograd.grad(ref, trained, g)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)


def kept_by_capacity(cap: int, policy: str):
    """The capacity rule written out: per expert keep `cap` copies, by probability (ties: earlier token) or by position."""

    def rule(choices):
        per_expert: dict[int, list[tuple]] = {}
        for t, (picked, weights) in enumerate(choices):
            for j, e in enumerate(picked):
                per_expert.setdefault(e, []).append((t, j, weights[j].item()))
        kept = set()
        for copies in per_expert.values():
            if policy == "probs":
                copies = sorted(copies, key=lambda c: -c[2])  # stable: equal probabilities keep token order
            kept |= {(t, j) for t, j, _ in copies[:cap]}
        return kept

    return rule


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("factor", [0.5, 1.0, 1.3])
def test_capacity_dropping_follows_the_rule(policy, factor):
    cfg = cfg_for(moe_expert_capacity_factor=factor, moe_token_drop_policy=policy)
    layer = make(cfg)
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    cap = capacity(14, 2, 4, factor)
    assert cap == math.ceil(14 * 2 / 4 * factor)
    out = layer(x)
    torch.testing.assert_close(out, reference(layer, x, kept_by_capacity(cap, policy)), rtol=TOL, atol=TOL)
    # Dropped copies: exactly the excess of each expert over its capacity.
    stats = layer.router.read_stats()
    tokens, dropped = stats[:4], stats[4]
    expected = sum(max(0, int(n) - cap) for n in tokens.tolist())
    assert int(dropped) == expected
    if factor == 0.5:
        assert expected > 0  # the case really drops


def test_aux_loss_value_and_gradient():
    cfg = cfg_for(moe_aux_loss_coeff=0.1)
    layer = make(cfg)
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    scores = (x.reshape(-1, 16) @ layer.router.weight.T).softmax(-1)
    counts = torch.bincount(scores.topk(2, -1).indices.flatten(), minlength=4).double()
    t = scores.shape[0]
    expected_aux = 0.1 * 4 / (t * t * 2) * (scores.sum(0) * counts).sum()  # Switch / Megatron aux_loss
    routing = layer.router(x.reshape(-1, 16))
    torch.testing.assert_close(routing.aux_loss, expected_aux, rtol=TOL, atol=TOL)
    # Backward adds the aux loss gradient times the weight set by the training step, without changing the output.
    set_aux_loss_scale(torch.tensor(0.25))
    try:
        out = layer(x)
        torch.testing.assert_close(out, reference(layer, x), rtol=TOL, atol=TOL)
        (g,) = torch.autograd.grad(out.sum(), layer.router.weight)
        ref_out = reference(layer, x).sum() + 0.25 * layer.router(x.reshape(-1, 16)).aux_loss
        (g_ref,) = torch.autograd.grad(ref_out, layer.router.weight)
        torch.testing.assert_close(g, g_ref, rtol=TOL, atol=TOL)
    finally:
        set_aux_loss_scale(torch.tensor(1.0))


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_sequence_shards_add_up_to_the_whole_sequence(score):
    """Under SP each TP rank routes its sequence shard: with the whole sequence's counts (spec.sequence_sum) the
    shards' outputs are the layer's, their aux losses and router / expert gradients add up to the layer's."""
    import dataclasses

    cfg = cfg_for(moe_aux_loss_coeff=0.1, moe_router_score_function=score)
    layer = make(cfg)
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    whole = layer.router(x.reshape(-1, 16)).tokens_per_expert
    spec = dataclasses.replace(local_spec(), sequence_shards=2, sequence_sum=lambda counts: whole.clone())
    shard_layer = moe_mlp(cfg, spec).double()
    shard_layer.load_state_dict(layer.state_dict())
    params = [layer.router.weight, layer.experts.w1, layer.experts.w2]
    assert all(getattr(p, "sequence_parallel", False) for p in shard_layer.parameters())  # grads.py sums them over TP
    assert not any(hasattr(p, "sequence_parallel") for p in layer.parameters())
    set_aux_loss_scale(torch.tensor(0.25))
    try:
        out = layer(x)
        grads = torch.autograd.grad(out.sum(), params)
        aux, shard_grads = 0.0, [torch.zeros_like(p) for p in params]
        for shard in x.chunk(2, dim=1):
            shard_out = shard_layer(shard)
            torch.testing.assert_close(shard_out, reference(layer, shard), rtol=TOL, atol=TOL)
            aux = aux + shard_layer.router(shard.reshape(-1, 16)).aux_loss
            shard_params = [shard_layer.router.weight, shard_layer.experts.w1, shard_layer.experts.w2]
            for acc, g in zip(shard_grads, torch.autograd.grad(shard_out.sum(), shard_params)):
                acc += g
    finally:
        set_aux_loss_scale(torch.tensor(1.0))
    torch.testing.assert_close(aux, layer.router(x.reshape(-1, 16)).aux_loss, rtol=TOL, atol=TOL)
    for g, want in zip(shard_grads, grads):
        torch.testing.assert_close(g, want, rtol=TOL, atol=TOL)


def test_expert_tensor_parallel_slices_add_up_to_the_layer():
    """--expert-tensor-parallel-size 2 in one process (the TP hooks as identities, their sum done here): each rank's
    experts are its w1 rows / w2 columns of every expert, initialised by global name; the two ranks' partial
    outputs add up to the layer's, and their expert gradients are the slices of the layer's (TP shards: not summed
    over TP). SP's gathered routing runs in the 4-rank test (test_moe_parallel.py)."""
    import dataclasses

    from tricorn.model.init import InitSpec, expert_tp_info, is_tp_split

    cfg = cfg_for(moe_ffn_hidden_size=12)
    init = InitSpec(seed=3, std=0.5, num_layers=1)
    x = torch.randn(2, 6, 16, dtype=torch.float64)

    def build(spec):
        layer = moe_mlp(cfg, spec)
        for name, p in layer.named_parameters():  # every value from its global name, as the trainer does
            p.data = init.value(name, p, p.device).double()
        return layer

    whole = build(local_spec())
    out = whole(x)
    grads = torch.autograd.grad(out.sum(), [whole.experts.w1, whole.experts.w2])
    identity = lambda t: t  # noqa: E731 - one process: the same tokens on both "ranks", outputs summed below
    total, slices = torch.zeros_like(out), []
    for rank in range(2):
        spec = dataclasses.replace(
            local_spec(), expert_tensor_parallel=(rank, 2), expert_tp_enter=identity, expert_tp_exit=identity
        )
        layer = build(spec)
        w1, w2 = layer.experts.w1, layer.experts.w2
        assert is_tp_split(w1) and expert_tp_info(w2).dim == 1 and w1.shape == (4, 12, 16) and w2.shape == (4, 16, 6)
        assert not is_tp_split(layer.router.weight)  # the router stays TP-replicated
        assert torch.equal(w1, whole.experts.w1[:, rank * 12 : (rank + 1) * 12])  # whole gate/up pairs
        assert torch.equal(w2, whole.experts.w2[:, :, rank * 6 : (rank + 1) * 6])
        part = layer(x)
        total = total + part
        slices.append(torch.autograd.grad(part.sum(), [w1, w2]))
    torch.testing.assert_close(total, out, rtol=TOL, atol=TOL)
    torch.testing.assert_close(torch.cat([s[0] for s in slices], 1), grads[0], rtol=TOL, atol=TOL)
    torch.testing.assert_close(torch.cat([s[1] for s in slices], 2), grads[1], rtol=TOL, atol=TOL)


def test_expert_bias_update_moves_towards_mean_load():
    router = Router(cfg_for(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True))
    update_expert_bias(router, torch.tensor([8.0, 2.0, 5.0, 5.0]), rate=0.01)
    torch.testing.assert_close(router.expert_bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))


def test_layer_freq_picks_moe_layers_and_names_are_global():
    cfg = cfg_for(num_layers=4, moe_layer_freq=2, vocab_size=50, num_attention_heads=4, seq_length=8)
    model = GPTModel(cfg)
    kinds = [type(model.layers[str(i)].mlp).__name__ for i in range(4)]
    assert kinds == ["MoEMLP", "MLP", "MoEMLP", "MLP"]
    names = dict(model.named_parameters())
    assert names["layers.0.mlp.experts.w1"].shape == (4, 48, 16)
    assert names["layers.2.mlp.experts.w2"].shape == (4, 16, 24)
    model.init_weights(seed=3)
    w2 = names["layers.0.mlp.experts.w2"]
    # Residual-output projections get Megatron's 1/sqrt(2L) init like the dense w2.
    assert abs(w2.std().item() - 0.02 / math.sqrt(8)) < 0.003
    tokens = torch.randint(0, 50, (2, 8))
    assert model(tokens, tokens).shape == (2, 8)


def test_recomputed_forward_counts_tokens_once():
    layer = make(cfg_for())
    x = torch.randn(2, 4, 16, dtype=torch.float64, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
    out.sum().backward()
    stats = layer.router.read_stats()
    assert stats[:4].sum().item() == 2 * 4 * 2 and stats[-1].item() == 1  # one forward of 8 tokens x top-2


def test_flops_and_params_count_active_experts():
    from tricorn.config import PRESETS
    from tricorn.planning import flops
    from tricorn.planning.memory import active_params, total_params

    # Mixtral 8x7B as published: 46.7 B parameters, 12.9 B active per token.
    mixtral = ModelConfig(**PRESETS["mixtral-8x7b"])
    assert round(total_params(mixtral) / 1e9, 1) == 46.7 and round(active_params(mixtral) / 1e9, 1) == 12.9
    cfg = cfg_for(
        num_layers=2, moe_layer_freq=2, vocab_size=64, make_vocab_size_divisible_by=64, seq_length=8,
        num_attention_heads=4, moe_shared_expert_intermediate_size=8, untie_embeddings_and_output_weights=True,
    )  # fmt: skip
    model = GPTModel(cfg)
    model.init_weights(seed=1)
    assert sum(p.numel() for p in model.parameters()) == total_params(cfg)
    tokens = torch.randint(0, 64, (3, 8))
    counted = flops.count_matmul_flops(lambda: model(tokens, tokens).sum().backward())
    f = flops.iteration_flops(cfg, 3, vocab_size=64)
    # Exact integer counts summed in float64 in two orders (dropless: exactly k copies per token).
    assert counted == pytest.approx(f.hardware, rel=1e-12)


@pytest.mark.parametrize(
    "flags,message",
    [
        ("--num-experts 2 --moe-router-topk 3", "--moe-router-topk 3 exceeds --num-experts 2"),
        ("--num-experts 2 --moe-router-topk 1", "--num-experts needs --disable-bias-linear"),
        ("--moe-aux-loss-coeff 0.01", "--moe-* flags and --expert-model-parallel-size need --num-experts"),
        ("--num-experts 3 --disable-bias-linear --expert-model-parallel-size 2", "--num-experts 3 is not divisible by"),
        ("--num-experts 4 --disable-bias-linear --expert-model-parallel-size 4", "must divide DP x CP = 2"),
        ("--num-experts 2 --disable-bias-linear --moe-expert-capacity-factor 0", "--moe-expert-capacity-factor must be"),
        # Expert TP is 1 (replicated over TP) or TP (Megatron's semantics); other splits are refused.
        (
            "--num-experts 2 --disable-bias-linear --expert-tensor-parallel-size 2",
            "--expert-tensor-parallel-size 2 is not supported",
        ),
        ("--expert-tensor-parallel-size 2 --tensor-model-parallel-size 2", "--expert-tensor-parallel-size needs --num-experts"),
        (
            "--num-experts 2 --disable-bias-linear --tensor-model-parallel-size 2 --expert-tensor-parallel-size 2 "
            "--moe-ffn-hidden-size 33",
            "--moe-ffn-hidden-size 33 is not divisible by --expert-tensor-parallel-size 2",
        ),
    ],
)
def test_bad_moe_flags_are_one_line(flags, message):
    from tricorn.config_args import config_from_args
    from tricorn.validation import validate

    argv = ["--mock-data", "--vocab-size", "100", "--device", "cpu", *flags.split()]
    try:
        errs = validate(config_from_args(argv, world_size=2))
    except Exception as e:  # range errors are raised while parsing
        errs = [str(e)]
    assert any(message in e for e in errs), errs


def test_planning_counts_expert_parallel_params_and_all_to_all_volume():
    import dataclasses

    from tricorn.config import PRESETS
    from tricorn.planning.layout import Layout
    from tricorn.planning.memory import estimate, expert_params, stage_params_per_rank
    from tricorn.planning.step_time import ep_all_to_all_bytes, ep_rows_per_token

    mixtral = ModelConfig(**PRESETS["mixtral-8x7b"])
    one, four = (stage_params_per_rank(mixtral, Layout(ep=ep, dp=4), 0, 32) for ep in (1, 4))
    assert one - four == 32 * 6 * expert_params(mixtral)  # each rank keeps 2 of the 8 experts of every layer
    # The distributed optimizer shards the experts over expert-DP = DP / EP = 1 here: their state is unsharded.
    lay = Layout(ep=4, dp=4, zero_stage=1, precision="bf16")
    dense_part = four - 32 * 2 * expert_params(mixtral)
    assert estimate(mixtral, lay).optimizer_state_bytes == 8 * (dense_part / 4 + 32 * 2 * expert_params(mixtral))
    # A token goes once to each other rank holding one of its experts. EP = E = 8: its two experts are on two
    # ranks, one of them this one 1/4 of the time: 2 - 1/4 = 7/4 rows. EP 4: 3 x (1 - C(6,2)/C(8,2)) = 39/28.
    assert ep_rows_per_token(mixtral, 8) == pytest.approx(7 / 4) and ep_rows_per_token(mixtral, 4) == pytest.approx(39 / 28)
    # Per row: 4 transfers (dispatch, combine; forward and backward) of h bf16, 2 of E/EP fp32 weights.
    row = 4 * 4096 * 2 + 2 * 4 * 1
    assert ep_all_to_all_bytes(mixtral, Layout(ep=8, dp=8, precision="bf16"), 4096) == pytest.approx(4096 * 7 / 4 * row)
    assert ep_all_to_all_bytes(mixtral, Layout(ep=1), 4096) == 0.0
    # Under SP each TP rank dispatches only its half of the sequence.
    sp = Layout(tp=2, ep=8, dp=8, precision="bf16", sequence_parallel=True)
    assert ep_all_to_all_bytes(mixtral, sp, 4096) == pytest.approx(4096 / 2 * 7 / 4 * row)
    # Expert TP (ETP = TP = 2): each rank holds half of each of its experts and dispatches the gathered sequence.
    etp = Layout(tp=2, ep=4, dp=4, etp=2, sequence_parallel=True)
    assert stage_params_per_rank(mixtral, Layout(tp=2, ep=4, dp=4), 0, 32) - stage_params_per_rank(mixtral, etp, 0, 32) == (
        32 * 2 * expert_params(mixtral) // 2
    )
    assert ep_all_to_all_bytes(mixtral, dataclasses.replace(sp, etp=2), 4096) == pytest.approx(4096 * 7 / 4 * row)


def test_planner_searches_expert_parallelism_with_valid_flags():
    from tricorn.config import PRESETS
    from tricorn.config_args import config_from_args
    from tricorn.planning import planner, sbatch
    from tricorn.planning.hardware import get_gpu
    from tricorn.planning.step_time import Cluster
    from tricorn.validation import validate

    mixtral = ModelConfig(**PRESETS["mixtral-8x7b"])
    gpu = get_gpu("h100-80gb")
    cluster = Cluster(64, 8, gpu, gpu.peak_tflops("bf16"), 0.10)
    result = planner.plan(mixtral, cluster, 256, top_k=20)
    assert result.plans and any(p.layout.ep > 1 for p in result.plans)
    # The best plans here are TP1; the searched TP2 x EP layouts run with SP, as dense models do.
    tp2 = next(lay for group in planner.layout_groups(mixtral, cluster, 256) for lay in group if lay.tp == 2 and lay.ep > 1)
    assert tp2.sequence_parallel
    for lay in [p.layout for p in result.plans] + [tp2]:  # no ZeRO-2/3 with EP: every layout is one the trainer runs
        flags = sbatch.model_args("mixtral-8x7b", mixtral) + sbatch.layout_args(lay, 256) + ["--mock-data", "--bf16"]
        assert validate(config_from_args(flags, world_size=64)) == [], flags


def test_grouped_gemm_matches_the_loop():
    """torch's grouped matmul (used on CUDA) and the loop agree; checked here through its CPU forward."""
    from tricorn.model.moe import expert_gemm

    x, w = torch.randn(10, 16), torch.randn(3, 8, 16)
    counts = [4, 0, 6]  # an expert with no tokens too
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    # fp32 GEMMs of the same products, blocked differently: a few ulps of values ~4.
    torch.testing.assert_close(expert_gemm(x, w, [], ends), expert_gemm(x, w, counts, None), rtol=1e-5, atol=1e-5)


def test_bf16_layer_routes_in_fp32():
    import copy

    layer = make(cfg_for(moe_aux_loss_coeff=0.01)).to(torch.bfloat16)
    x = torch.randn(2, 5, 16, dtype=torch.float64).to(torch.bfloat16)
    ref = reference(copy.deepcopy(layer).double(), x.double())  # the same bf16 values, in float64
    out = layer(x)
    assert out.dtype == torch.bfloat16
    # bf16 keeps 8 bits of mantissa: the expert GEMMs' bf16 intermediates err by a few 2^-8 relative.
    torch.testing.assert_close(out.double(), ref, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize(
    "kw,dtype",
    [
        ({}, torch.float32),
        ({"moe_router_score_function": "sigmoid", "moe_aux_loss_coeff": 0.01}, torch.float32),
        ({"moe_router_topk": 1, "moe_router_score_function": "sigmoid", "swiglu": False}, torch.float32),
        ({"moe_shared_expert_intermediate_size": 8, "moe_aux_loss_coeff": 0.01}, torch.bfloat16),
        ({}, torch.bfloat16),
    ],
    ids=["softmax", "sigmoid-aux", "sigmoid-k1-gelu", "shared-bf16", "bf16"],
)
def test_activation_formula_counts_what_the_moe_layer_saves(kw, dtype):
    """planning/activations.py's MoE term against the saved-tensor probe, byte for byte (dropless: T x k copies)."""
    from tricorn.planning.activations import layer_activation_bytes
    from tricorn.training.activation_probe import ActivationProbe

    cfg = cfg_for(num_layers=2, vocab_size=50, num_attention_heads=4, seq_length=16, **kw)
    torch.manual_seed(0)
    model = GPTModel(cfg, padded_vocab_size=64)
    model.init_weights(seed=1)
    model.to(dtype)
    tokens = torch.randint(0, 50, (2, 16))
    with ActivationProbe([model]) as probe:
        model(tokens, tokens).float().mean().backward()
    precision = "fp32" if dtype == torch.float32 else "bf16"
    formula = layer_activation_bytes(cfg, seq=16, micro_batch=2, precision=precision, device="cpu")
    assert probe.summary().activation_bytes_per_layer == formula


@pytest.mark.parametrize(
    "layout",
    [
        "--pipeline-model-parallel-size 2 --expert-model-parallel-size 4",
        "--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 4",
        "--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 4 --expert-tensor-parallel-size 2",
        "--pipeline-model-parallel-size 2 --expert-model-parallel-size 4 --pipeline-schedule zb-h1",
    ],
    ids=["ep4-pp2", "tp2-sp-ep4", "tp2-sp-ep4-etp2", "ep4-pp2-zb-h1"],
)
def test_simulate_builds_only_local_experts_and_matches_the_estimate(layout):
    """tricorn simulate at Mixtral's size (4 of its 32 layers) with EP4 x PP2, and TP2 x EP4 under SP (the experts
    take a sequence shard), also with expert TP (each expert split over TP, the gathered sequence through it):
    each rank builds 2 of the 8 experts of its layers, and the estimator says what the run allocates
    (test_simulate.py's bound). Under zb-h1 the loop of expert GEMMs keeps its rows and output gradients from B to
    W (planning/zero_bubble_memory.py), and its B keeps the SwiGLU output its W needs."""
    from tricorn.simulate import KEYS, config_for_simulation, default_ranks, ratio, simulate

    flags = "--model-preset mixtral-8x7b --num-layers 4 --bf16 --use-distributed-optimizer --micro-batch-size 1"
    flags += " --global-batch-size 8 " + layout
    cfg = config_for_simulation(flags.split(), 8)
    for r in simulate(cfg, default_ranks(cfg), iters=1):
        for key in KEYS:
            q = ratio(r["estimated"][key], r["measured"][key])
            assert 0.95 <= q <= 1.05, f"rank {r['rank']} {key}: estimated/measured {q:.3f}"
        # AdamW's 4-byte step counters are all that the steady-state estimate leaves out (1e-6).
        assert r["measured"]["model_state_bytes"] == pytest.approx(r["estimated"]["model_state_bytes"], rel=1e-6)
