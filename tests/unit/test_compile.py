"""train.compile's parts (pretrain/engine.py compile_model) against the eager model: the blocks, the embedding, and
the final LayerNorm + head + fused loss (model/linear_cross_entropy.py), which works in place on chunk buffers and
saves its gradients in forward, so a wrong trace shows as a wrong gradient. The loss runs in several chunks here
(CHUNK_ELEMENTS lowered), as at the bench's shape (8 chunks), not in the one chunk a tiny model's loss takes.

CPU inductor compiles for tens of seconds, so the model is traced with `aot_eager`: dynamo and AOT autograd's
functionalized joint graph, as inductor gets it, run eagerly. Inductor itself runs the trainer's compiled parts in
tests/distributed/test_training.py (losses within 1e-4 of the eager run's over 8 steps), and on CUDA the whole model compiled by
inductor was compared with eager at the bench's shape (benchmarks/compile_check.py, docs/gpu/).
"""
import torch

import model.linear_cross_entropy as lce
from model import build_model
from pretrain.engine import compile_model
from tests.unit.test_model import config, tokens


def recording(name: str, graphs: list):
    """torch.compile's backend `name`, recording each graph it is given (fx GraphModule) in `graphs`."""
    compiler = torch._dynamo.lookup_backend(name)

    def backend(gm, example_inputs):
        graphs.append(gm)
        return compiler(gm, example_inputs)
    return backend


def loss_and_grads(m, x):
    m.zero_grad(set_to_none=True)
    loss = m(x[:, :-1], x[:, 1:])
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None}


def assert_equal_to_eager(compiled, eager, x, tol):
    (loss, grads), (loss_eager, grads_eager) = loss_and_grads(compiled, x), loss_and_grads(eager, x)
    assert abs(loss - loss_eager) <= tol * abs(loss_eager), (loss, loss_eager)
    assert grads.keys() == grads_eager.keys() and len(grads) > 10
    errors = {k: ((grads[k] - grads_eager[k]).abs().max() / grads_eager[k].abs().max()).item() for k in grads}
    assert max(errors.values()) <= tol, sorted(errors.items(), key=lambda e: -e[1])[:3]


def test_compiled_embedding_blocks_and_fused_loss_equal_eager(monkeypatch):
    """The engine's compile (aot_eager) of a dot model: the loss and every gradient as eager's, with the loss
    in 4 chunks of 12 rows; each part traced as a graph of its own, the loss's whole chunk loop in one (no graph
    break inside its autograd Function)."""
    torch._dynamo.reset()
    monkeypatch.setattr(lce, "CHUNK_ELEMENTS", 12 * 64)   # 12 rows a chunk at V 64: 45 rows in 4 chunks
    x = tokens(3, 16)
    eager, compiled = build_model(config("dot")), build_model(config("dot"))
    graphs = []
    compile_model(compiled, recording("aot_eager", graphs))
    assert_equal_to_eager(compiled, eager, x, 1e-6)
    assert len(graphs) == 3, [gm.code for gm in graphs]   # a block (one graph serves both), the embedding, the loss
    functions = [gm.fwd_body_0.code for gm in graphs if hasattr(gm, "fwd_body_0")]   # autograd Functions, traced
    assert [code.count(".exp_(") for code in functions].count(4) == 1, functions     # the loss's 4 chunks, unrolled

