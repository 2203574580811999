"""``layerzero generate`` streams what ``LLM.generate`` returns; ``bench-engine``'s workload is nano-vllm's
and its roofline is worked out by hand."""

from __future__ import annotations

import random

import pytest
import torch

import layerzero as lz

pytestmark = pytest.mark.integration


def test_generate_streams_the_engine_text(checkpoints, capsys):
    from layerzero.cli import main
    from layerzero.engine import LLM, SamplingParams

    path = checkpoints["qwen3"]
    rc = main(
        [
            "generate",
            "--model",
            str(path),
            "--prompt",
            "The quick brown fox",
            "--max-tokens",
            "6",
            "--ignore-eos",
            "--device",
            "cpu",
            "--max-model-len",
            "64",
        ]
    )
    out = capsys.readouterr()
    (ref,) = LLM(path, device="cpu", dtype=torch.float32, max_model_len=64).generate(
        ["The quick brown fox"],
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
        use_tqdm=False,
    )
    assert rc == 0 and out.out == ref.outputs[0].text + "\n" and "finish_reason=length" in out.err


def test_workload_is_nano_vllms():
    from layerzero.engine.tools.bench import make_workload

    w = make_workload("full")
    random.seed(0)
    first_len = random.randint(100, 1024)
    first = [random.randint(0, 10000) for _ in range(first_len)]
    assert w.prompts[0] == first and len(w.prompts) == len(w.max_tokens) == 256
    assert all(100 <= len(p) <= 1024 for p in w.prompts) and all(100 <= n <= 1024 for n in w.max_tokens)
    assert all(0 <= t <= 10000 for p in w.prompts for t in p)


def test_roofline_by_hand():
    from layerzero.engine.tools.bench import Workload, roofline_tokens_per_s

    # one request, 10 prompt tokens, 2 outputs, 100 B of weights, 1 B of KV per token, 1 B/s:
    # steps cost (100 + 10) + (100 + 11) = 221 s for 2 tokens
    assert roofline_tokens_per_s(Workload([[0] * 10], [2]), 100, 1, 1.0) == pytest.approx(2 / 221)
    # two requests of 1 and 2 outputs: (100 + 3 + 5) + (100 + 6) = 214 s for 3 tokens
    assert roofline_tokens_per_s(Workload([[0] * 3, [0] * 5], [1, 2]), 100, 1, 1.0) == pytest.approx(3 / 214)


def test_chat_applies_the_template(checkpoints):
    from layerzero.engine import LLM, SamplingParams

    llm = LLM(checkpoints["qwen3"], device="cpu", dtype=torch.float32, max_model_len=96)
    msgs = [{"role": "user", "content": "hello world"}]
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    (chat,) = llm.chat(msgs, sp, use_tqdm=False)
    text = "<s>user: hello world\n<s>assistant:"  # CHAT_TEMPLATE of layerzero.testing.checkpoints, by hand
    ids = llm.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert chat.prompt_token_ids == ids
    (plain,) = llm.generate([ids], sp, use_tqdm=False)
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids


def test_shared_prefix_workload():
    from layerzero.engine.tools.bench_prefix import PREFIX_SCALES, shared_prefix_workload

    prompts, out = shared_prefix_workload("full")
    s = PREFIX_SCALES["full"]
    assert len(prompts) == 64 * 16 and out == 256 and all(len(p) == 2048 + 128 for p in prompts)
    assert (
        prompts[0][:2048] == prompts[64][:2048] != prompts[1][:2048]
    )  # request i of every group, interleaved
    assert len({tuple(p[: s["prefix"]]) for p in prompts}) == 64


