"""Hot-path ops: torch references here, Triton-language kernels beside them; dispatch picks one per call."""
