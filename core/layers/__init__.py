"""Building blocks shared by model architectures."""

from tokenmill.layers.linear import Linear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.quantizer import Quantizer
from tokenmill.layers.rotary import RotaryEmbedding

__all__ = ["Linear", "Quantizer", "RMSNorm", "RotaryEmbedding"]
