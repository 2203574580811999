"""The engine core: scheduler, KV cache manager and the step loop (schedule -> execute -> update), speaking
plain data (:mod:`.messages`) so it can run in its own process (vLLM V1's ``EngineCore``)."""
