"""``lz.linear``'s exact key (``ops/linear._exact_key``, as ``lz.rms_norm``'s in ``test_hot_path.py``): a warm
call skips the checks and the key build, so every fact a check reads must be in the key: after good calls
filed their keys, each bad input still raises the typed error; strided inputs of one shape get their own keys;
a hit serves the same result as the full path (float64 oracle: ``x @ W.T + b`` in float64)."""

from __future__ import annotations

import pytest
import torch

import layerzero as lz
from layerzero.core.errors import InvalidInputError
from layerzero.core.runtime import RUNTIME

pytestmark = pytest.mark.unit


def _linear_keys():
    return [
        k
        for k in RUNTIME.cache.hot
        if isinstance(k, tuple) and k and k[0] == "linear" and any(isinstance(f, torch.Size) for f in k)
    ]


def _oracle(x, w, b=None):
    y = x.double() @ w.double().T
    return (y if b is None else y + b.double()).to(x.dtype)


@pytest.mark.parametrize("bias", [False, True])
def test_linear_files_an_exact_key_and_serves_it(bias):
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(3, 5, 16, generator=g), torch.randn(7, 16, generator=g)
    b = torch.randn(7, generator=g) if bias else None
    for _ in range(3):
        torch.testing.assert_close(lz.linear(x, w, b), _oracle(x, w, b), rtol=1e-5, atol=1e-5)
    (key,) = _linear_keys()
    assert key[4] == x.shape and key[6] == w.shape and (key[8] is None) == (not bias)
    hit = RUNTIME.run_hot(key, (x, w, b))
    torch.testing.assert_close(hit, _oracle(x, w, b), rtol=1e-5, atol=1e-5)
    x2 = torch.randn(3, 5, 16, generator=g)  # same facts, new values: the same key, a correct result
    torch.testing.assert_close(lz.linear(x2, w, b), _oracle(x2, w, b), rtol=1e-5, atol=1e-5)
    assert len(_linear_keys()) == 1


@pytest.mark.parametrize(
    "bad",
    [
        "w_k",
        "w_dtype",
        "w_1d",
        "w_empty",
        "w_list",
        "x_int",
        "x_0dim",
        "x_k",
        "b_shape",
        "b_dtype",
        "b_2d",
        "b_list",
    ],
)
def test_linear_warm_shapes_never_skip_a_check(bad):
    """After good calls (with and without a bias) filed exact keys, each bad input still raises the typed
    error."""
    x, w, b = torch.randn(4, 8), torch.randn(6, 8), torch.randn(6)
    for _ in range(3):
        lz.linear(x, w)
        lz.linear(x, w, b)
    assert len(_linear_keys()) == 2
    bias = b if bad.startswith("b_") else None
    if bad == "w_k":
        w = torch.randn(6, 9)
    elif bad == "w_dtype":
        w = w.double()
    elif bad == "w_1d":
        w = torch.randn(8)
    elif bad == "w_empty":
        w = torch.randn(0, 8)
    elif bad == "w_list":
        w = w.tolist()
    elif bad == "x_int":
        x = x.to(torch.int64)
    elif bad == "x_0dim":
        x = torch.tensor(1.0)
    elif bad == "x_k":
        x = torch.randn(4, 7)
    elif bad == "b_shape":
        bias = torch.randn(5)
    elif bad == "b_dtype":
        bias = b.double()
    elif bad == "b_2d":
        bias = b.view(1, 6)
    elif bad == "b_list":
        bias = b.tolist()
    with pytest.raises(InvalidInputError):
        lz.linear(x, w, bias)


