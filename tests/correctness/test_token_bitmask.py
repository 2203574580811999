"""``lz.apply_token_bitmask`` against oracles, on CPU.

- Each kernel (reference, torch_native, xgrammar when installed, each locked; triton through the Triton
  interpreter, called directly) on a hand-worked case and on seeded random odd shapes against a float64 oracle
  built with ``numpy.unpackbits`` (an independent unpack): V not a multiple of 32, R < R_all with int64 and
  int32 indices, words covering fewer ids than V (the rest banned) and more (extra words ignored), all-ones
  words (a no-op: logits bit for bit), each float dtype the kernel takes. Other rows and allowed tokens are
  never written (compared bit for bit, NaN kept).
- Selection: on CPU the triton kernel is rejected with ``DEVICE_TYPE_UNSUPPORTED``, xgrammar takes no float64.
- Bad input: the library's typed errors, before any write.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # must precede the first @triton.jit of the session (kernels load lazily)
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _triton_interp import needs_interpreter  # noqa: E402

import layerzero as lz  # noqa: E402

pytestmark = pytest.mark.correctness
OP = "apply_token_bitmask"
KX = "xgrammar.apply_token_bitmask"
HAS_XGRAMMAR = importlib.util.find_spec("xgrammar") is not None
LOCKED = ["reference.apply_token_bitmask", "torch_native.apply_token_bitmask"]
needs_xgrammar = pytest.mark.skipif(not HAS_XGRAMMAR, reason="xgrammar is not installed")
interpreted = needs_interpreter("tests/gpu/test_gpu_token_bitmask.py")


def oracle(logits: torch.Tensor, bits: torch.Tensor, rows: list[int]) -> np.ndarray:
    """float64 logits with -inf where ``bits`` row i (little-endian bits of int32 words) bans a token of
    logits row ``rows[i]``; ids past ``32 W`` banned."""
    out = logits.double().numpy().copy()
    vocab = out.shape[1]
    flags = np.unpackbits(bits.numpy().astype("<i4").view(np.uint8), axis=1, bitorder="little").astype(bool)
    allowed = np.zeros((len(rows), vocab), dtype=bool)
    n = min(vocab, flags.shape[1])
    allowed[:, :n] = flags[:, :n]
    for i, r in enumerate(rows):
        out[r, ~allowed[i]] = -np.inf
    return out


def run(kernel_id: str, logits, bits, indices=None) -> None:
    """``lz.apply_token_bitmask`` locked to ``kernel_id`` (triton, xgrammar: CUDA kernels, their functions
    called directly after the op's checks)."""
    if kernel_id in ("triton.apply_token_bitmask", "xgrammar.apply_token_bitmask"):
        from layerzero.backends.triton.token_bitmask import apply_token_bitmask as triton_kernel
        from layerzero.backends.xgrammar import apply_token_bitmask as xgrammar_kernel

        lz.ops.OPS[OP][0](logits, bits, indices)  # the op's checks still apply
        (triton_kernel if kernel_id.startswith("triton") else xgrammar_kernel)(logits, bits, indices)
        return
    lz.lock(OP, kernel_id)
    try:
        lz.apply_token_bitmask(logits, bits, indices)
    finally:
        lz.unlock(OP)


def random_words(g: torch.Generator, rows: int, width: int) -> torch.Tensor:
    return torch.randint(-(2**31), 2**31, (rows, width), generator=g, dtype=torch.int64).to(torch.int32)


# (R_all, V, W, rows or None): odd V, fewer words than V needs (the rest banned), more (ignored), subsets
CASES = [
    (3, 70, 3, None),
    (5, 97, 4, [4, 0, 2]),
    (4, 100, 2, [1]),  # 64 ids covered, 36 banned
    (2, 33, 5, [1, 0]),  # 160 ids covered by the words, 33 in the vocabulary
    (6, 1, 1, [5, 3]),
    (3, 1500, 47, None),  # more than one triton block of tokens
]


def _check_case(kernel_id: str, dtype: torch.dtype, seed: int, case, index_dtype=torch.int64) -> int:
    """Check one case; the number of tokens it bans (a test asserts the cases ban some)."""
    n_all, vocab, width, rows = case
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n_all, vocab, generator=g).to(dtype)
    logits[0, 0] = float("nan")  # kept where allowed or outside the masked rows
    r = list(range(n_all)) if rows is None else rows
    bits = random_words(g, len(r), width)
    want = oracle(logits, bits, r)
    got = logits.clone()
    run(kernel_id, got, bits, None if rows is None else torch.tensor(rows, dtype=index_dtype))
    np.testing.assert_array_equal(got.double().numpy(), want, err_msg=f"{kernel_id} {dtype} {case}")
    assert np.isfinite(want).any(), case
    return int(np.isinf(want).sum())


