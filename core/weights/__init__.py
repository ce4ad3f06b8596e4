"""Reading model weights: the ``WeightFormat`` interface and the built-in formats."""

from tokenmill.weights.format import LoadedTensor, WeightFormat, WeightsError

__all__ = ["LoadedTensor", "WeightFormat", "WeightsError"]
