"""Fuzz the policy parser (``Policy.from_yaml``) and the environment parser (``read_env``).

Invariant: whatever the input, the only exceptions are LayerZero's typed errors
(``PolicyValidationError`` / ``ConfigurationError``, both ``LayerZeroError``); anything else — a bare
``KeyError``, ``RecursionError``, ``yaml`` error leaking out, a crash or a hang — is a bug.

With atheris installed (``pip install atheris``; Linux, CPython <= 3.11) it runs coverage-guided:

    PYTHONPATH=src python fuzz/fuzz_policy.py -atheris_runs=100000

Without atheris it falls back to a bounded random loop (random.Random(seed)) that mutates valid policies
and writes random bytes, so it works anywhere:

    PYTHONPATH=src python fuzz/fuzz_policy.py --runs 2000 --seed 0
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from layerzero.core.env import ENV_VARS, read_env  # noqa: E402
from layerzero.core.errors import LayerZeroError  # noqa: E402
from layerzero.core.policy import Policy  # noqa: E402

logging.getLogger("layerzero").setLevel(logging.ERROR)  # unknown-variable warnings are expected here

SEEDS = [
    b"version: 1\n",
    b"version: 1\nlocks: [{op: attention, kernel: torch_sdpa.math, when: {device: cpu, head_dim: "
    b"'<=128'}}]\n",
    b"version: 1\nallow: [{op: attention, kernels: ['torch_sdpa.*', reference], when: {sm: [80, '>=90']}}]\n",
    b"version: 1\ndeny: [{kernels: [torch_sdpa.cudnn], when: {head_dim: '64..256', is_causal: true}}]\n",
    b"version: 1\nboosts: [{kernels: [torch_sdpa.flash], by: -2.5, when: {device_name: '*H100*'}}]\n",
    b"version: 1\ndeny:\n  - {kernels: [a], when: &w {sm: '<90'}}\n  - {kernels: [b], when: *w}\n",
]
TOKENS = [
    b"version",
    b": ",
    b"1",
    b"\n",
    b"- ",
    b"[",
    b"]",
    b"{",
    b"}",
    b",",
    b"&a ",
    b"*a",
    b"!!python/object:os.system",
    b"!!binary ",
    b"locks",
    b"allow",
    b"deny",
    b"boosts",
    b"kernels",
    b"kernel",
    b"when",
    b"by",
    b"op",
    b"'<=128'",
    b"'64..'",
    b"'1e999'",
    b".inf",
    b"null",
    b"true",
    b"~",
    b"<<: ",
    b"%TAG ! x\n",
    b"---\n",
    b"\t",
    b"\xff",
    b"\x00",
    b"? ",
    b"head_dim",
    b"sm",
    b"'*'",
]
ENV_ALPHABET = "abcdefghijklmnopqrstuvwxyz_ATTENTION=.*,-0123456789 \t;~/[]!?\u00e9"


def check_policy(data: bytes) -> None:
    """Feed ``data`` to Policy.from_yaml; only LayerZeroError may escape. Valid policies must round-trip."""
    try:
        policy = Policy.from_yaml(data)
    except LayerZeroError:
        return
    if Policy.from_dict(policy.to_dict()) != policy:
        raise AssertionError(f"round trip changed the policy for input {data[:200]!r}")
    _ = policy.hash


def check_env(environ: dict[str, str]) -> None:
    """Feed ``environ`` to read_env and Policy.from_env; only LayerZeroError may escape."""
    try:
        read_env(environ)
        Policy.from_env(environ)
    except LayerZeroError:
        return


def check_dict(data: object) -> None:
    """Feed structured data to Policy.from_dict; only LayerZeroError may escape."""
    try:
        Policy.from_dict(data)  # type: ignore[arg-type]
    except LayerZeroError:
        return


_KEYS = [
    "version",
    "locks",
    "allow",
    "deny",
    "boosts",
    "op",
    "kernel",
    "kernels",
    "by",
    "when",
    "head_dim",
    "sm",
    "device",
    "is_causal",
    "hidden_size",
    "bogus",
]
_LEAVES = [
    None,
    True,
    False,
    0,
    1,
    -1,
    2**70,
    1.5,
    float("nan"),
    float("inf"),
    "",
    "*",
    "a.b",
    "torch_sdpa",
    "<=128",
    ">=",
    "64..32",
    "1..2",
    "==1e400",
    "cuda",
    "[",
    b"x",
]


def _random_data(rnd: random.Random, depth: int = 0) -> object:
    roll = rnd.random()
    if depth > 4 or roll < 0.4:
        return rnd.choice(_LEAVES)
    if roll < 0.7:
        return [_random_data(rnd, depth + 1) for _ in range(rnd.randint(0, 3))]
    out = {rnd.choice(_KEYS): _random_data(rnd, depth + 1) for _ in range(rnd.randint(0, 4))}
    if depth == 0 and rnd.random() < 0.8:
        out["version"] = 1
    return out


def _mutate(rnd: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(rnd.randint(1, 6)):
        choice = rnd.random()
        pos = rnd.randint(0, len(buf))
        if choice < 0.35:
            buf[pos:pos] = rnd.choice(TOKENS)
        elif choice < 0.6 and buf:
            del buf[pos : pos + rnd.randint(1, 8)]
        elif choice < 0.8:
            buf[pos:pos] = bytes(rnd.randrange(256) for _ in range(rnd.randint(1, 4)))
        elif buf:
            i = rnd.randrange(len(buf))
            buf[i] = rnd.randrange(256)
    return bytes(buf)


def _random_env(rnd: random.Random) -> dict[str, str]:
    names = list(ENV_VARS) + ["LAYERZERO_", "LAYERZERO_STRIKT", "PATH"]
    env = {}
    for name in rnd.sample(names, rnd.randint(0, 4)):
        if name == "LAYERZERO_POLICY":
            continue  # random paths would read arbitrary files of this machine
        env[name] = "".join(rnd.choice(ENV_ALPHABET) for _ in range(rnd.randint(0, 24)))
    return env


def run_random(runs: int, seed: int) -> int:
    """The fallback loop: ``runs`` policy inputs and ``runs`` environments. Returns the number of inputs."""
    rnd = random.Random(seed)
    for i in range(runs):
        if i % 10 == 0:
            data = bytes(rnd.randrange(256) for _ in range(rnd.randint(0, 64)))
        else:
            data = _mutate(rnd, rnd.choice(SEEDS))
        check_policy(data)
        check_env(_random_env(rnd))
        check_dict(_random_data(rnd))
    return 3 * runs


def _atheris_one_input(data: bytes) -> None:
    check_policy(data)
    import atheris

    fdp = atheris.FuzzedDataProvider(data)
    names = sorted(n for n in ENV_VARS if n != "LAYERZERO_POLICY")
    env = {
        names[fdp.ConsumeIntInRange(0, len(names) - 1)]: fdp.ConsumeUnicodeNoSurrogates(32)
        for _ in range(fdp.ConsumeIntInRange(0, 3))
    }
    check_env(env)


def main(argv: list[str]) -> int:
    try:
        import atheris
    except ImportError:
        atheris = None
    if atheris is not None and not any(a.startswith("--runs") for a in argv):
        atheris.instrument_all()
        atheris.Setup([sys.argv[0], *argv], _atheris_one_input)
        atheris.Fuzz()
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2000, help="number of random inputs (fallback mode)")
    parser.add_argument("--seed", type=int, default=0, help="random.Random seed (fallback mode)")
    args = parser.parse_args(argv)
    if atheris is None:
        print("atheris not installed: running the bounded random fallback", file=sys.stderr)
    count = run_random(args.runs, args.seed)
    print(f"fuzz_policy: {count} inputs, no unexpected exception")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
