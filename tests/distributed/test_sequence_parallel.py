"""Sequence parallelism (parallel.sequence_parallel, model/sequence_parallel.py) on two real gloo processes: TP=2 with it
gives the loss and every gradient of TP=2 without it and of TP=1, every variant, dropout 0; the region functions
equal a reference made another way (the full tensor's slices and sums, forward and backward); with dropout on, a
step is deterministic and each rank's chunk gets its own masks; the activations it saves are the memory plan's;
within `whole_sequences` the same model runs a length that does not split over TP.
One launch for all of it."""
import dataclasses

import torch
import torch.distributed as dist

from model import build_model
from model.memory import activations
from model import parallel as tp
from tests.distributed.test_memory_plan import saved_bytes
from tests.distributed.test_tensor_parallel import VARIANTS, batch, config, gather
from tests.support.distributed import run_distributed

TOL = 1e-5


def step(v: str, sequence_parallel: bool, documents: bool = False, dropout: float = 0.0) -> dict:
    """Loss and full gradients of one forward and backward of variant v, built with sequence parallelism on or off."""
    tp.set_sequence_parallel(sequence_parallel)
    try:
        cfg = config(v, documents=documents)
        model = build_model(dataclasses.replace(cfg, dropout=dropout) if dropout else cfg)
        torch.manual_seed(11)
        tokens = batch()
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        grads = {n: gather(p.grad, p) for n, p in model.named_parameters() if p.grad is not None}
    finally:
        tp.set_sequence_parallel(False)
    return {"loss": loss.item(), "grads": grads}


def regions() -> dict:
    """Each region function's forward and backward against the full tensor's slice or sum over the ranks."""
    rank, world = tp.tp_rank(), tp.tp_world()
    g = torch.Generator().manual_seed(3)
    full = [torch.randn(2, 6, 5, generator=g) for _ in range(world)]   # (B, n, d) per rank: partial sums
    upstream = torch.randn(2, 6, 5, generator=g)                       # ∂loss/∂output, (B, n, d)
    chunk = slice(rank * 3, rank * 3 + 3)
    tp.set_sequence_parallel(True)
    try:
        x = full[rank][:, chunk].clone().requires_grad_()
        y = tp.gather_sequence(x)                                      # (B, n, d) of every rank's chunk
        (y * upstream).sum().backward()
        gathered = (y.detach(), x.grad)
        x = full[rank].clone().requires_grad_()
        y = tp.reduce_scatter_sequence(x)                              # (B, n/TP, d) of the sum
        (y * upstream[:, chunk]).sum().backward()
        scattered = (y.detach(), x.grad)
        x = full[0].clone().requires_grad_()
        y = tp.scatter_sequence(x)
        (y * upstream[:, chunk]).sum().backward()
        own = (y.detach(), x.grad)
        w = full[rank][0, 0].clone().requires_grad_()
        (tp.summed_over_tp(w) * upstream[0, 0]).sum().backward()
    finally:
        tp.set_sequence_parallel(False)
    # references: the chunks laid side by side, the sum over ranks, each rank's ∂ of the same upstream
    total = torch.stack(full).sum(0)
    ref_gather = torch.cat([f[:, slice(r * 3, r * 3 + 3)] for r, f in enumerate(full)], dim=1)
    return {"gather": (gathered, (ref_gather, world * upstream[:, chunk])),
            "reduce_scatter": (scattered, (total[:, chunk], upstream)),
            "scatter": (own, (full[0][:, chunk], upstream)),
            "summed": (w.grad, world * upstream[0, 0])}


def sp_worker(rank, world, cases):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    tp.rng_tracker.set_seed(5)
    out = {"regions": regions()}
    for v, documents in cases:
        out[v, documents] = {sp: step(v, sp, documents) for sp in (False, True)}
    out["dropout"] = []
    for _ in range(2):   # from the same seeds: the same masks
        tp.rng_tracker.set_seed(5)
        out["dropout"].append(step("dense", True, dropout=0.3))
    out["saved"] = {}
    for sp in (False, True):   # bytes autograd keeps, dropout on: the plan's sequence-parallel terms
        tp.set_sequence_parallel(sp)
        model = build_model(dataclasses.replace(config("dense"), dropout=0.1))
        tokens = batch()
        out["saved"][sp] = saved_bytes(model, tokens[:, :-1], tokens[:, 1:])
    tp.set_sequence_parallel(True)
    model = build_model(config("dense+dot"))
    with torch.no_grad(), tp.whole_sequences():   # inference at a length that does not split over TP
        out["whole"] = tp.gather_last_dim(model(batch()[:, :7]))
    model = build_model(dataclasses.replace(config("dense"), dropout=0.5))
    x = torch.ones(1, 8, 32)
    mask = model.drop(tp.scatter_sequence(x)) != 0                    # this rank's chunk of a dropout's mask
    parts = [torch.empty_like(mask) for _ in range(world)]
    dist.all_gather(parts, mask)
    out["masks"] = parts
    tp.set_sequence_parallel(False)
    parallel_state.destroy_model_parallel()
    return out


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a - b).abs().max().item() <= TOL


def test_sequence_parallel_equals_tensor_parallel_every_variant():
    cases = [(v, False) for v in VARIANTS] + [("dense+dot", True), ("sgu", True)]
    results = run_distributed(sp_worker, 2, cases)
    for r, got in enumerate(results):
        for name, (have, want) in got["regions"].items():
            have, want = (have, want) if isinstance(have, tuple) else ((have,), (want,))
            for h, w in zip(have, want):
                assert close(h, w), f"{name} on rank {r}: off by {(h - w).abs().max().item()}"
    for v, documents in cases:
        ref = build_model(config(v, documents=documents))              # TP = 1
        tokens = batch()
        loss = ref(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        for r in range(2):
            off, on = results[r][v, documents][False], results[r][v, documents][True]
            assert abs(on["loss"] - off["loss"]) <= TOL * abs(off["loss"]), (v, documents, on["loss"], off["loss"])
            assert abs(on["loss"] - loss.item()) <= TOL * abs(loss.item()), (v, documents)
            assert on["grads"].keys() == off["grads"].keys(), v
            for name, p in ref.named_parameters():
                if p.grad is None:
                    assert name not in on["grads"], f"{v}: {name} should get no gradient"
                    continue
                for what, other in (("tp 2 without it", off["grads"][name]), ("tp 1", p.grad)):
                    err = (on["grads"][name] - other).abs().max().item()
                    assert err <= TOL, f"{v} (documents {documents}): grad of {name} is {err} from {what}, rank {r}"
    with torch.no_grad():   # a model built with it runs any length within whole_sequences, as plain TP does
        logits = build_model(config("dense+dot"))(batch()[:, :7])
    for r in range(2):
        assert close(results[r]["whole"], logits), r
    # dropout on: the same step twice gives the same loss; the two ranks' chunks have masks of their own
    for r in range(2):
        first, second = results[r]["dropout"]
        assert first["loss"] == second["loss"]
    assert results[0]["masks"][0].shape == (1, 4, 32)
    cfg = dataclasses.replace(config("dense"), dropout=0.1)
    B, n = batch()[:, :-1].shape
    planned = activations(cfg, B, n, tp=2).total - activations(cfg, B, n, tp=2, sp=2).total
    for r in range(2):   # what sequence parallelism saves: the plan's terms against the tensors autograd keeps
        saved = results[r]["saved"]
        assert saved[False] - saved[True] == planned, (r, saved, planned)
