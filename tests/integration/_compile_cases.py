"""Compiled blocks shared by the CPU (test_torch_compile_ops.py) and CUDA
(tests/gpu/test_gpu_torch_compile.py) torch.compile tests: each ``check_*`` compiles one block fullgraph with
Inductor on the inputs' device and compares it with its oracle. Not a test module (the leading underscore
keeps pytest from collecting it)."""

from __future__ import annotations

import torch

import layerzero as lz


def topk_topp(logits):
    return lz.sample_topk(logits, 5, temperature=0.9), lz.sample_topp(logits, 0.8), lz.sample_topk(logits, 1)


def check_topk_topp_compiles(logits: torch.Tensor) -> None:
    """``lz.sample_topk`` / ``lz.sample_topp`` without a generator (the global RNG) are custom ops: no graph
    break; with the same global seed the compiled function draws eager's tokens, and k = 1 is the argmax."""
    torch._dynamo.reset()
    assert torch._dynamo.explain(topk_topp)(logits).graph_break_count == 0
    compiled = torch.compile(topk_topp, fullgraph=True)
    compiled(logits)  # the first run selects the kernels (no draw is compared)
    torch.manual_seed(11)
    with lz.trace() as t:
        got = compiled(logits)
    torch.manual_seed(11)
    want = topk_topp(logits)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert torch.equal(got[2], logits.argmax(-1)) and {"sample_topk", "sample_topp"} <= {
        op for op, _ in t.counts
    }


def train_block(x, w_norm, w1, b1, w2, res):
    h, res2 = lz.rms_norm(x, w_norm, residual=res)
    gu = lz.linear(lz.rms_norm(h, w_norm), w1, b1)
    gate, up = gu.chunk(2, -1)
    return lz.linear(lz.swiglu(gate, up), w2) + res2


def train_oracle(x, w_norm, w1, b1, w2, res):
    """``train_block``'s math in plain torch (run in float64 as the gradient oracle)."""

    def rms(t):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w_norm

    h = x + res
    gate, up = torch.nn.functional.linear(rms(rms(h)), w1, b1).chunk(2, -1)
    return torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2) + h


def check_training_block(dtype: torch.dtype, device: str, hidden: int, tol: float) -> None:
    """``train_block`` (``lz.rms_norm`` plain and with residual, ``lz.linear``, ``lz.swiglu``) compiles
    fullgraph with no graph break (each op one custom-op node with its backward formula), runs the ops
    (lz.trace), and every input's gradient is within ``tol`` (max abs error / max abs gradient) of the float64
    autograd oracle run on the CPU; odd token counts, hidden size ``hidden``, intermediate
    ``3 * hidden / 2``."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(12)
    shapes = {
        "x": (3, 5, hidden),
        "w_norm": (hidden,),
        "w1": (3 * hidden, hidden),
        "b1": (3 * hidden,),
        "w2": (hidden, 3 * hidden // 2),
        "res": (3, 5, hidden),
    }
    base = {
        k: torch.randn(*v, generator=gen) * (0.2 if k.startswith("w") or k == "b1" else 1.0)
        for k, v in shapes.items()
    }
    base["w_norm"] = base["w_norm"] + 1.0

    def inputs():
        return [t.to(device, dtype).clone().requires_grad_() for t in base.values()]

    assert torch._dynamo.explain(train_block)(*inputs()).graph_break_count == 0
    ins = inputs()
    dy = torch.randn(3, 5, hidden, generator=gen)
    with lz.trace() as t:
        torch.compile(train_block, fullgraph=True)(*ins).backward(dy.to(device, dtype))
    ref = [t.detach().double().requires_grad_() for t in base.values()]
    train_oracle(*ref).backward(dy.double())
    for name, got, want in zip(shapes, ins, ref, strict=True):
        err = ((got.grad.double().cpu() - want.grad).abs().max() / want.grad.abs().max()).item()
        assert err <= tol, (name, err)
    assert {"rms_norm", "linear", "swiglu"} <= {op for op, _ in t.counts}
