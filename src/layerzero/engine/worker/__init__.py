"""Builds and runs one forward batch per step (model runner, batch metadata, CUDA graphs)."""
