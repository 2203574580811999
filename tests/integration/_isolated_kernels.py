"""Worker-side kernels for tests/integration/test_isolation.py (imported only inside the isolated worker)."""

from __future__ import annotations

import os
import time

import torch


def rms_norm(x, weight, eps=1e-6, residual=None):
    """float32 RMSNorm (with the fused residual add when given), in x's dtype."""
    if residual is not None:
        h = x + residual
        return rms_norm(h, weight, eps), h
    xf = x.double() if x.dtype == torch.float64 else x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(xf.dtype)).to(x.dtype)


def identity(x, *rest):
    return x


def echo(*args, **kwargs):
    return args, sorted(kwargs.items())


def pid(*args):
    return os.getpid()


def sleepy(x, weight, eps=1e-6, residual=None):
    time.sleep(float(os.environ.get("LZ_TEST_SLEEP", "30")))
    return x


def boom(*args):
    raise ValueError("boom from the worker")


def crash(*args):
    os._exit(3)


def add_one_inplace(x):
    """Writes its input in place (a KV-cache-style write) and returns its device and sum."""
    x.add_(1)
    return str(x.device), float(x.sum())
