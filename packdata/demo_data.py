"""A deterministic built-in sample dataset: natural-looking JPEGs and small text files.

:func:`make_sample_images` writes an ImageFolder tree of synthetic photos (smooth
gradients, filled shapes, lines and a mild film-grain texture), so that JPEG
files have the sizes (about 15-100 KB, 40 KB on average) and decode costs of
real photos of that size, unlike random noise or flat colour. :func:`make_sample_texts` writes class folders of small
UTF-8 documents (``.txt`` with some ``.json`` and ``.md``) built from a fixed
vocabulary that includes non-ASCII words.

Both are fully deterministic: every file is generated from its own
:class:`numpy.random.Generator` seeded from ``(seed, index)``, so the same
arguments give byte-identical files whatever the number of workers (with the
same NumPy and Pillow versions: JPEG encoding and resampling are deterministic,
but a different libjpeg may encode differently). Each file is
written under a hidden temporary name and moved into place with
:func:`os.replace`, so an interrupted run never leaves a partial file behind.
Existing files of the same name are overwritten.
"""

from __future__ import annotations

import io
import json
import math
import operator
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image, ImageChops, ImageDraw

from packdata.host.cores import usable_cpus
from packdata.pack.files import atomic_write

__all__ = ["make_sample_images", "make_sample_texts"]

_IMAGE_THEMES = (
    "sunset",
    "ocean",
    "forest",
    "desert",
    "night",
    "meadow",
    "glacier",
    "volcano",
    "orchard",
    "harbour",
    "canyon",
    "tundra",
)
"""Class name stems; the class index decides palette and favoured shapes."""

_TEXT_THEMES = ("news", "reviews", "recipes", "science", "sports", "travel", "poetry", "finance")

_WIDTH_RANGE = (320, 480)
_HEIGHT_RANGE = (280, 420)
_QUALITY_RANGE = (75, 95)
_TEXT_SIZE_RANGE = (100, 4096)

_COMMON_TEXT = (
    "the a an and or but of to in on at by for with from into over under about after before while "
    "is are was were be been has have had do does did will would can could should may might must "
    "this that these those it its they them their we our you your he she his her one two three "
    "time year day way thing world life hand part place case point group number fact work week "
    "new old good great small large long little high early young important different local "
    "see make take know think come give find tell ask seem feel try leave call keep begin show "
    "café naïve résumé façade über jalapeño smörgåsbord déjà-vu 日本 東京 データ 中文 привет"
)
_COMMON_WORDS = tuple(_COMMON_TEXT.split())

_TOPIC_WORDS = (
    "report minister election council economy policy statement crisis market vote agency official",
    "product quality price delivery battery screen service recommend disappointed excellent stars",
    "flour butter sugar oven simmer garlic onion pepper whisk bake minutes tablespoon crème brûlée",
    "experiment hypothesis protein molecule galaxy neuron climate sample theory quantum enzyme data",
    "match goal season coach league striker referee tournament score victory defence penalty",
    "journey hotel beach mountain museum train passport island river village cathedral café",
    "moon silence autumn river whisper shadow dream heart snow light longing memory dawn",
    "stock bond yield inflation dividend portfolio revenue earnings currency interest hedge audit",
)


def _check_count(name: str, value: int, minimum: int) -> int:
    """``value`` as an ``int``, or :class:`ValueError` if it is not an integer >= ``minimum``."""
    try:
        number = operator.index(value)
    except TypeError:
        number = None
    if isinstance(value, bool) or number is None or number < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return number


def _class_names(stems: tuple[str, ...], prefix: str, num_classes: int) -> list[str]:
    """Folder names whose sorted order equals the class index: ``n00_sunset``, ``n01_ocean``, ..."""
    width = max(2, len(str(num_classes - 1)))
    return [f"{prefix}{c:0{width}d}_{stems[c % len(stems)]}" for c in range(num_classes)]


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a hidden temporary file and :func:`os.replace`."""
    atomic_write(path, data, tmp_suffix=f".{os.getpid()}.tmp")


# ----------------------------------------------------------------------------- images


def _hsv_to_rgb(h: float, s: float, v: float) -> np.ndarray:
    """One HSV colour (all in 0..1) as a float RGB triple in 0..255."""
    i = int(h * 6.0) % 6
    f = h * 6.0 - math.floor(h * 6.0)
    p, q, t = v * (1 - s), v * (1 - s * f), v * (1 - s * (1 - f))
    rgb = [(v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q)][i]
    return np.array(rgb, dtype=np.float32) * 255.0


def _class_colour(rng: np.random.Generator, label: int, num_classes: int, spread: float = 0.08) -> np.ndarray:
    """A colour near the class's characteristic hue, with random saturation and value."""
    hue = (label / max(num_classes, 1) + rng.normal(0.0, spread)) % 1.0
    return _hsv_to_rgb(hue, float(rng.uniform(0.35, 0.95)), float(rng.uniform(0.35, 1.0)))


