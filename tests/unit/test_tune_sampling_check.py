"""lz.tune checks sampling kernels by support: hand-worked cases of stats.check_sampled."""

from __future__ import annotations

import math

import pytest
import torch

from layerzero.tuning.stats import check_sampled

pytestmark = pytest.mark.unit

# probabilities of row 0: softmax of log([0.5, 0.3, 0.15, 0.05]) = exactly those
LOGITS = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()


@pytest.mark.parametrize(
    ("k", "token", "ok"), [(2, 0, True), (2, 1, True), (2, 2, False), (1, 1, False), (9, 3, True)]
)
def test_topk_support(k, token, ok):
    assert check_sampled("sample_topk", torch.tensor([token]), (LOGITS, k, 1.0, None))[0] is ok


@pytest.mark.parametrize(
    ("p", "token", "ok"),
    [
        (0.5, 0, True),
        (0.49, 1, False),  # before(1) = 0.5, not < 0.49
        (0.6, 1, True),
        (0.6, 2, False),  # before(2) = 0.8
        (0.81, 2, True),
        (0.81, 3, False),  # before(3) = 0.95
        (1.0, 3, True),
        (0.01, 0, True),
    ],
)  # the most probable token is always kept
def test_topp_support(p, token, ok):
    assert check_sampled("sample_topp", torch.tensor([token]), (LOGITS, p, 1.0, None))[0] is ok


def test_greedy_and_shape_errors():
    assert check_sampled("sample_topk", torch.tensor([0]), (LOGITS, 3, 0.0, None))[0]
    assert not check_sampled("sample_topk", torch.tensor([1]), (LOGITS, 3, 0.0, None))[0]
    ok, err, why = check_sampled("sample_topp", torch.tensor([0, 0]), (LOGITS, 0.5, 1.0, None))
    assert not ok and err == math.inf and "(1,)" in why
    assert not check_sampled("sample_topp", torch.tensor([7]), (LOGITS, 0.5, 1.0, None))[0]


def test_tune_times_a_kernel_whose_draws_differ_from_the_reference():
    """A kernel that draws differently (always the most probable token) but inside the support is OK."""
    import layerzero as lz

    def argmax_sampler(logits, k, temperature, generator):
        return logits.argmax(-1)

    lz.list_kernels("sample_topk")  # loads the registry
    lz.register_kernel(
        "sample_topk", "test_tune.argmax_topk", argmax_sampler, priority=-5, device_types={"cpu"}
    )
    try:
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(8, 50, generator=g)
        rep = lz.tune(
            "sample_topk",
            [((logits, 5), {"generator": torch.Generator().manual_seed(1)})],
            kernels=["test_tune.argmax_topk"],
            repeats=2,
            iters=1,
            warmup=0,
            progress=False,
        )
        assert rep.row(0, "test_tune.argmax_topk").status.value == "ok"
    finally:
        lz.unregister_kernel("test_tune.argmax_topk")
