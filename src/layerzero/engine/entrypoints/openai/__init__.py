"""The OpenAI-compatible server (docs/serving.md): ``api_server`` (``build_app``, ``add_server_args``,
``run_server``), ``protocol`` (request bodies), ``serving_*`` (the endpoints), ``logprobs``, ``sse``,
``metrics``, ``errors``, ``guard`` (API key and body size). Importing this package imports no web library.
"""
