"""The Synthesizer family on one process: causality, fused == reference, the paper's formulas, overfitting."""
import pytest
import torch
from torch.profiler import profile

from model import ConfigError, ModelConfig, build_model, variants
from model.kernels import causal_mask

VARIANTS = variants.subset("all")   # every registered mixer, gMLP, and mixtures of every fused form
L = 16


def config(variant, impl="fused", **kw) -> ModelConfig:
    extra = variants.model_fields(variant)
    # Large inits so that maps are far from uniform and every weight visibly matters.
    base = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=L, factorized_k=4, init_std=0.3,
                random_init_std=1.0, sgu_init_eps=4.0 * L, impl=impl, seed=3)
    return ModelConfig(**{**base, **extra, **kw})


def tokens(B, n, seed=0):
    return torch.randint(0, 64, (B, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("impl", ["fused", "reference"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_causal(variant, impl):
    model = build_model(config(variant, impl)).eval()
    x = tokens(2, L)
    for t in (0, 5, L - 2):
        y = x.clone()
        y[:, t + 1:] = (y[:, t + 1:] + 1 + torch.arange(L - t - 1)) % 64   # change every later token
        a, b = model(x), model(y)
        assert (a[:, :t + 1] - b[:, :t + 1]).abs().max() <= 1e-6, f"position ≤ {t} saw the future"
        assert (a[:, t + 1:] - b[:, t + 1:]).abs().max() > 1e-4   # and later positions do see the change


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_shorter_row_is_read_as_the_first_positions_of_max_seq_len(variant):
    """A data stage of seq_len n < L (data.stages[i].seq_len) trains rows of n: each variant reads them as positions
    0 … n − 1 of L (its position-indexed weights sliced: the dense synthesizer's F2 output, the random maps, the
    SGU's W, the learned positions), the logits those of the first n positions of a row of L."""
    model = build_model(config(variant)).eval()
    x = tokens(2, L)
    with torch.no_grad():
        whole = model(x)
        for n in (L // 2, L // 4):
            assert (model(x[:, :n]) - whole[:, :n]).abs().max() <= 1e-5, n


@pytest.mark.parametrize("n", [11, L])
@pytest.mark.parametrize("variant", VARIANTS)
def test_fused_matches_reference(variant, n):
    assert_fused_matches_reference(variant, n)


def assert_fused_matches_reference(variant, n, x=None, **kw):
    """The fused path (this machine's, or the GPU one under SYNTHFORMER_KERNELS=gpu) against the materialized
    reference: logits and every gradient to 1e-5 (on tokens x (B, n + 1), default random; `kw`: config fields)."""
    fused, ref = build_model(config(variant, "fused", **kw)), build_model(config(variant, "reference", **kw))
    ref.load_state_dict(fused.state_dict())                     # same names: a state dict moves between them
    x = tokens(3, n + 1) if x is None else x
    out = {}
    for name, m in (("fused", fused), ("reference", ref)):
        logits = m(x[:, :-1])
        m(x[:, :-1], x[:, 1:]).backward()
        out[name] = logits, {k: p.grad for k, p in m.named_parameters() if p.grad is not None}
    (lf, gf), (lr, gr) = out["fused"], out["reference"]
    assert (lf - lr).abs().max() <= 1e-5
    assert gf.keys() == gr.keys() and len(gf) > 0
    for k in gf:
        assert (gf[k] - gr[k]).abs().max() <= 1e-5, k


@pytest.mark.parametrize("variant", VARIANTS)
def test_fused_in_bf16_matches_the_fp32_reference(variant):
    assert_bf16_fused_close_to_fp32_reference(variant, tokens(3, 12), "cpu")


def assert_bf16_fused_close_to_fp32_reference(variant, x, device, floor=0.01):
    """What a bf16 run computes (DeepSpeed keeps the module in bf16): the fused kernels in bf16 against the
    materialized formula in fp32. Stated tolerance, from bf16's 8-bit mantissa through 2 layers: logits within 5%
    of their largest magnitude, each parameter's gradient within 25% of its largest (floored at `floor` of the
    largest gradient in the model, for gradients that are exactly 0 in exact arithmetic, like a key bias's) — or,
    where the formula itself run in bf16 is further off (an ill-conditioned gradient: factorized_dense's first W_1
    at n 12 is 38% off so), within 1.5× that. A formula error (a missing mask, swapped factors) is off by 100% or
    more. Measured on the CPU at n 11: at most 3.3% and 15%."""
    out = {}
    for name, impl, dtype in (("fp32", "reference", torch.float32), ("bf16", "fused", torch.bfloat16),
                              ("formula in bf16", "reference", torch.bfloat16)):
        m = build_model(config(variant, impl)).to(device, dtype)
        logits = m(x[:, :-1].to(device))
        m(x[:, :-1].to(device), x[:, 1:].to(device)).backward()
        out[name] = logits.float(), {k: p.grad.float() for k, p in m.named_parameters() if p.grad is not None}
    (ref, ref_grads), (got, grads), (own, own_grads) = out["fp32"], out["bf16"], out["formula in bf16"]
    assert (got - ref).abs().max() <= max(0.05 * ref.abs().max(), 1.5 * (own - ref).abs().max())
    assert grads.keys() == ref_grads.keys() and len(grads) > 0
    top = max(g.abs().max() for g in ref_grads.values())
    for k, g in ref_grads.items():
        bound = max(0.25 * torch.clamp(g.abs().max(), min=floor * top), 1.5 * (own_grads[k] - g).abs().max())
        assert (grads[k] - g).abs().max() <= bound, k


def test_random_fixed_is_frozen_but_saved():
    model = build_model(config("random_fixed"))
    Rs = [p for n, p in model.named_parameters() if n.endswith("synth.random_fixed.R")]
    assert len(Rs) == 2 and not any(p.requires_grad for p in Rs)
    assert all(f"blocks.{i}.mixer.synth.random_fixed.R" in model.state_dict() for i in range(2))
    x = tokens(2, L + 1)
    model(x[:, :-1], x[:, 1:]).backward()
    assert all(p.grad is None for p in Rs)


def naive_attention(S, v):
    """softmax over j ≤ i, written as loops over positions (another way to compute A V)."""
    B, H, n, _ = S.shape
    out = torch.zeros(B, H, n, v.shape[-1], dtype=S.dtype)
    for i in range(n):
        w = torch.softmax(S[:, :, i, :i + 1], dim=-1)               # only keys j ≤ i
        out[:, :, i] = torch.einsum("bhj,bhjd->bhd", w, v[:, :, :i + 1])
    return out


def paper_logits(name: str, synth, x, b: int, h: int, i: int, j: int, d_h: int) -> float:
    """S_h[i, j] of one synthesizer for sample b, written from the paper's formula (docs/DESIGN.md §1) with the module's
    parameters read as plain matrices, one element at a time: no code of the module is used."""
    rows = slice(h * d_h, (h + 1) * d_h)                                    # head h's outputs of a d → d map

    def linear(layer, v):
        return layer.weight[rows] @ v + layer.bias[rows]
    if name == "dot":                                                        # q_i · k_j / √d_h
        return float(linear(synth.q, x[b, i]) @ linear(synth.k, x[b, j])) / d_h ** 0.5
    if name == "dense":                                                      # W_2[j] · σ(W_1 X_i + b_1) + b_2[j]
        return float(synth.w2[h, j] @ torch.relu(linear(synth.w1, x[b, i])) + synth.w2_bias[h, j])
    if name in ("random", "random_fixed"):                                   # R[i, j]
        return float(synth.R[h, i, j])
    if name == "factorized_random":                                          # R_1[i] · R_2[j]
        return float(synth.R1[h, i] @ synth.R2[h, j])
    hidden = torch.relu(linear(synth.w1, x[b, i]))                           # factorized dense
    A, Bf = synth.fa[h] @ hidden + synth.fa_bias[h], synth.fb[h] @ hidden + synth.fb_bias[h]
    a = A.shape[0]
    return float(A[j % a] * Bf[j // a])                                      # A_i[j mod a] · B_i[⌊j/a⌋]


@pytest.mark.parametrize("variant", [v for v in VARIANTS if "sgu" not in variants.model_fields(v).values()])
def test_every_map_element_and_the_fused_output_follow_the_paper(variant):
    """At every (sample, head, i, j): A = softmax_{j≤i}(Σ_m α_m S_m[i, j]) from the formula's loops equals the map the
    model returns, and Y_i = Σ_j A[i, j] V_j, through the output projection, equals the fused forward. So a bug in
    what the fused and reference paths share (q·k features, R₁/R₂, the mask) cannot hide."""
    torch.manual_seed(1)
    n, B = 7, 2
    model = build_model(config(variant, factorized_a=4, factorized_b=4))
    mixer, x = model.blocks[0].mixer, torch.randn(B, n, 32)
    H, d_h = 4, 8
    alpha = torch.softmax(mixer.theta, -1) if mixer.theta is not None else torch.ones(H, 1)
    with torch.no_grad():
        fused, (_, A_model) = mixer(x), mixer(x, return_map=True)
        for b in range(B):
            for h in range(H):
                for i in range(n):
                    S = [sum(alpha[h, m] * paper_logits(name, synth, x, b, h, i, j, d_h)
                             for m, (name, synth) in enumerate(mixer.synth.items())) for j in range(i + 1)]
                    A = torch.softmax(torch.tensor(S, dtype=torch.float64), 0)   # keys j ≤ i only
                    assert torch.allclose(A_model[b, h, i, :i + 1].double(), A, atol=1e-5), (b, h, i)
                    assert (A_model[b, h, i, i + 1:] == 0).all()
        V = mixer.value.weight @ x.transpose(1, 2) + mixer.value.bias[:, None]        # (B, d, n): every head
        Y = torch.zeros(B, n, H * d_h)
        for b in range(B):
            for h in range(H):
                for i in range(n):
                    Y[b, i, h * d_h:(h + 1) * d_h] = sum(A_model[b, h, i, j] * V[b, h * d_h:(h + 1) * d_h, j]
                                                         for j in range(i + 1))
        assert torch.allclose(fused, mixer.out(Y), atol=1e-5)


def test_the_spatial_gating_unit_follows_its_formula():
    """gMLP's s(Z)_h = Z1_h ⊙ ((W ⊙ causal)[:n, :n] · LN(Z2_h) + b[:n]), at every position and channel, by loops, on
    the fused path; its map is W with the upper triangle zero."""
    torch.manual_seed(2)
    n, B = 7, 2
    unit = build_model(config("sgu")).blocks[0].mixer
    x, c, H = torch.randn(B, n, 32), unit.c, 4
    with torch.no_grad():
        fused, (_, W_map) = unit(x), unit(x, return_map=True)
        z = torch.nn.functional.gelu(x @ unit.in_proj.weight.T + unit.in_proj.bias).view(B, n, H, 2, c)
        gated = torch.zeros(B, n, H * c)
        for b in range(B):
            for h in range(H):
                z1, z2 = z[b, :, h, 0], z[b, :, h, 1]                              # (n, c)
                mean, var = z2.mean(-1, keepdim=True), z2.var(-1, unbiased=False, keepdim=True)
                normed = (z2 - mean) / torch.sqrt(var + unit.eps) * unit.norm_weight[h] + unit.norm_bias[h]
                for i in range(n):
                    gate = sum(unit.spatial[h, i, j] * normed[j] for j in range(i + 1)) + unit.spatial_bias[h, i]
                    gated[b, i, h * c:(h + 1) * c] = z1[i] * gate
                    assert torch.equal(W_map[b, h, i, :i + 1], unit.spatial[h, i, :i + 1])
                    assert (W_map[b, h, i, i + 1:] == 0).all()
        assert torch.allclose(fused, unit.out(gated), atol=1e-5)


def test_synthesizer_formulas_against_loops():
    """Each synthesizer's map equals the paper's formula evaluated element by element."""
    torch.manual_seed(0)
    n, d_h, H = 12, 8, 4
    x = torch.randn(2, n, 32)
    model = build_model(config("dense+dot", "reference"))
    mixer = model.blocks[0].mixer
    dense, dot = mixer.synth["dense"], mixer.synth["dot"]
    W1, b1 = dense.w1.weight.view(H, d_h, 32), dense.w1.bias.view(H, d_h)
    for h in range(H):
        for i in range(n):
            hid = torch.relu(W1[h] @ x[0, i] + b1[h])
            for j in (0, i, n - 1):
                s = dense.w2[h, j] @ hid + dense.w2_bias[h, j]
                assert torch.allclose(dense.logits(x)[0, h, i, j], s, atol=1e-5)
    # factorized dense: S[i, j] = A_i[j mod a] · B_i[⌊j/a⌋], all a·b products distinct positions
    fd = build_model(config("factorized_dense", factorized_a=4, factorized_b=4)).blocks[0].mixer.synth["factorized_dense"]
    S = fd.logits(x)
    hid = torch.relu(fd.w1(x).view(2, n, H, d_h))
    for h in range(H):
        for i in range(n):
            A = fd.fa[h] @ hid[0, i, h] + fd.fa_bias[h]
            Bv = fd.fb[h] @ hid[0, i, h] + fd.fb_bias[h]
            expect = torch.stack([A[j % 4] * Bv[j // 4] for j in range(n)])
            assert torch.allclose(S[0, h, i], expect, atol=1e-5)
    # factorized random: independent of x, S = R1 R2ᵀ
    fr = build_model(config("factorized_random")).blocks[0].mixer.synth["factorized_random"]
    S1, S2 = fr.logits(x), fr.logits(torch.randn(2, n, 32))
    assert torch.equal(S1, S2)
    assert torch.allclose(S1[0, 1, 3, 5], fr.R1[1, 3] @ fr.R2[1, 5])
    # the whole mixture: α = softmax(θ), A = softmax(α_dense S_dense + α_dot S_dot + M), Y = A V
    with torch.no_grad():
        mixer.theta.copy_(torch.randn_like(mixer.theta))
    alpha = torch.softmax(mixer.theta, -1)
    S = alpha[:, 0, None, None] * dense.logits(x) + alpha[:, 1, None, None] * dot.logits(x)
    v = mixer.value(x).view(2, n, H, d_h).transpose(1, 2)
    expect = mixer.out(naive_attention(S, v).transpose(1, 2).reshape(2, n, 32))
    assert torch.allclose(mixer(x), expect, atol=1e-5)


def test_attention_maps_are_causal_distributions():
    model = build_model(config("random+dot", "fused"))
    maps = model.attention_maps(tokens(3, 10))
    assert len(maps) == 2 and maps[0].shape == (3, 4, 10, 10)
    for A in maps:
        assert torch.allclose(A.sum(-1), torch.ones(3, 4, 10), atol=1e-6)
        assert A.triu(1).abs().max() == 0
        assert A.tril(-1).abs().max() > 0


def test_per_layer_mixer_list():
    model = build_model(config("dot", mixer=["random", "dot"]))
    assert list(model.blocks[0].mixer.synth) == ["random"] and list(model.blocks[1].mixer.synth) == ["dot"]


FLASH = "aten::_scaled_dot_product_flash_attention_for_cpu"


@pytest.mark.parametrize("variant", ["dot", "dense", "dense+dot", "random+dot"])
def test_fused_path_runs_the_flash_kernel(variant):
    model = build_model(config(variant))
    x = tokens(2, L + 1)
    with profile() as prof:
        model(x[:, :-1], x[:, 1:]).backward()
    names = {e.name for e in prof.events()}
    assert FLASH in names and "aten::_scaled_dot_product_attention_math" not in names


@pytest.mark.parametrize("variant", ["random", "factorized_random", "random+dot", "factorized_dense"])
def test_fused_path_keeps_no_map_for_backward(variant):
    """The blocked kernels save no (…, n, n) map of their own between forward and backward: every saved one is a
    parameter (R) or a view of one. The reference path (which keeps A) fails this."""
    n = L - 3
    for impl, ok in (("fused", True), ("reference", False)):
        model = build_model(config(variant, impl))
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            loss = model(*tokens(2, n + 1).split([n, 1], dim=1)[:1])
        big = [tuple(t.shape) for t in saved if t.shape[-2:] == (n, n) and t.untyped_storage().data_ptr() not in params]
        assert (big == []) == ok, (impl, big)
        del loss


@pytest.mark.parametrize("variant", VARIANTS)
def test_overfits_one_batch(variant):
    torch.manual_seed(0)
    model = build_model(config(variant, init_std=0.02, random_init_std=0.5, sgu_init_eps=1e-3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = tokens(4, L + 1, seed=5)
    for step in range(300):
        loss = model(x[:, :-1], x[:, 1:])
        if loss.item() < 0.5:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5, f"{variant}: loss {loss.item():.3f} after 300 steps"


def one_line(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg
    return msg


def test_error_sequence_too_long():
    model = build_model(config("random"))
    with pytest.raises(ValueError) as e:
        model(tokens(1, L + 1))
    msg = one_line(e)
    assert f"n={L + 1}" in msg and f"L={L}" in msg


def test_error_unknown_variant_lists_valid_names():
    with pytest.raises(ConfigError) as e:
        config("randm")
    msg = one_line(e)
    assert "randm" in msg and "factorized_random" in msg and "sgu" in msg and "random+dot" in msg


def test_error_factorization_must_multiply_to_L():
    with pytest.raises(ConfigError) as e:
        config("factorized_dense", factorized_a=3, factorized_b=5)
    msg = one_line(e)
    assert "factorized_a" in msg and "15" in msg and str(L) in msg


def test_error_mixture_of_unmixable():
    with pytest.raises(ConfigError) as e:
        config("sgu+dot")
    one_line(e)


def test_biased_kernel_multi_block_matches_materialized():
    """The tiled backward of random+dot's kernel over several (ragged) blocks, against autograd on the formula."""
    from model.qk_attention import biased_qk_attention

    g = torch.Generator().manual_seed(0)
    B, H, n, f = 3, 2, 150, 8
    q, k, v = (torch.randn(B, H, n, f, generator=g, requires_grad=True) for _ in range(3))
    R = torch.randn(H, n, n, generator=g, requires_grad=True)
    w = torch.rand(H, generator=g).requires_grad_()   # the map's mixture weight per head
    d_out = torch.randn(B, H, n, f, generator=g)
    fused = biased_qk_attention(q, k, R, w, v, block=64)
    grads = torch.autograd.grad(fused, (q, k, v, R, w), d_out)
    A = torch.softmax(q @ k.transpose(-1, -2) + w[:, None, None] * R + causal_mask(n, "cpu"), dim=-1)
    ref = A @ v
    ref_grads = torch.autograd.grad(ref, (q, k, v, R, w), d_out)
    assert (fused - ref).abs().max() <= 1e-5
    for a, b in zip(grads, ref_grads):
        assert (a - b).abs().max() <= 1e-4 * max(1.0, b.abs().max().item())


def test_rope_model_is_causal_and_position_aware():
    model = build_model(config("dot", position="rope")).eval()
    assert model.wpe is None
    x = tokens(1, L)
    y = x.clone()
    y[:, -1] = (y[:, -1] + 1) % 64
    assert (model(x)[:, :-1] - model(y)[:, :-1]).abs().max() <= 1e-6
    # one layer of attention alone is blind to the order of the prefix; rotary positions are not
    model = build_model(config("dot", position="rope", n_layers=1)).eval()
    swapped = x.clone()
    swapped[:, [0, 1]] = x[:, [1, 0]]
    assert (model(x)[:, 2] - model(swapped)[:, 2]).abs().max() > 1e-4
    no_pos = build_model(config("dot", position="none", n_layers=1)).eval()
    assert (no_pos(x)[:, 2] - no_pos(swapped)[:, 2]).abs().max() <= 1e-5


def test_rng_tracker_stream_is_separate_and_resumable():
    from model.parallel import RNGTracker

    tracker = RNGTracker()
    tracker.set_seed(5)
    torch.manual_seed(0)
    plain = [torch.rand(3) for _ in range(2)]
    torch.manual_seed(0)
    first = torch.rand(3)
    with tracker.fork(torch.device("cpu")):
        forked = torch.rand(3)
    second = torch.rand(3)
    assert torch.equal(first, plain[0]) and torch.equal(second, plain[1])   # default stream untouched
    assert not torch.equal(forked, plain[1])
    saved = tracker.state_dict()
    with tracker.fork(torch.device("cpu")):
        nxt = torch.rand(3)
    tracker.load_state_dict(saved)
    with tracker.fork(torch.device("cpu")):
        assert torch.equal(torch.rand(3), nxt)


def test_mixer_dropout_only_in_training():
    model = build_model(config("random+dot", mixer_dropout=0.5))
    x = tokens(2, L)
    model.eval()
    assert torch.equal(model(x), model(x))
    model.train()
    assert not torch.equal(model(x), model(x))


@pytest.mark.parametrize("parts", ["map", "factors", "map+factors"])
def test_shared_map_kernel_multi_block_matches_materialized(parts):
    """The input-independent kernel (random: a map S; factorized_random: factors q, k; their mixture: both) over
    several (ragged) row blocks, against autograd on softmax(S + q kᵀ + M) V."""
    from model.kernels import shared_map_attention

    g = torch.Generator().manual_seed(1)
    B, H, n, d, f = 3, 2, 150, 8, 5
    S = torch.randn(H, n, n, generator=g, requires_grad=True) if "map" in parts else None
    q, k = (torch.randn(H, n, f, generator=g, requires_grad=True) for _ in range(2))
    q, k = (q, k) if "factors" in parts else (None, None)
    v = torch.randn(B, n, H, d, generator=g, requires_grad=True)
    dy = torch.randn(B, n, H, d, generator=g)
    inputs = [t for t in (S, q, k, v) if t is not None]
    fused = shared_map_attention(S, v, q, k, block=64)
    grads = torch.autograd.grad(fused, inputs, dy)
    logits = (0 if S is None else S) + (0 if q is None else q @ k.transpose(-1, -2))
    A = torch.softmax(logits + causal_mask(n, "cpu"), dim=-1)            # (H, n, n)
    ref = torch.einsum("hij,bjhd->bihd", A, v)
    ref_grads = torch.autograd.grad(ref, inputs, dy)
    assert (fused - ref).abs().max() <= 1e-5
    for a, b in zip(grads, ref_grads):
        assert (a - b).abs().max() <= 1e-5 * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("n", [150, 200])
def test_causal_matmul_multi_block_matches_masked_matmul(n):
    """gMLP's causal blocked matmul, on a slice n ≤ L of the parameter and ragged blocks, against tril(W)[:n, :n] X."""
    from model.kernels import causal_matmul

    g = torch.Generator().manual_seed(2)
    H, L_, m = 2, 200, 5
    W = torch.randn(H, L_, L_, generator=g, requires_grad=True)
    x = torch.randn(H, n, m, generator=g, requires_grad=True)
    dy = torch.randn(H, n, m, generator=g)
    fused = causal_matmul(W, x, block=64)
    grads = torch.autograd.grad(fused, (W, x), dy)
    ref = W[:, :n, :n].tril() @ x
    ref_grads = torch.autograd.grad(ref, (W, x), dy)
    assert (fused - ref).abs().max() <= 1e-4
    assert grads[0][:, n:].abs().sum() == 0 and grads[0].triu(1).abs().sum() == 0   # nothing outside causal [:n, :n]
    for a, b in zip(grads, ref_grads):
        assert (a - b).abs().max() <= 1e-4 * max(1.0, b.abs().max().item())


def test_factorized_dense_kernel_multi_block_matches_materialized():
    """factorized dense's blocked kernel over ragged blocks and an n that ends inside a row of the (b, a) grid."""
    from model.kernels import factorized_dense_attention

    g = torch.Generator().manual_seed(3)
    B, H, n, a, b, d = 2, 3, 150, 16, 12, 8                          # L = a·b = 192 > n
    A, Bf = torch.randn(B, H, n, a, generator=g, requires_grad=True), torch.randn(B, H, n, b, generator=g,
                                                                                 requires_grad=True)
    v = torch.randn(B, H, n, d, generator=g, requires_grad=True)
    dy = torch.randn(B, H, n, d, generator=g)
    fused = factorized_dense_attention(A, Bf, v, block=64)
    grads = torch.autograd.grad(fused, (A, Bf, v), dy)
    j = torch.arange(n)
    S = A[..., j % a] * Bf[..., j // a]                               # S_i[j] = A_i[j mod a] · B_i[⌊j/a⌋]
    ref = torch.softmax(S + causal_mask(n, "cpu"), dim=-1) @ v
    ref_grads = torch.autograd.grad(ref, (A, Bf, v), dy)
    assert (fused - ref).abs().max() <= 1e-5
    for x, y in zip(grads, ref_grads):
        assert (x - y).abs().max() <= 1e-4 * max(1.0, y.abs().max().item())


def test_rotary_positions_take_heads_of_odd_width():
    """d_h 5 (d 15, 3 heads): the heads are views of the projection with an odd stride; RoPE turns the first 4
    features of each head and leaves the fifth, also for heads that are views (the training path)."""
    model = build_model(ModelConfig(vocab_size=64, d_model=15, n_heads=3, n_layers=1, max_seq_len=16, position="rope",
                                    mixer="dot"))
    x = torch.randint(64, (2, 16))
    loss = model(x, x)
    loss.backward()
    assert torch.isfinite(loss)
