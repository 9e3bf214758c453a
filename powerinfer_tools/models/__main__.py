"""``python -m powerinfer_tools.models``: the supported-models table of docs/reference/supported-models.md, made
from the families' rows (tests/test_supported_models.py checks the page holds it)."""

from powerinfer_tools.models import FAMILIES
from powerinfer_tools.formats.rope import RopeKind

_FFN_NAMES = {"swiglu": "SwiGLU", "reglu": "ReGLU", "drelu": "dReLU", "geglu": "GeGLU", "relu": "ReLU"}


def table() -> str:
    lines = ["| family | transformers class (config.json `model_type`) | llama.cpp GGUF architecture | FFN | rotary "
             "scaling |", "|---|---|---|---|---|"]
    for family in FAMILIES:
        gguf = ", ".join(f"`{name}`" for name in (family.gguf_names if family.gguf_names is not None
                                                   else (family.gguf_name,)))
        if family.gguf_names == ():
            gguf = f"`{family.gguf_name}` (read back as that family)"
        if family.moe:
            gguf += ", with experts"
        classes = f"{', '.join(family.hf_classes)} ({', '.join(f'`{t}`' for t in family.model_types)})"
        ffn = ", ".join(_FFN_NAMES[kind.value] for kind in family.ffn_kinds)
        rope = ", ".join(kind.value for kind in family.rope_kinds if kind is not RopeKind.NONE) if family.rotary \
            else "learned positions"
        lines.append(f"| {family.name} | {classes} | {gguf} | {ffn} | {rope or '-'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(table(), end="")
