"""Training the DSpark drafter: self-distillation data, the DSpark objective, calibration, acceptance."""
