"""Adapters that drive real vLLM scheduler-side code (`vllm-offloading`, `vllm-simple-cpu`)."""