def test_prefix_benchmark_at_cpu_scale(tmp_path):
    """``bench-engine --workload prefix`` end to end at the CPU scale: the shared prefix hits, the random
    workload does not, and each pair of runs reports comparable engines (pool size, preemptions, steps)."""
    from layerzero.engine.tools.bench import build_checkpoint
    from layerzero.engine.tools.bench_prefix import run_prefix

    path = build_checkpoint(tmp_path / "ckpt", "cpu", torch.float32)
    r = run_prefix(scale="cpu", model=str(path), device="cpu", repeats=2)
    sp, zh = r["shared_prefix"], r["zero_hit"]
    assert sp["requests"] == 16 and sp["hit_rate"] > 0.5 and zh["hit_rate"] == 0.0
    assert len(zh["pair_costs"]) == len(zh["pairs_seconds"]) == 2 and zh["cost"] in zh["pair_costs"]
    assert zh["cost"] == pytest.approx(zh["seconds_cache_on"] / zh["seconds_cache_off"] - 1.0)
    with pytest.raises(lz.InvalidInputError, match="repeats"):
        run_prefix(scale="cpu", model=str(path), device="cpu", repeats=0)
    for part in (sp, zh):
        assert part["seconds_cache_on"] > 0 and part["seconds_cache_off"] > 0
        on, off = part["num_kv_blocks"]
        assert on == off > 0  # the CPU pool has a documented default size: both runs got the same
        assert all(isinstance(n, int) and n >= 0 for n in part["preemptions"]) and min(part["steps"]) > 0


def test_prefix_benchmark_warm_run_leaves_a_cold_cache(tmp_path):
    """The CUDA benchmark times a second run of the workload after an untimed one with the prefix cache
    emptied (first-use compiles stay out of the timing): that run schedules and hits exactly as a fresh
    engine's does."""
    from layerzero.engine.tools.bench import build_checkpoint
    from layerzero.engine.tools.bench_prefix import run_shared_once

    path = str(build_checkpoint(tmp_path / "ckpt", "cpu", torch.float32))
    _, cold = run_shared_once(scale="cpu", model=path, device="cpu", warm_run=False)
    _, warm = run_shared_once(scale="cpu", model=path, device="cpu", warm_run=True)
    assert 0.5 < cold["prefix_hit_rate"] < 1.0 and warm["prefix_hit_rate"] == cold["prefix_hit_rate"]
    assert warm["steps"] == cold["steps"] > 0 and warm["preemptions"] == cold["preemptions"] == 0


def test_prefix_benchmark_gives_every_shared_prefix_run_the_first_pool(monkeypatch):
    """The cache-off (and, on CUDA, cascade) runs of the shared-prefix workload get the first run's KV pool
    size, so a smaller pool (fewer blocks free on the device after the first engine) cannot slow the baseline
    down."""
    from layerzero.engine.tools import bench_prefix

    calls = []

    def fake(path, device, dtype, prompts, max_tokens, caching, mml, budget=None, num_kv_blocks=None, **kw):
        calls.append((caching, num_kv_blocks))
        return 1.0, {"prefix_hit_rate": 0.5, "num_kv_blocks": 123, "preemptions": 0, "steps": 1}

    monkeypatch.setattr(bench_prefix, "_timed", fake)
    bench_prefix.run_prefix(scale="cpu", model="unused", device="cpu", zero_hit=False)
    assert calls == [(True, None), (False, 123)]


def test_batch1_decode_rate_excludes_the_first_token(monkeypatch):
    """``bench-engine``'s one-request run: the decode rate is the tokens after the first over the time after
    it, worked by hand on a fake clock (first delta of 1 token at 30 ms, then 2 tokens at 32 ms and 1 at 34
    ms: 3 tokens in 4 ms = 750 tok/s); the whole rate counts every token over the generate call."""
    from types import SimpleNamespace

    from layerzero.engine.tools import bench

    clock = [0.0]
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def delta(n):
        return SimpleNamespace(outputs=[SimpleNamespace(token_ids=[5] * n)])

    class FakeLLM:
        def generate(self, prompts, sp, use_tqdm):
            clock[0] += 0.5

        def stream(self, prompt, sp):
            start = clock[0]  # where the benchmark read the clock before iterating
            for at, n in ((0.030, 1), (0.032, 2), (0.034, 1)):
                clock[0] = start + at
                yield delta(n)

    llm = FakeLLM()
    r = bench._batch1(llm, torch.device("cpu"), [1, 2, 3], 4)
    assert r["output_tokens_per_s"] == pytest.approx(4 / 0.5) and r["seconds"] == pytest.approx(0.5)
    assert r["first_token_ms"] == pytest.approx(30.0) and r["decode_tokens_per_s"] == pytest.approx(750.0)


