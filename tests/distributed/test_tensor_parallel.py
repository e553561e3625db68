"""TP=2 on two real gloo processes equals TP=1: same initial weights, same loss, same gradients, every variant, with
and without the document mask (model.document_mask: three documents in the batch's windows)."""
import pytest
import torch
import torch.distributed as dist

from model import ModelConfig, build_model, variants
from model import parallel as tp
from tests.support.distributed import run_distributed

# every registered mixer, gMLP, and the mixtures of model/variants.py this test has always run
VARIANTS = [v for v in variants.subset("all") if v != "random+dot+dense"]


EOS = 5


def config(variant: str, impl: str = "fused", documents: bool = False) -> ModelConfig:
    extra = variants.model_fields(variant)
    return ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16, factorized_k=4,
                       tie_embeddings=variant != "dot", position="rope" if variant == "dense+dot" else "learned",
                       random_init_std=0.5, init_std=0.2, sgu_init_eps=8.0, impl=impl, seed=7,
                       document_mask=documents, eos_id=EOS, **extra)


def batch():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (3, 13), generator=g)
    tokens[:, 4], tokens[1, 9] = EOS, EOS   # documents for the masked runs
    return tokens


def gather(t: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The full tensor of a (possibly TP-sharded) parameter or its gradient."""
    if not tp.is_sharded(param):
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(tp.tp_world())]
    dist.all_gather(parts, t.detach().contiguous(), group=tp.tp_group())
    return torch.cat(parts, dim=param.partition_dim)


def tp_worker(rank, world, variants):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    out = {}
    for v, documents in variants:
        model = build_model(config(v, documents=documents))
        weights = {n: gather(p, p) for n, p in model.named_parameters()}
        tokens = batch()
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        grads = {n: gather(p.grad, p) if p.grad is not None else None for n, p in model.named_parameters()}
        out[v, documents] = {"weights": weights, "loss": loss.item(), "grads": grads}
    try:   # heads must split evenly over TP ranks
        build_model(ModelConfig(vocab_size=64, d_model=30, n_layers=1, n_heads=3, max_seq_len=8))
    except Exception as e:
        out["heads_error"] = (type(e).__name__, str(e))
    parallel_state.destroy_model_parallel()
    return out


@pytest.mark.slow
def test_tp2_equals_tp1_every_variant():
    results = tp2_equals_tp1(VARIANTS)
    name, msg = results[0]["heads_error"]
    assert name == "ConfigError" and "\n" not in msg
    assert "model.n_heads=3" in msg and "parallel.tp=2" in msg


def tp2_equals_tp1(variants: list[str], masks=(False, True)) -> list[dict]:
    """Each variant's TP=2 shards on two gloo processes against the TP=1 model here, with each document mask setting
    of `masks`: initial weights, loss and every gradient; the ranks' results."""
    cases = [(v, documents) for v in variants for documents in masks]
    results = run_distributed(tp_worker, 2, cases)
    for v, documents in cases:
        ref = build_model(config(v, documents=documents))
        tokens = batch()
        loss = ref(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        for r in range(2):
            got = results[r][v, documents]
            assert got["weights"].keys() == dict(ref.named_parameters()).keys(), v
            for name, p in ref.named_parameters():
                assert torch.equal(got["weights"][name], p.detach()), f"{v}: initial {name} differs on rank {r}"
                if p.grad is None:
                    assert got["grads"][name] is None, f"{v}: {name} should get no gradient"
                    continue
                err = (got["grads"][name] - p.grad).abs().max().item()
                assert err <= 1e-5, f"{v}: grad of {name} differs by {err} on rank {r}"
            assert abs(got["loss"] - loss.item()) <= 1e-5 * abs(loss.item()), v
    return results


def compile_worker(rank, world):
    """torch._dynamo's graph breaks of a forward and backward loss, the model built as the trainer builds it."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    model = build_model(config("dot"))
    tokens = batch()
    explained = torch._dynamo.explain(model)(tokens[:, :-1], tokens[:, 1:])
    parallel_state.destroy_model_parallel()
    return explained.graph_break_count, [str(b.reason)[:200] for b in explained.break_reasons]


def test_the_model_as_the_trainer_builds_it_compiles_into_one_graph():
    """Under megatron-core's parallel state at TP=1, as every data- or pipeline-parallel run has it, the model is
    built of plain torch layers (bias inside the GEMM) and the fused head + loss: dynamo traces forward and loss as
    one graph, no break."""
    breaks, reasons = run_distributed(compile_worker, 1)[0]
    assert breaks == 0, reasons


def plain_layers_worker(rank, world):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    model = build_model(config("dense+dot"))
    kinds = sorted({type(m).__module__.split(".")[0] for m in model.modules() if type(m) is not type(model)})
    x = torch.randn(2, 5, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.blocks[0].mlp.fc(x)
    parallel_state.destroy_model_parallel()
    return kinds, out.dtype


def test_tp1_under_megatrons_parallel_state_builds_plain_torch_layers():
    """No megatron layer at TP=1: its linears add the bias apart, in fp32 under autocast, which promotes each
    output to fp32 (24 GB of forward activations at synth-1.3b's size against 14.6)."""
    kinds, dtype = run_distributed(plain_layers_worker, 1)[0]
    assert "megatron" not in kinds, kinds
    assert dtype == torch.bfloat16
