"""qdeploy: deploy float ONNX CNNs onto integer matrix-only accelerators."""

__version__ = "0.1.0"

# The Python API (design.md section 6), imported on first use so that `import qdeploy` stays light (PEP 562).
# The implementation lives in qdeploy/calibration.py, not qdeploy/calibrate.py: importing a submodule named
# `calibrate` would replace this function attribute with the module.
_LAZY_API = {"calibrate": "qdeploy.calibration", "compile": "qdeploy.api", "run": "qdeploy.api",
             "inspect": "qdeploy.api", "lower_model": "qdeploy.api", "report": "qdeploy.api"}


def __getattr__(name: str):
    if name in _LAZY_API:
        import importlib

        value = getattr(importlib.import_module(_LAZY_API[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'qdeploy' has no attribute {name!r}")