@pytest.mark.parametrize("kernel_id", LOCKED)
def test_hand_worked(kernel_id):
    logits = torch.arange(15, dtype=torch.float32).reshape(3, 5)
    bits = torch.tensor([[0b10110], [-(2**31) | 0b1]], dtype=torch.int32)  # sign bit: token 31 (> V)
    run(kernel_id, logits, bits, torch.tensor([2, 0]))
    inf = float("-inf")
    assert logits.tolist() == [[0.0, inf, inf, inf, inf], [5, 6, 7, 8, 9], [inf, 11, 12, inf, 14]]


@pytest.mark.parametrize("kernel_id", LOCKED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_matches_float64_oracle(kernel_id, dtype):
    banned = [_check_case(kernel_id, dtype, seed, case) for seed, case in enumerate(CASES)]
    assert min(banned[:4]) > 0 and banned[-1] > 0, banned  # the mask bans tokens in these cases
    assert _check_case(kernel_id, dtype, 99, CASES[1], index_dtype=torch.int32) > 0


@pytest.mark.parametrize("kernel_id", LOCKED)
def test_all_ones_words_change_nothing(kernel_id):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 64 * 3, generator=g)
    logits[1, 5] = float("nan")
    before = logits.clone()
    run(kernel_id, logits, torch.full((2, 6), -1, dtype=torch.int32), torch.tensor([1, 3]))
    assert torch.equal(logits.view(torch.int32), before.view(torch.int32))  # bit for bit, NaN too


@pytest.mark.parametrize("kernel_id", LOCKED)
def test_graph_style_views_are_written_in_place(kernel_id):
    """A row-strided logits view (a slice of a wider buffer) is written through, its neighbours left."""
    buf = torch.zeros(3, 80)
    logits = buf[:, :70]
    bits = torch.zeros(3, 3, dtype=torch.int32)
    run(kernel_id, logits, bits)
    assert torch.isinf(buf[:, :70]).all() and (buf[:, 70:] == 0).all()


@needs_xgrammar
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_xgrammar_bridge_on_cpu(dtype):
    """The xgrammar kernel's bridging (indices scattered into a full bitmask, ids past ``32 W`` banned), run
    through xgrammar's CPU kernel on vocabularies >= 32 (under 16 it corrupts the heap: why selection keeps
    the kernel to CUDA)."""
    cases = [c for c in CASES if c[1] >= 32]
    banned = [_check_case("xgrammar.apply_token_bitmask", dtype, s, c) for s, c in enumerate(cases)]
    assert min(banned) > 0, banned
    test_hand_worked_wide("xgrammar.apply_token_bitmask")
    wide = torch.zeros(2, 40, dtype=torch.int32)  # words of a row-strided view: only the first 2 are read
    wide[:, 1] = 1
    logits = torch.zeros(2, 64)
    run("xgrammar.apply_token_bitmask", logits, wide[:, :2])
    assert (torch.isfinite(logits).nonzero()[:, 1] == 32).all() and torch.isfinite(logits).sum() == 2


def test_hand_worked_wide(kernel_id="torch_native.apply_token_bitmask"):
    """40 tokens, 1 word: tokens 32..39 lie past the words (banned); row 1 masked through indices."""
    logits = torch.zeros(2, 40)
    run(kernel_id, logits, torch.tensor([[0b1001]], dtype=torch.int32), torch.tensor([1]))
    assert (logits[0] == 0).all()
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [0, 3]


@interpreted
def test_triton_interpreted_matches_oracle():
    for seed, case in enumerate(CASES):
        for dtype in (torch.float32, torch.bfloat16):
            _check_case("triton.apply_token_bitmask", dtype, seed, case)
    assert _check_case("triton.apply_token_bitmask", torch.float16, 7, CASES[1], index_dtype=torch.int32) > 0


@interpreted
def test_triton_interpreted_hand_worked_and_no_op():
    test_hand_worked("triton.apply_token_bitmask")
    test_hand_worked_wide("triton.apply_token_bitmask")
    test_all_ones_words_change_nothing("triton.apply_token_bitmask")
    test_graph_style_views_are_written_in_place("triton.apply_token_bitmask")


