"""The server fixtures of tests/engine/serving (a live OpenAI-compatible server on the tiny checkpoint and the
official ``openai`` client), for test_server.py."""

from ..serving.conftest import client, engine, model_dir, server  # noqa: F401
