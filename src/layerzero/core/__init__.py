"""LayerZero core: backend-agnostic specs, context, registry, policy, selection, cache, PerfDB, health."""
