"""Helpers for testing LayerZero and code built on it (tiny real Hugging Face models in :mod:`.hf_models`).

Nothing here is imported by ``import layerzero``; third-party libraries are imported only when used.
"""
