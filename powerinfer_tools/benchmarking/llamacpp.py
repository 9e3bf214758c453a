"""Loading a GGUF file with llama.cpp (through llama-cpp-python): the dense baseline of ``pitools
bench`` and the tests' independent oracle."""

from __future__ import annotations

from pathlib import Path


def load_llama_cpp(path: str | Path, **kwargs):
    """llama-cpp-python's ``Llama`` with llama.cpp's "extra" weight buffers off.

    Those repack quantized weights for AMX when the CPU reports it; on the development machine the
    AMX tile instructions then fault (SIGSEGV in ggml_backend_amx_mul_mat, for llama.cpp's own
    quantized files too). The plain CPU kernels compute the same. ``kwargs`` go to ``Llama``
    (``verbose`` defaults to False).
    """
    import llama_cpp.llama as llama_module

    defaults = llama_module.llama_cpp.llama_model_default_params

    def params():
        p = defaults()
        p.use_extra_bufts = False
        return p

    llama_module.llama_cpp.llama_model_default_params = params
    try:
        kwargs.setdefault("verbose", False)
        return llama_module.Llama(str(path), **kwargs)
    finally:
        llama_module.llama_cpp.llama_model_default_params = defaults
