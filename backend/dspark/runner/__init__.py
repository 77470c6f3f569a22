"""Running the target on the device: model runner, CUDA graphs, attention batches, KV cache, models."""
