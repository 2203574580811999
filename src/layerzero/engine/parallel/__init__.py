"""Tensor / expert parallelism inside one engine: the ranks' layout (:mod:`.state`), the parallel layers and
the collectives the model calls (through LayerZero's collective ops). See ``docs/parallel.md``."""
