"""Target model families (Llama, Qwen2, Qwen3) and their tensor-parallel-ready layers."""
