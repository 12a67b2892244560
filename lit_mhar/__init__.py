"""lit-mhar: learned depth routing (AttnRes, Block AttnRes, MHAR, Delta AttnRes) for transformers."""

from lit_mhar.config import ModelConfig
from lit_mhar.model import LM

__version__ = "0.1.0"
__all__ = ["ModelConfig", "LM", "__version__"]
