"""oscar-hf: OSCAR near-2-bit KV-cache quantization for Hugging Face transformers."""

from .attention import OSCAR_ATTENTION, oscar_attention_forward, register
from .cache import OscarCache, use_oscar_attention
from .config import PRESETS, OscarConfig
from .graph_decode import GraphDecodeError, generate_with_graphs, graphed_generate
from .models import UnsupportedModelError
from .rotations import RotationFileError, Rotations

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
    "generate_with_graphs",
    "graphed_generate",
    "oscar_attention_forward",
    "register",
    "use_oscar_attention",
]
__version__ = "0.1.0"
