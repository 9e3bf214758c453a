"""Stage 3: checkpoint to model file (GGUF or PowerInfer), with sparsity and hot-first order."""
