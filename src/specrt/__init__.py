"""specrt: speculative decoding, exported to ONNX / TensorRT bundles and run by a lean runtime."""

__version__ = "0.1.0"
