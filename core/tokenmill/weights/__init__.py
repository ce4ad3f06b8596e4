"""Reading model weights: the ``WeightFormat`` interface and the built-in formats.

Importing this package is cheap: torch, numpy, safetensors and gguf are
imported only when a format reads a file.
"""

from tokenmill.weights.format import LoadedTensor, WeightFormat, WeightsError
from tokenmill.weights.gguf_format import GGUFFormat
from tokenmill.weights.safetensors_format import SafetensorsFormat

__all__ = ["GGUFFormat", "LoadedTensor", "SafetensorsFormat", "WeightFormat", "WeightsError"]
