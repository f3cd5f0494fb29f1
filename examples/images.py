"""Real photographs for calibration and evaluation, from installed packages only (design.md section 8).

Sources (`SOURCES`, in this order): the colour photographs that scikit-image 0.26 ships inside its wheel
(`skimage.data` functions that load without `pooch` or a network) and matplotlib's sample photograph:

    split  name                  from                                         size (HxW)
    calib  astronaut             skimage.data.astronaut()                     512x512
    calib  coffee                skimage.data.coffee()                        400x600
    calib  hubble_deep_field     skimage.data.hubble_deep_field()             872x1000
    calib  motorcycle_left       skimage.data.stereo_motorcycle()[0]          500x741
    calib  motorcycle_right      skimage.data.stereo_motorcycle()[1]          500x741
    calib  retina                skimage.data.retina()                        1411x1411
    eval   chelsea               skimage.data.chelsea() (== .cat())           300x451
    eval   grace_hopper          matplotlib sample_data/grace_hopper.jpg      600x512
    eval   immunohistochemistry  skimage.data.immunohistochemistry()          512x512
    eval   rocket                skimage.data.rocket()                        427x640

The split is by scene (the two motorcycle views are one scene, so both are calibration), 6 images / 4 images,
so no evaluation image is a crop of a calibration photograph. Left out: skimage's other colour arrays are
synthetic (colorwheel, logo, chessboard) or need pooch (eagle, lily, skin, ...); its grayscale photographs
(camera, coins, moon, ...) are not colour; matplotlib's other images are clip art and logos.

The held-out protocol (`POOL`, `leave_sources_out`, `make_split_folders`; bench/fidelity.py): every scene
above and the grayscale images scikit-image ships (stacked to RGB), tagged by kind, so that whole kinds of input
nobody tuned on are in the evaluation: photographs (the colour ones above; camera, coins, clock), astronomy
(hubble_deep_field, moon), medical (retina), microscopy (immunohistochemistry, cell), textures (brick, grass,
gravel) and documents (page, text). `leave_sources_out(k)` deals the scenes of each kind to k folds in turn; split
i evaluates on fold i's scenes and calibrates on all the others', so calibration and evaluation never share a
source image, and every split has photographs and out-of-distribution kinds on both sides.

Normalisation, EfficientNet-Lite's: x = (rgb - 127) / 128 on 0..255 values (`MEAN`, `STD`), so inputs lie in
[-0.9922, 1.0].
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from PIL import Image

MEAN = 127.0
STD = 128.0
SPLITS = ("calib", "eval")
MANIFEST = "sources.json"  # written into each image folder by make_image_folders


def _skimage(name: str) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        import skimage.data

        return getattr(skimage.data, name)()

    return load


def _stereo_motorcycle(view: int) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        import skimage.data

        return skimage.data.stereo_motorcycle()[view]

    return load


def _matplotlib(filename: str) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        from matplotlib import cbook

        with Image.open(cbook.get_sample_data(filename, asfileobj=False)) as image:
            return np.asarray(image.convert("RGB"))

    return load


def _skimage_gray(name: str) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        import skimage.data

        return np.repeat(getattr(skimage.data, name)()[:, :, None], 3, axis=2)

    return load


@dataclass(frozen=True)
class Source:
    name: str
    split: str  # "calib" or "eval" (the fixed split of SOURCES; "pool" for the held-out protocol's other images)
    load: Callable[[], np.ndarray]  # -> HxWx3 uint8 RGB
    kind: str = "photograph"  # what the image shows (the held-out protocol's out-of-distribution kinds)
    scene: str = ""  # images of one scene are never on both sides of a split; "" is the image's own name

    @property
    def scene_name(self) -> str:
        return self.scene or self.name


SOURCES: tuple[Source, ...] = (
    Source("astronaut", "calib", _skimage("astronaut")),
    Source("coffee", "calib", _skimage("coffee")),
    Source("hubble_deep_field", "calib", _skimage("hubble_deep_field"), kind="astronomy"),
    Source("motorcycle_left", "calib", _stereo_motorcycle(0), scene="motorcycle"),
    Source("motorcycle_right", "calib", _stereo_motorcycle(1), scene="motorcycle"),
    Source("retina", "calib", _skimage("retina"), kind="medical"),
    Source("chelsea", "eval", _skimage("chelsea")),
    Source("grace_hopper", "eval", _matplotlib("grace_hopper.jpg")),
    Source("immunohistochemistry", "eval", _skimage("immunohistochemistry"), kind="microscopy"),
    Source("rocket", "eval", _skimage("rocket")),
)

# The held-out protocol's pool: SOURCES and scikit-image's grayscale images (all in its wheel), as RGB.
POOL: tuple[Source, ...] = SOURCES + (
    Source("camera", "pool", _skimage_gray("camera")),
    Source("coins", "pool", _skimage_gray("coins")),
    Source("clock", "pool", _skimage_gray("clock")),
    Source("moon", "pool", _skimage_gray("moon"), kind="astronomy"),
    Source("cell", "pool", _skimage_gray("cell"), kind="microscopy"),
    Source("brick", "pool", _skimage_gray("brick"), kind="texture"),
    Source("grass", "pool", _skimage_gray("grass"), kind="texture"),
    Source("gravel", "pool", _skimage_gray("gravel"), kind="texture"),
    Source("page", "pool", _skimage_gray("page"), kind="document"),
    Source("text", "pool", _skimage_gray("text"), kind="document"),
)
KINDS = ("photograph", "astronomy", "medical", "microscopy", "texture", "document")


@functools.cache
def _load(name: str) -> np.ndarray:
    (source,) = [s for s in POOL if s.name == name]
    rgb = np.ascontiguousarray(source.load())
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"source image {name!r}: expected HxWx3 uint8 RGB, got {rgb.shape} {rgb.dtype}")
    rgb.flags.writeable = False  # shared by every caller through the cache
    return rgb


def source_images(split: str | None = None) -> list[tuple[str, np.ndarray]]:
    """[(name, HxWx3 uint8 RGB, read-only)] in SOURCES order; only the `split` ("calib" or "eval") if given."""
    if split is not None and split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return [(s.name, _load(s.name)) for s in SOURCES if split is None or s.split == split]


def split_names(split: str) -> list[str]:
    """Names of the source images in `split`, in SOURCES order."""
    return [name for name, _ in source_images(split)]


def _resize_shorter_side(image: Image.Image, size: int) -> Image.Image:
    width, height = image.size
    scale = size / min(width, height)
    new_size = (max(size, round(width * scale)), max(size, round(height * scale)))
    return image.resize(new_size, Image.Resampling.BILINEAR)


def preprocess(rgb_uint8: np.ndarray, size: int = 224) -> np.ndarray:
    """HxWx3 uint8 RGB -> 3 x size x size float32: shorter side resized to `size` (Pillow bilinear), centre
    crop (odd margins leave the extra pixel at the bottom/right), then (x - MEAN) / STD."""
    rgb = np.asarray(rgb_uint8)
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"preprocess: expected an HxWx3 uint8 RGB array, got {rgb.shape} {rgb.dtype}")
    image = _resize_shorter_side(Image.fromarray(rgb), size)
    left, top = (image.size[0] - size) // 2, (image.size[1] - size) // 2
    image = image.crop((left, top, left + size, top + size))
    x = (np.asarray(image, dtype=np.float32) - np.float32(MEAN)) / np.float32(STD)
    return np.ascontiguousarray(x.transpose(2, 0, 1))


@dataclass(frozen=True)
class View:
    """One random view of a source image: crop rows top..top+height, columns left..left+width, maybe mirrored."""

    source: str
    top: int
    left: int
    height: int
    width: int
    flipped: bool


def _random_views(split: str, n: int, seed: int) -> list[View]:
    """n views of the `split` sources, taken in turn (view i from source i mod count). Crop height is
    U(0.3, 1) times the shorter side, aspect ratio (width / height) log-uniform in [3/4, 4/3] (width clipped to
    the image), position uniform, horizontal flip with probability 1/2. The random stream is
    default_rng([seed, index of split]), so the eval views do not depend on how many calib views were drawn."""
    return _views_of(split_names(split), n, np.random.default_rng([seed, SPLITS.index(split)]))


def _views_of(names: list[str], n: int, rng: np.random.Generator) -> list[View]:
    """n views of the sources `names`, taken in turn (view i from source i mod count); see _random_views."""
    sources = [(name, _load(name)) for name in names]
    views = []
    for i in range(n):
        name, rgb = sources[i % len(sources)]
        image_height, image_width = rgb.shape[:2]
        height = round(min(image_height, image_width) * rng.uniform(0.3, 1.0))
        aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        width = min(image_width, round(height * aspect))
        top = int(rng.integers(0, image_height - height + 1))
        left = int(rng.integers(0, image_width - width + 1))
        views.append(View(name, top, left, height, width, flipped=bool(rng.random() < 0.5)))
    return views


def _render(view: View, shorter_side: int) -> np.ndarray:
    crop = _load(view.source)[view.top : view.top + view.height, view.left : view.left + view.width]
    if view.flipped:
        crop = crop[:, ::-1]
    image = _resize_shorter_side(Image.fromarray(np.ascontiguousarray(crop)), shorter_side)
    return np.asarray(image)


def _stored_side(size: int) -> int:
    """Shorter side of the stored views: size * 8 / 7 (256 for 224, the usual ImageNet resize before the crop)."""
    return round(size * 8 / 7)


def make_image_folders(
    calib_dir: str | os.PathLike,
    eval_dir: str | os.PathLike,
    n_calib: int,
    n_eval: int,
    size: int = 224,
    seed: int = 0,
    image_format: str = "jpeg",
) -> tuple[Path, Path]:
    """Write n_calib random views of the calibration photographs into calib_dir and n_eval views of the
    evaluation photographs into eval_dir (disjoint sources, see the module docstring), named
    `<index>_<source>.jpg` (or .png), shorter side size * 8 / 7, JPEG quality 95 or PNG. Each folder gets a
    `sources.json` naming its split, its source images and every view. Folders are created if missing; files
    listed by an earlier `sources.json` there are removed first; each file is written to a temporary name and
    renamed."""
    return tuple(_write_views(folder, split, split_names(split), _random_views(split, n, seed), seed, size,
                              image_format)
                 for split, folder, n in (("calib", calib_dir, n_calib), ("eval", eval_dir, n_eval)))


def _write_views(folder: str | os.PathLike, split: str, sources: list[str], views: list[View], seed: int, size: int,
                 image_format: str) -> Path:
    """Write `views` into `folder` as make_image_folders describes, with its `sources.json`."""
    if image_format not in ("jpeg", "png"):
        raise ValueError(f"image_format must be 'jpeg' or 'png', got {image_format!r}")
    suffix = ".jpg" if image_format == "jpeg" else ".png"
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    manifest_path = folder / MANIFEST
    if manifest_path.exists():
        for entry in json.loads(manifest_path.read_text())["images"]:
            (folder / entry["file"]).unlink(missing_ok=True)
    entries = []
    for i, view in enumerate(views):
        filename = f"{i:04d}_{view.source}{suffix}"
        tmp = folder / f".{filename}.tmp"
        Image.fromarray(_render(view, _stored_side(size))).save(
            tmp, format=image_format.upper(), **({"quality": 95} if image_format == "jpeg" else {})
        )
        os.replace(tmp, folder / filename)
        entries.append({"file": filename, **dataclasses.asdict(view)})
    manifest = {"split": split, "seed": seed, "size": size, "sources": sources, "images": entries}
    tmp = folder / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, manifest_path)
    return folder


@dataclass(frozen=True)
class HeldOutSplit:
    """One split of the held-out protocol: calibrate on `calib` scenes' images, evaluate on `eval`'s."""

    name: str
    calib: tuple[str, ...]  # source names, POOL order
    eval: tuple[str, ...]


def leave_sources_out(folds: int = 3) -> list[HeldOutSplit]:
    """`folds` leave-sources-out splits of POOL. The scenes of each kind (KINDS order, then POOL order) are dealt
    to the folds in turn, one running count over all kinds, so folds differ in size by at most one scene and each
    kind with at least `folds` scenes is on both sides of every split. Split i evaluates fold i."""
    if folds < 2:
        raise ValueError(f"leave_sources_out needs at least 2 folds, got {folds}")
    scenes: list[str] = []
    for kind in KINDS:
        scenes += [s for s in dict.fromkeys(src.scene_name for src in POOL if src.kind == kind)]
    fold_of = {scene: i % folds for i, scene in enumerate(scenes)}
    return [HeldOutSplit(f"fold{i}", tuple(s.name for s in POOL if fold_of[s.scene_name] != i),
                         tuple(s.name for s in POOL if fold_of[s.scene_name] == i)) for i in range(folds)]


def source_kind(name: str) -> str:
    """The kind of the POOL source `name` (photograph, astronomy, ...)."""
    (source,) = [s for s in POOL if s.name == name]
    return source.kind


def make_split_folders(calib_dir: str | os.PathLike, eval_dir: str | os.PathLike, split: HeldOutSplit,
                       n_calib: int, n_eval: int, size: int = 224, seed: int = 0,
                       image_format: str = "jpeg") -> tuple[Path, Path]:
    """make_image_folders for a held-out split: n_calib views of split.calib's images and n_eval of split.eval's
    (random streams default_rng([seed, 0]) and default_rng([seed, 1]), as make_image_folders')."""
    return tuple(_write_views(folder, f"{split.name}-{side}", list(names),
                              _views_of(list(names), n, np.random.default_rng([seed, index])), seed, size,
                              image_format)
                 for index, (side, folder, names, n) in enumerate((("calib", calib_dir, split.calib, n_calib),
                                                                 ("eval", eval_dir, split.eval, n_eval))))


def image_batch(n: int, seed: int, split: str = "eval", size: int = 224) -> np.ndarray:
    """n preprocessed random views of the `split` photographs, float32 (n, 3, size, size), in memory. The
    views are those make_image_folders(seed=seed, size=size) writes, before JPEG/PNG encoding: with PNG,
    preprocess(file) equals image_batch(...)[i] exactly."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    views = _random_views(split, n, seed)
    batch = np.empty((n, 3, size, size), np.float32)
    for i, view in enumerate(views):
        batch[i] = preprocess(_render(view, _stored_side(size)), size)
    return batch