def test_linear_exact_key_tells_strides_apart():
    """Two x of one shape, one with a unit last stride and one without, and a transposed weight view: separate
    exact keys (kernels may require stride_last_1), each result right."""
    base = torch.randn(4, 32)
    rows, cols = base[:, :16], base[:, ::2]  # both [4, 16]; stride(-1) 1 and 2
    w = torch.randn(16, 6).T  # [6, 16] with stride (1, 6)
    for t in (rows, cols):
        for _ in range(2):
            torch.testing.assert_close(lz.linear(t, w), _oracle(t, w), rtol=1e-5, atol=1e-5)
    keys = _linear_keys()
    assert len(keys) == 2 and {k[5] for k in keys} == {rows.stride(), cols.stride()}


def test_linear_hit_follows_grad_mode():
    """requires_grad is in the key: a kernel without a backward, chosen for warm no-grad calls, never serves a
    call that must record a graph (selection filters it out there: the result carries a grad_fn)."""
    kid = "lzhotlin.nograd"
    lz.register_kernel(
        "linear",
        kid,
        lambda x, w, b: (x @ w.T).detach(),
        priority=99,
        device_types={"cpu"},
        dtypes={"float32"},
        supports_backward=False,
    )
    try:
        x, w = torch.randn(2, 8), torch.randn(3, 8, requires_grad=True)
        with torch.no_grad():
            for _ in range(3):
                lz.linear(x, w)
        assert any(plan.kernel_id == kid for plan in RUNTIME.cache.hot.values())
        out = lz.linear(x, w)
        assert out.requires_grad
        out.sum().backward()
        torch.testing.assert_close(w.grad, x.sum(0).expand(3, 8))
    finally:
        lz.unregister_kernel(kid)


# ---------------------------------------------------------------- lz.swiglu's exact key (the same rule)
def _swiglu_keys():
    return [
        k
        for k in RUNTIME.cache.hot
        if isinstance(k, tuple) and k and k[0] == "swiglu" and any(isinstance(f, torch.Size) for f in k)
    ]


def _swiglu64(gate, up):
    g = gate.double()
    return (g * torch.sigmoid(g)).to(gate.dtype).double() * up.double()


def test_swiglu_files_an_exact_key_and_serves_it():
    g = torch.Generator().manual_seed(7)
    gate, up = torch.randn(3, 5, 24, generator=g), torch.randn(3, 5, 24, generator=g)
    for _ in range(3):
        torch.testing.assert_close(lz.swiglu(gate, up).double(), _swiglu64(gate, up), rtol=1e-5, atol=1e-6)
    (key,) = _swiglu_keys()
    assert key[4] == gate.shape and key[6] == up.shape
    torch.testing.assert_close(
        RUNTIME.run_hot(key, (gate, up)).double(), _swiglu64(gate, up), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize(
    "bad", ["up_shape", "up_dtype", "up_list", "gate_int", "gate_0dim", "empty", "strided"]
)
def test_swiglu_warm_shapes_never_skip_a_check(bad):
    """After good calls filed an exact key, each bad input still raises the typed error; a strided pair of the
    same shape takes its own key and the right result."""
    gate, up = torch.randn(4, 8), torch.randn(4, 8)
    for _ in range(3):
        lz.swiglu(gate, up)
    assert len(_swiglu_keys()) == 1
    if bad == "strided":
        wide = torch.randn(4, 16)
        sg, su = wide[:, ::2], wide[:, 1::2]
        for _ in range(2):
            torch.testing.assert_close(lz.swiglu(sg, su).double(), _swiglu64(sg, su), rtol=1e-5, atol=1e-6)
        assert len(_swiglu_keys()) == 2
        return
    if bad == "up_shape":
        up = torch.randn(4, 9)
    elif bad == "up_dtype":
        up = up.double()
    elif bad == "up_list":
        up = up.tolist()
    elif bad == "gate_int":
        gate = gate.to(torch.int64)
    elif bad == "gate_0dim":
        gate, up = torch.tensor(1.0), torch.tensor(1.0)
    elif bad == "empty":
        gate, up = torch.randn(4, 0), torch.randn(4, 0)
    with pytest.raises(InvalidInputError):
        lz.swiglu(gate, up)
