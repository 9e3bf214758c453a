"""Stage 1: running a model over calibration text: firing profiles, corpora, perplexity."""
