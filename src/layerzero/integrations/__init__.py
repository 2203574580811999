"""Integrations of LayerZero with other libraries (Hugging Face Transformers, ...).

Each integration imports its third-party library lazily, only when one of its functions is called, so
``import layerzero`` never imports them. Integrations build on ``layerzero.core`` and the public ops; the
core never imports an integration.
"""
