"""The scheduler (continuous batching, chunked prefill, preemption), its policies and its plain-data
output."""