def _no_tokenizer(checkpoints, tmp_path):
    import shutil

    d = tmp_path / "no-tokenizer"
    shutil.copytree(checkpoints["qwen3"], d)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (d / f).unlink(missing_ok=True)
    return d


@pytest.mark.parametrize(
    "argv,match",
    [
        (
            ["generate", "--prompt", "hi", "--model", "{bad}"],
            r"config\.json: expected a JSON object.*invalid JSON",
        ),
        (
            ["generate", "--prompt", "hi", "--model", "{missing}"],
            r"checkpoint directory: expected a directory with "
            r"config\.json",
        ),
        (
            ["generate", "--prompt", "hi", "--model", "{plain}", "--device", "cuda"],
            r"LLM device: expected a device this "
            r"process can use",
        ),
        (
            ["generate", "--prompt", "hi", "--model", "{plain}", "--device", "bogus"],
            r"LLM device: expected a torch device",
        ),
        (
            ["generate", "--prompt", "hi", "--model", "{plain}", "--chat"],
            r"--chat: expected a checkpoint whose tokenizer "
            r"has a chat template, got no tokenizer in ",
        ),
        (
            ["generate", "--prompt", "hi", "--model", "{plain}"],
            r"prompt: expected token ids \(this checkpoint has no "
            r"tokenizer\)",
        ),
        (
            ["generate", "--prompt", "hi", "--model", "{plain}", "--max-tokens", "0"],
            r"SamplingParams.*max_tokens",
        ),
        (["bench-engine", "--device", "bogus"], r"LLM device: expected a torch device"),
        (
            ["bench-engine", "--model", "{missing}", "--device", "cpu", "--scale", "cpu", "--hf-batch", "0"],
            r"checkpoint directory",
        ),
        (
            [
                "bench-engine",
                "--model",
                "{missing}",
                "--device",
                "cpu",
                "--scale",
                "cpu",
                "--workload",
                "prefix",
            ],
            r"checkpoint directory",
        ),
    ],
    ids=lambda v: " ".join(v)[:60] if isinstance(v, list) else "",
)
def test_engine_commands_report_typed_errors_without_a_traceback(
    checkpoints, tmp_path, capsys, monkeypatch, argv, match
):
    """``layerzero: error: <message>`` on stderr and exit code 2 for every ConfigurationError /
    InvalidInputError."""
    import re

    from layerzero.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same on a GPU host
    plain = _no_tokenizer(checkpoints, tmp_path)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    paths = {"{plain}": str(plain), "{bad}": str(bad), "{missing}": str(tmp_path / "missing")}
    capsys.readouterr()  # what building the checkpoint printed
    rc = main([paths.get(a, a) for a in argv] + (["--device", "cpu"] if "--device" not in argv else []))
    out = capsys.readouterr()
    assert rc == 2, out.err
    assert out.err.startswith("layerzero: error: ") and re.search(match, out.err), out.err
    assert "Traceback" not in out.err and out.out == ""


@pytest.mark.parametrize("command", ["generate", "bench-engine"])
def test_engine_dtype_choices_are_what_the_engine_accepts(command, capsys):
    from layerzero.cli import ENGINE_DTYPES, build_parser
    from layerzero.engine.config import DTYPES

    assert ENGINE_DTYPES == tuple(str(d).removeprefix("torch.") for d in DTYPES)
    args = [command, "--model", "m", "--prompt", "p"] if command == "generate" else [command]
    assert build_parser().parse_args([*args, "--dtype", "bfloat16"]).dtype == "bfloat16"
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*args, "--dtype", "float64"])
    assert e.value.code == 2 and "invalid choice: 'float64'" in capsys.readouterr().err


GEN_FLAGS = ["--device", "cpu", "--max-model-len", "64", "--max-tokens", "5", "--ignore-eos"]
PROMPTS = ["The quick brown fox", "hello world", "a b c d"]


def _argv(path, prompts, priorities=None, extra=()):
    argv = ["generate", "--model", str(path), *GEN_FLAGS, *extra]
    for p in prompts:
        argv += ["--prompt", p]
    for pr in priorities or ():
        argv += ["--priority", str(pr)]
    return argv