# ------------------------------------------------------------------------------------------ selection
def test_selection_on_cpu_explains_rejections():
    logits, bits = torch.zeros(2, 40), torch.ones(2, 2, dtype=torch.int32)
    rep = lz.explain(OP, logits, bits)
    codes = [r.code for r in rep.candidate("triton.apply_token_bitmask").reasons]
    assert lz.ReasonCode.DEVICE_TYPE_UNSUPPORTED in codes
    codes = [r.code for r in rep.candidate("xgrammar.apply_token_bitmask").reasons]
    assert lz.ReasonCode.DEVICE_TYPE_UNSUPPORTED in codes or lz.ReasonCode.BACKEND_NOT_INSTALLED in codes
    assert lz.which(OP, logits, bits) == "torch_native.apply_token_bitmask"
    codes = [r.code for r in lz.explain(OP, logits.double(), bits).candidate(KX).reasons]
    assert lz.ReasonCode.DTYPE_UNSUPPORTED in codes


def test_no_rows_is_a_no_op():
    logits = torch.randn(2, 9)
    before = logits.clone()
    lz.apply_token_bitmask(logits, torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int64))
    assert torch.equal(logits, before)


# ------------------------------------------------------------------------------------------ bad input
I32 = torch.int32
BAD = [
    (
        "logits int",
        lambda: (torch.zeros(2, 9, dtype=I32), torch.zeros(2, 1, dtype=I32), None),
        "logits.dtype",
    ),
    ("logits 1-D", lambda: (torch.zeros(9), torch.zeros(1, 1, dtype=I32), None), "logits rank"),
    ("logits V=0", lambda: (torch.zeros(2, 0), torch.zeros(2, 1, dtype=I32), None), "logits shape"),
    (
        "bitmask int64",
        lambda: (torch.zeros(2, 9), torch.zeros(2, 1, dtype=torch.int64), None),
        "bitmask.dtype",
    ),
    ("bitmask list", lambda: (torch.zeros(2, 9), [[1]], None), "bitmask: expected an int32"),
    ("bitmask 1-D", lambda: (torch.zeros(2, 9), torch.zeros(2, dtype=I32), None), "bitmask shape"),
    ("bitmask W=0", lambda: (torch.zeros(2, 9), torch.zeros(2, 0, dtype=I32), None), "bitmask shape"),
    ("rows differ", lambda: (torch.zeros(3, 9), torch.zeros(2, 1, dtype=I32), None), "bitmask rows"),
    (
        "indices float",
        lambda: (torch.zeros(3, 9), torch.zeros(1, 1, dtype=I32), torch.zeros(1)),
        "indices.dtype",
    ),
    (
        "indices len",
        lambda: (torch.zeros(3, 9), torch.zeros(1, 1, dtype=I32), torch.tensor([0, 1])),
        "indices shape",
    ),
    (
        "index range",
        lambda: (torch.zeros(3, 9), torch.zeros(1, 1, dtype=I32), torch.tensor([3])),
        r"indices\[0\]",
    ),
    (
        "index < 0",
        lambda: (torch.zeros(3, 9), torch.zeros(1, 1, dtype=I32), torch.tensor([-1])),
        r"indices\[0\]",
    ),
    (
        "repeated",
        lambda: (torch.zeros(3, 9), torch.zeros(2, 1, dtype=I32), torch.tensor([1, 1])),
        "indices values.*distinct",
    ),
    ("indices list", lambda: (torch.zeros(3, 9), torch.zeros(1, 1, dtype=I32), [0]), "indices: expected"),
    (
        "device",
        lambda: (torch.zeros(2, 9), torch.zeros(2, 1, dtype=I32, device="meta"), None),
        "bitmask.device",
    ),
]


@pytest.mark.parametrize(("name", "make", "match"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_typed_error_before_any_write(name, make, match):
    logits, bits, idx = make()
    before = logits.clone() if isinstance(logits, torch.Tensor) and logits.device.type == "cpu" else None
    with pytest.raises(lz.InvalidInputError, match=f"lz.apply_token_bitmask: {match}"):
        lz.apply_token_bitmask(logits, bits, idx)
    if before is not None:
        assert torch.equal(logits, before) or (logits.isnan() == before.isnan()).all()


def test_logits_requiring_grad_are_refused():
    logits = torch.zeros(1, 9, requires_grad=True)
    with pytest.raises(lz.InvalidInputError, match="requires_grad.*no_grad"):
        lz.apply_token_bitmask(logits, torch.zeros(1, 1, dtype=I32))
    with torch.no_grad():
        lz.apply_token_bitmask(logits, torch.zeros(1, 1, dtype=I32))
    assert torch.isinf(logits).all()
