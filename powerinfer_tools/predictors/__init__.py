"""Stage 2: training the per-layer neuron predictors from a profile."""
