"""``make demo``'s server step (``python -m layerzero.engine.tools.demo_serve``): ``layerzero serve`` as a
child process, the ``openai`` client's completion and streamed chat, the kernel report, SIGTERM, exit 0."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


def test_demo_serve_talks_to_a_live_server_and_stops_it(model_dir, capsys):
    from layerzero.engine.tools import demo_serve

    assert demo_serve.main(["--model", model_dir, "--timeout", "90"]) == 0
    out = capsys.readouterr().out
    assert "server demo: OK" in out and "SIGTERM: drained, exit code 0" in out
    assert "completions (openai client, greedy)" in out and "chat, streamed in" in out
    assert "paged_attention" in out  # a row of /v1/layerzero/kernels