def test_generate_runs_several_prompts_as_one_batch_in_order(checkpoints, capsys, monkeypatch):
    """Three prompts with priorities: one ``LLM.generate`` call (the priorities passed per prompt), outputs
    printed in prompt order, each equal to ``LLM.generate``'s for the same batch."""
    from layerzero.cli import main
    from layerzero.engine import LLM, SamplingParams

    path = checkpoints["qwen3"]
    calls = []
    real = LLM.generate

    def spy(self, prompts, sp=None, **kw):
        calls.append((list(prompts), kw.get("priority")))
        return real(self, prompts, sp, **kw)

    monkeypatch.setattr(LLM, "generate", spy)
    rc = main(_argv(path, PROMPTS, [2, 0, 1], ["--scheduling-policy", "priority"]))
    out = capsys.readouterr()
    monkeypatch.setattr(LLM, "generate", real)
    llm = LLM(path, device="cpu", dtype=torch.float32, max_model_len=64, scheduling_policy="priority")
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    refs = llm.generate(PROMPTS, sp, priority=[2, 0, 1], use_tqdm=False)
    assert rc == 0 and calls == [(PROMPTS, [2, 0, 1])]
    assert out.out == "".join(r.outputs[0].text + "\n" for r in refs)
    assert out.err.splitlines() == [f"[{i}: finish_reason=length]" for i in range(3)]


def test_generate_jsonl_and_a_single_prompt_with_priority(checkpoints, capsys):
    import json

    from layerzero.cli import main
    from layerzero.engine import LLM, SamplingParams

    path = checkpoints["qwen3"]
    assert main(_argv(path, PROMPTS[:2], None, ["--jsonl"])) == 0
    recs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    llm = LLM(path, device="cpu", dtype=torch.float32, max_model_len=64)
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    refs = llm.generate(PROMPTS[:2], sp, use_tqdm=False)
    assert [r["index"] for r in recs] == [0, 1] and all(r["priority"] is None for r in recs)
    assert [r["token_ids"] for r in recs] == [list(r.outputs[0].token_ids) for r in refs]
    assert [r["text"] for r in recs] == [r.outputs[0].text for r in refs]
    assert all(r["finish_reason"] == "length" and r["error"] is None for r in recs)
    # one prompt: streamed, its priority accepted
    assert main(_argv(path, PROMPTS[:1], [3], ["--scheduling-policy", "priority"])) == 0
    out = capsys.readouterr()
    assert out.out == refs[0].outputs[0].text + "\n" and "finish_reason=length" in out.err


@pytest.mark.parametrize(
    "prompts,priorities,extra,match",
    [
        (
            PROMPTS,
            [0, 1],
            ["--scheduling-policy", "priority"],
            r"--priority: expected none, or one per --prompt \(3\), got 2",
        ),
        (
            PROMPTS[:1],
            [0, 1],
            ["--scheduling-policy", "priority"],
            r"one per --prompt \(1\), got 2 --priority values",
        ),
        (
            PROMPTS[:2],
            [0, 1],
            [],
            r"--priority: expected --scheduling-policy priority .*got --scheduling-policy fcfs",
        ),
        (PROMPTS[:2], None, ["--max-num-seqs", "0"], r"LLM max_num_seqs: expected an int >= 1"),
        (PROMPTS[:2], None, ["--kv-cache-memory-fraction", "1.5"], r"LLM kv_cache_memory_fraction"),
        (PROMPTS[:2], None, ["--block-size", "-16"], r"LLM block_size: expected an int >= 1"),
    ],
)
def test_generate_flag_errors_are_typed(checkpoints, capsys, prompts, priorities, extra, match):
    """Mismatched ``--priority`` counts, priorities without the priority policy and out-of-range engine flags:
    ``layerzero: error: ...``, exit 2, nothing on stdout."""
    import re

    from layerzero.cli import main

    path = checkpoints["qwen3"]
    capsys.readouterr()
    rc = main(_argv(path, prompts, priorities, extra))
    out = capsys.readouterr()
    assert rc == 2 and out.out == "" and "Traceback" not in out.err
    assert out.err.startswith("layerzero: error: ") and re.search(match, out.err), out.err
