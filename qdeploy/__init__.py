"""qdeploy: deploy float ONNX CNNs onto integer matrix-only accelerators."""

__version__ = "0.1.0"