def _rgb(colour: np.ndarray) -> tuple[int, int, int]:
    """A float colour as the integer triple ImageDraw takes, clipped to 0..255."""
    r, g, b = (min(255, max(0, int(v))) for v in colour.tolist())
    return r, g, b


def _any_colour(rng: np.random.Generator) -> np.ndarray:
    """A colour of any hue."""
    return _hsv_to_rgb(float(rng.random()), float(rng.uniform(0.2, 1.0)), float(rng.uniform(0.2, 1.0)))


def _background(rng: np.random.Generator, w: int, h: int, label: int, num_classes: int) -> Image.Image:
    """A smooth ``w`` x ``h`` background: a linear gradient at some angle, a radial glow and uneven light.

    It is computed on a coarse grid and upscaled, which costs almost
    nothing and is indistinguishable from a full-resolution gradient.
    """
    gw, gh = max(4, w // 8), max(4, h // 8)
    c0 = _class_colour(rng, label, num_classes)
    c1 = _class_colour(rng, label, num_classes, spread=0.2)
    angle = (label * 0.7 + rng.normal(0.0, 0.5)) % (2 * math.pi)
    ys = np.linspace(-0.5, 0.5, gh)[:, None]
    xs = np.linspace(-0.5, 0.5, gw)[None, :]
    t = np.clip(xs * math.cos(angle) + ys * math.sin(angle) + 0.5, 0.0, 1.0)[..., None]
    img = c0 * (1.0 - t) + c1 * t
    cx, cy = rng.uniform(-0.4, 0.4, 2)
    radius = float(rng.uniform(0.25, 0.7))
    glow = np.exp(-((xs - cx) ** 2 + (ys - cy) ** 2) / (radius * radius))[..., None]
    img += glow * (_any_colour(rng) - img) * float(rng.uniform(0.15, 0.5))
    img *= 1.0 + 0.12 * _smooth_noise(rng, gw, gh, 6)
    grid = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB")
    return grid.resize((w, h), Image.Resampling.BILINEAR)


def _smooth_noise(rng: np.random.Generator, w: int, h: int, cell: int) -> np.ndarray:
    """Smooth float noise in -1..1 of shape ``(h, w, 1)``: a coarse random grid upscaled bicubically."""
    grid = rng.integers(0, 256, (max(2, h // cell + 2), max(2, w // cell + 2)), dtype=np.uint8)
    big = Image.fromarray(grid, "L").resize((w, h), Image.Resampling.BICUBIC)
    return np.asarray(big, dtype=np.float32)[..., None] / 127.5 - 1.0


def _mottle(rng: np.random.Generator, w: int, h: int, amplitude: float) -> Image.Image:
    """A grey-128-centred RGB image of coloured blotches a few pixels wide, within +-``amplitude``."""
    cell = float(rng.uniform(1.0, 2.5))
    gw, gh = int(w / cell) + 2, int(h / cell) + 2
    grid = (128 + rng.uniform(-amplitude, amplitude, (gh, gw, 3))).astype(np.uint8)
    return Image.fromarray(grid, "RGB").resize((w, h), Image.Resampling.BILINEAR)


def _grain(rng: np.random.Generator, w: int, h: int, amplitude: float) -> Image.Image:
    """A grey-128-centred RGB image of per-pixel luminance grain within +-``amplitude``."""
    k = round(amplitude)
    return Image.fromarray(rng.integers(128 - k, 128 + k + 1, (h, w), dtype=np.uint8), "L").convert("RGB")


def _draw_shapes(
    draw: ImageDraw.ImageDraw, rng: np.random.Generator, w: int, h: int, label: int, num_classes: int
) -> None:
    """Filled ellipses, polygons and rectangles, then a few lines; each class favours one kind of shape."""
    weights = np.ones(3)
    weights[label % 3] = 4.0
    weights /= weights.sum()
    for _ in range(int(rng.integers(5, 12))):
        kind = int(rng.choice(3, p=weights))
        colour = _class_colour(rng, label, num_classes, 0.15) if rng.random() < 0.7 else _any_colour(rng)
        fill = _rgb(colour)
        outline = _rgb(colour * 0.6) if rng.random() < 0.4 else None
        cx, cy = float(rng.uniform(0, w)), float(rng.uniform(0, h))
        rx, ry = float(rng.uniform(0.04, 0.3) * w), float(rng.uniform(0.04, 0.3) * h)
        if kind == 0:
            draw.ellipse((cx - rx, cy - ry, cx + rx, cy + ry), fill=fill, outline=outline, width=1)
        elif kind == 1:
            n = int(rng.integers(3, 8))
            angles = np.sort(rng.uniform(0, 2 * math.pi, n))
            radii = rng.uniform(0.5, 1.0, n)
            xs, ys = cx + rx * radii * np.cos(angles), cy + ry * radii * np.sin(angles)
            points = list(zip(xs.tolist(), ys.tolist(), strict=True))
            draw.polygon(points, fill=fill, outline=outline)
        else:
            draw.rectangle((cx - rx, cy - ry, cx + rx, cy + ry), fill=fill, outline=outline, width=1)
    # A cluster of small blobs (leaves, pebbles, stars): the fine detail that real scenes have.
    n = int(rng.integers(20, 80))
    centre = rng.uniform(0, 1, 2) * (w, h)
    spots = centre + rng.normal(0.0, 0.25, (n, 2)) * (w, h)
    sizes = rng.uniform(1.0, 0.03 * w, n)
    colours = np.clip(_class_colour(rng, label, num_classes, 0.1) * rng.uniform(0.6, 1.3, (n, 1)), 0, 255)
    for (x, y), r, (red, green, blue) in zip(spots.tolist(), sizes.tolist(), colours.astype(int).tolist(), strict=True):
        draw.ellipse((x - r, y - r * 0.7, x + r, y + r * 0.7), fill=(red, green, blue))
    for _ in range(int(rng.integers(0, 5))):
        x0, y0, x1, y1 = (rng.uniform(0, 1, 4) * (w, h, w, h)).tolist()
        draw.line((x0, y0, x1, y1), fill=_rgb(_any_colour(rng)), width=int(rng.integers(1, 3)))


def _render_image(seed: int, index: int, label: int, num_classes: int) -> bytes:
    """The JPEG bytes of sample image ``index``: a pure function of its arguments.

    The scene (background, shapes, shading, mottling) is drawn at half
    resolution and upscaled; only the grain is made at full resolution.
    """
    rng = np.random.default_rng([seed, index, 0x1A6E])
    w = int(rng.integers(_WIDTH_RANGE[0], _WIDTH_RANGE[1] + 1))
    h = int(rng.integers(_HEIGHT_RANGE[0], _HEIGHT_RANGE[1] + 1))
    quality = int(rng.integers(_QUALITY_RANGE[0], _QUALITY_RANGE[1] + 1))
    sw, sh = (w + 1) // 2, (h + 1) // 2
    scene = _background(rng, sw, sh, label, num_classes)
    _draw_shapes(ImageDraw.Draw(scene), rng, sw, sh, label, num_classes)
    # Shading across the shapes, as uneven light would give, and a coloured surface texture.
    shade = Image.fromarray(rng.integers(88, 169, (sh // 24 + 2, sw // 24 + 2), dtype=np.uint8), "L")
    shade = shade.resize((sw, sh), Image.Resampling.BILINEAR).convert("RGB")
    scene = ImageChops.soft_light(scene, shade)
    scene = ImageChops.add(scene, _mottle(rng, sw, sh, float(rng.uniform(12.0, 26.0))), 1.0, -128)
    # Upscaling softens every edge the way a lens does; the grain is added at full resolution.
    scene = scene.resize((w, h), Image.Resampling.BILINEAR)
    grain = _grain(rng, w, h, float(rng.uniform(7.0, 13.0)))
    out = io.BytesIO()
    ImageChops.add(scene, grain, 1.0, -128).save(out, format="JPEG", quality=quality)
    return out.getvalue()


def _write_image_chunk(root: str, class_names: list[str], seed: int, indices: range, width: int) -> int:
    """Render and write the images ``indices`` (image ``i`` goes to class ``i % len(class_names)``)."""
    num_classes = len(class_names)
    for i in indices:
        label = i % num_classes
        data = _render_image(seed, i, label, num_classes)
        _write_atomic(Path(root, class_names[label], f"img_{i:0{width}d}.jpg"), data)
    return len(indices)


def make_sample_images(
    root: str | os.PathLike,
    *,
    num_images: int = 3000,
    num_classes: int = 10,
    seed: int = 0,
    workers: int | None = None,
) -> int:
    """Write a deterministic ImageFolder tree of natural-looking JPEGs.

    The layout is ``root/n00_sunset/img_000000.jpg``, ``root/n01_ocean/img_000001.jpg``,
    ...: image ``i`` belongs to class ``i % num_classes`` and the sorted folder
    names are in class-index order. Each image is 320-480 pixels wide and
    280-420 high, JPEG quality 75-95, and shows a smooth gradient background,
    filled ellipses, polygons and rectangles, a cluster of small blobs, a few
    lines, soft shading and a mild grain. Every class has its own hue and
    favoured shape, so the classes can be told apart. Files are typically
    15-95 KB (about 40 KB on average) and decode about as fast as real photos
    of the same size.

    The output is byte-identical for the same ``seed``, ``num_images`` and
    ``num_classes`` whatever ``workers`` is (given the same NumPy and Pillow). Existing files of the same name are
    overwritten; each file appears atomically. Only the folders of classes that
    get at least one image are created.

    Args:
        root: folder to write into; created if missing.
        num_images: how many images to write.
        num_classes: how many class folders to spread them over (round-robin).
        seed: seed of the whole dataset.
        workers: processes to render with; ``None`` uses every CPU this process may use (its affinity,
            cut to a cgroup CPU quota) and ``1`` renders in the calling process.

    Returns:
        The number of files written (``num_images``).

    Raises:
        ValueError: a count or the seed is not an integer or is negative, or
            ``num_classes`` or ``workers`` is below 1.
    """
    num_images = _check_count("num_images", num_images, 0)
    num_classes = _check_count("num_classes", num_classes, 1)
    seed = _check_count("seed", seed, 0)
    workers = usable_cpus() if workers is None else _check_count("workers", workers, 1)
    root = Path(root)
    names = _class_names(_IMAGE_THEMES, "n", num_classes)
    for name in names[: min(num_classes, num_images)]:
        (root / name).mkdir(parents=True, exist_ok=True)
    width = max(6, len(str(max(num_images - 1, 0))))
    workers = min(workers, max(num_images, 1))
    if workers == 1:
        return _write_image_chunk(os.fspath(root), names, seed, range(num_images), width)
    # Small chunks balance the load; each is still far longer than the cost of dispatching it.
    step = max(1, min(64, num_images // (workers * 4)))
    chunks = [range(start, min(start + step, num_images)) for start in range(0, num_images, step)]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(_write_image_chunk, os.fspath(root), names, seed, c, width) for c in chunks]
        try:
            return sum(f.result() for f in futures)
        except BaseException:  # a worker failed or we were interrupted: do not render the rest
            pool.shutdown(cancel_futures=True)
            raise


# ----------------------------------------------------------------------------- texts


def _sentence(rng: np.random.Generator, topic: list[str]) -> str:
    """One sentence of 4-18 words, about a third of them from the class's topic."""
    n = int(rng.integers(4, 19))
    u = rng.random(2 * n + 2).tolist()  # one draw per sentence: numpy calls dominate the cost otherwise
    words = [
        topic[int(u[n + k] * len(topic))] if u[k] < 0.35 else _COMMON_WORDS[int(u[n + k] * len(_COMMON_WORDS))]
        for k in range(n)
    ]
    words[0] = words[0][:1].upper() + words[0][1:]
    if n > 8 and u[2 * n] < 0.4:
        words[2 + int(u[2 * n] / 0.4 * (n - 4))] += ","
    return " ".join(words) + ".....!?"[int(u[2 * n + 1] * 7)]


def _render_text(kind: str, title: str, label: str, index: int, paragraphs: list[list[str]], tags: list[str]) -> str:
    """The file content for ``kind`` (``txt``, ``md`` or ``json``) from its sentences."""
    body = "\n\n".join(" ".join(p) for p in paragraphs)
    if kind == "json":
        doc = {"id": index, "label": label, "title": title, "tags": tags, "text": body}
        return json.dumps(doc, ensure_ascii=False, indent=1) + "\n"
    if kind == "md":
        sections = [f"# {title}"]
        for k, p in enumerate(paragraphs):
            if k % 3 == 2:
                sections.append("\n".join(f"- {s}" for s in p))
            else:
                sections.append(" ".join(p))
        return "\n\n".join(sections) + "\n"
    return body + "\n"


def _make_text(seed: int, index: int, label: str, topic: list[str]) -> tuple[str, bytes]:
    """The extension and UTF-8 bytes of sample text ``index``: a pure function of its arguments."""
    rng = np.random.default_rng([seed, index, 0x7E47])
    kind = str(rng.choice(["txt", "md", "json"], p=[0.8, 0.1, 0.1]))
    low, high = _TEXT_SIZE_RANGE
    target = int(math.exp(rng.uniform(math.log(low + 40), math.log(high - 300))))
    title_words = rng.choice(len(topic), int(rng.integers(2, 5)), replace=False).tolist()
    title = " ".join(topic[j] for j in title_words).capitalize()
    tags = sorted(topic[j] for j in rng.choice(len(topic), 3, replace=False).tolist())
    paragraphs: list[list[str]] = [[]]
    size = 0
    while size < target:
        if paragraphs[-1] and rng.random() < 0.25:
            paragraphs.append([])
        sentence = _sentence(rng, topic)
        paragraphs[-1].append(sentence)
        size += len(sentence.encode("utf-8")) + 2
    data = _render_text(kind, title, label, index, paragraphs, tags).encode("utf-8")
    while len(data) > high:  # rare: markup pushed a long document over the limit
        paragraphs[-1].pop()
        if not paragraphs[-1]:
            paragraphs.pop()
        data = _render_text(kind, title, label, index, paragraphs, tags).encode("utf-8")
    return kind, data


def make_sample_texts(
    root: str | os.PathLike,
    *,
    num_files: int = 2000,
    num_classes: int = 4,
    seed: int = 0,
) -> int:
    """Write a deterministic tree of class folders of small UTF-8 text files.

    The layout is ``root/t00_news/doc_000000.txt``, ``root/t01_reviews/doc_000001.md``,
    ...: file ``i`` belongs to class ``i % num_classes`` and the sorted folder
    names are in class-index order. About 80% of the files are ``.txt``, 10%
    Markdown (``.md``) and 10% JSON objects (``.json``); each is 100-4096 bytes
    (log-uniformly spread) of sentences from a fixed vocabulary, with a
    class-specific topic and a few non-ASCII words (``café``, ``naïve``, ``日本``).
    The same arguments give byte-identical files. Existing files of the same
    name are overwritten; each file appears atomically. Only the folders of
    classes that get at least one file are created.

    Args:
        root: folder to write into; created if missing.
        num_files: how many files to write.
        num_classes: how many class folders to spread them over (round-robin).
        seed: seed of the whole dataset.

    Returns:
        The number of files written (``num_files``).

    Raises:
        ValueError: a count or the seed is not an integer or is negative, or
            ``num_classes`` is below 1.
    """
    num_files = _check_count("num_files", num_files, 0)
    num_classes = _check_count("num_classes", num_classes, 1)
    seed = _check_count("seed", seed, 0)
    root = Path(root)
    names = _class_names(_TEXT_THEMES, "t", num_classes)
    topics = [(_TOPIC_WORDS[c % len(_TOPIC_WORDS)]).split() for c in range(num_classes)]
    for name in names[: min(num_classes, num_files)]:
        (root / name).mkdir(parents=True, exist_ok=True)
    width = max(6, len(str(max(num_files - 1, 0))))
    for i in range(num_files):
        label = i % num_classes
        ext, data = _make_text(seed, i, names[label], topics[label])
        _write_atomic(root / names[label] / f"doc_{i:0{width}d}.{ext}", data)
    return num_files
