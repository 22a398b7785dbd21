"""oscar-hf: OSCAR near-2-bit KV-cache quantization for Hugging Face transformers."""

from oscar_hf.verbosity import follow_transformers_verbosity

# first, so that every oscar_hf.* module (each one imports this package first) logs under transformers' verbosity
follow_transformers_verbosity()

from oscar_hf.attention import OSCAR_ATTENTION, oscar_attention_forward, register
from oscar_hf.cache import OscarCache, use_oscar_attention
from oscar_hf.config import PRESETS, OscarConfig
from oscar_hf.graph_decode import GraphDecodeError, graphed_generate
from oscar_hf.model_support import UnsupportedModelError
from oscar_hf.rotations.rotations import RotationFileError, Rotations

register()

__all__ = [
    "OSCAR_ATTENTION",
    "OscarCache",
    "OscarConfig",
    "GraphDecodeError",
    "PRESETS",
    "RotationFileError",
    "Rotations",
    "UnsupportedModelError",
    "graphed_generate",
    "oscar_attention_forward",
    "register",
    "use_oscar_attention",
]
__version__ = "0.1.0"

_REMOVED = {
    "generate_with_graphs": "generate_with_graphs was removed: model.generate(ids, past_key_values=OscarCache(model)) "
                            "compiles the decode step and replays it from CUDA graphs by itself, for every "
                            "decoding strategy; drop the custom_generate= argument",
}


def __getattr__(name: str):
    if name in _REMOVED:
        raise AttributeError(_REMOVED[name])
    raise AttributeError(f"module 'oscar_hf' has no attribute {name!r}")
