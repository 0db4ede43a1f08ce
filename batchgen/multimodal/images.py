"""One image from any source a row can name, decoded and content-hashed, or a clear :class:`ImageError`.

A source is a ``PIL.Image.Image``, a numpy array of 8-bit pixels (``H x W`` or ``H x W x C``, as vLLM and
transformers take them), raw encoded bytes, a Hugging Face ``datasets`` Image value
(``{"bytes": ..., "path": ...}``), a local path (a string or an ``os.PathLike``), or a URL: ``file://``, ``data:`` (base64), or any object store
through batchgen's storage layer (``s3://``, ``gs://``, ``az://``, ``hf://``). ``http(s)://`` is refused (a
batch job reads its inputs from storage it was given, never from the open web). A relative path is looked up
under the loader's ``base`` (a job's input directory) first, then in the working directory.

Invariants:

- The content hash is the SHA-256 of the encoded bytes (or, for a ``PIL.Image``, of its mode, size and pixels):
  two rows naming the same file, or carrying the same bytes, get the same hash, and the encoder runs once.
- Decoding is bounded: an image over ``max_pixels`` is refused before its pixels are decoded. With
  ``target_side`` a JPEG more than twice that size is decoded at a reduced scale (``draft``); off by default, since
  the processor's resize of the full-scale pixels is what transformers computes.
- Every image becomes RGB as transformers' image processors make it (:func:`to_rgb`: transparency composited
  onto white), so the processor sees the pixels it would see given the opened file itself.
- Every failure — a missing file, unreadable object, truncated or corrupt bytes, an unknown format — is an
  :class:`ImageError` whose message names the source (credentials redacted) and the reason.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

VISION_EXTRA_HINT = "image inputs need Pillow: pip install 'batchgen[vision]'"

DEFAULT_MAX_PIXELS = 100_000_000
"""Images with more pixels than this are refused (a 100-megapixel scan is ~300 MB decoded)."""


DIGEST_MEMO_BYTES = 64 << 20
"""Encoded bytes the loader keeps referenced to hash a bytes object given again only once (:meth:`ImageLoader._digest`)."""


class ImageError(ValueError):
    """An image that cannot be used; the message names the source and the reason (one line)."""


@dataclass(frozen=True)
class EncodedImage:
    """An image's encoded bytes and their content hash, read but not decoded yet (``name``: for messages)."""

    data: bytes
    hash: str
    name: str


@dataclass(frozen=True)
class LoadedImage:
    """A decoded RGB image and the content hash (hex SHA-256) that keys its encoder output and KV blocks;
    ``opened``: the image as opened, when its mode is not plain RGB (what a processor that converts images
    itself is given, so it computes what transformers computes from the opened file)."""

    image: Any  # PIL.Image.Image
    hash: str
    opened: Any = None

    @property
    def size(self) -> tuple[int, int]:
        return self.image.size


def pil():
    """The ``PIL.Image`` module, or an ImageError saying which extra to install."""
    try:
        from PIL import Image
    except ImportError as e:  # pragma: no cover - the vision extra is installed wherever images are used
        raise ImageError(VISION_EXTRA_HINT) from e
    return Image


def describe(source: Any) -> str:
    """A short, credential-free name of `source` for messages."""
    if isinstance(source, str):
        if source.startswith("data:"):
            return source[:30] + "..."
        from batchgen.data.storage import redact_url

        return redact_url(source) if "://" in source else source
    if isinstance(source, (bytes, bytearray, memoryview)):
        return f"<{len(source)} bytes>"
    if isinstance(source, Mapping):
        return describe(source.get("path") or source.get("bytes") or "<empty image value>")
    return f"<{type(source).__name__}>"


class ImageLoader:
    """Loads images (thread-safe: one loader serves the preprocessing workers). ``storage_options`` go to the
    object stores; filesystems are opened once per bucket and reused."""

    def __init__(
        self,
        storage_options: dict[str, Any] | None = None,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        target_side: int | None = None,
        base: str | None = None,
    ) -> None:
        self.storage_options = dict(storage_options or {})
        self.base = base.rstrip("/") if base else None
        """Where a relative path is looked up first (a job's input root: a directory or an object-store URL);
        a relative path not found there is read from the working directory. None: the working directory."""
        self.max_pixels = max_pixels
        self.target_side = target_side
        self._locations: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._digests: OrderedDict[int, tuple[bytes, str]] = OrderedDict()
        self._memo_bytes = 0

    def load(self, source: Any) -> LoadedImage:
        """The decoded image of `source` and its hash; ImageError when it cannot be used."""
        read = self.read(source)
        return read if isinstance(read, LoadedImage) else self.decode(read.data, read.name, read.hash)

    def read(self, source: Any) -> EncodedImage | LoadedImage:
        """`source`'s encoded bytes and their hash, not decoded (a ``PIL.Image`` is decoded already: it is
        returned as it is, hashed by its pixels); ImageError when they cannot be read. Hashing before decoding
        lets a caller that has processed the image already skip decoding it again."""
        Image = pil()
        if is_pixel_array(source):
            source = _array_image(source)
        if isinstance(source, Image.Image):
            return self._from_pil(source)
        data = self.read_bytes(source)
        name = describe(source)
        if not data:
            raise ImageError(f"image {name!r}: empty (0 bytes)")
        return EncodedImage(data, self._digest(data, given=_given_bytes(source) is data), name)

    def _digest(self, data: bytes, given: bool) -> str:
        """SHA-256 of ``data``; ``given``: ``data`` is the caller's own object (rows that pass the same bytes
        object, as several questions about one image do, are hashed once). The memo holds the objects it
        keys by ``id`` (so an id cannot be reused while it is there), at most :data:`DIGEST_MEMO_BYTES` of
        them, least recently used out first."""
        if not given:
            return hashlib.sha256(data).hexdigest()
        with self._lock:
            hit = self._digests.get(id(data))
            if hit is not None and hit[0] is data:
                self._digests.move_to_end(id(data))
                return hit[1]
        digest = hashlib.sha256(data).hexdigest()
        if len(data) <= DIGEST_MEMO_BYTES:
            with self._lock:
                old = self._digests.pop(id(data), None)
                self._memo_bytes += len(data) - (len(old[0]) if old is not None else 0)
                self._digests[id(data)] = (data, digest)
                while self._memo_bytes > DIGEST_MEMO_BYTES:
                    _, (gone, _) = self._digests.popitem(last=False)
                    self._memo_bytes -= len(gone)
        return digest

    # ----------------------------------------------------------------------------------------- bytes
    def read_bytes(self, source: Any) -> bytes:
        """The encoded bytes `source` names (bytes as given; a datasets Image value's bytes, else its path)."""
        if isinstance(source, (bytes, bytearray, memoryview)):
            return bytes(source)
        if isinstance(source, Mapping):
            data, path = source.get("bytes"), source.get("path")
            if data is not None:
                return self.read_bytes(data)
            if path:
                return self.read_bytes(path)
            raise ImageError("image value has neither 'bytes' nor 'path'")
        if source is None:
            raise ImageError("null image value: give an image, or leave the null out of the row's list")
        if isinstance(source, os.PathLike):
            source = os.fspath(source)
        if not isinstance(source, str):
            raise ImageError(
                f"unsupported image value of type {type(source).__name__}: pass a PIL image, bytes, a path or "
                "a URL (file://, data:, s3://, gs://, az://, hf://)"
            )
        if not source:
            raise ImageError("empty image path")
        if source.startswith("data:"):
            return _data_url_bytes(source)
        scheme = urlsplit(source).scheme.lower() if "://" in source else ""
        if not scheme and self.base and not os.path.isabs(os.path.expanduser(source)):
            return self._read_relative(source)
        if scheme in ("", "file"):
            return self._read_file(unquote(urlsplit(source).path) if scheme == "file" else source, source)
        if scheme in ("http", "https"):
            raise ImageError(
                f"image {describe(source)!r}: http(s) URLs are not fetched; put the images in object storage "
                "(s3://, gs://, az://, hf://) or pass their bytes"
            )
        return self._read_url(source)

    def _read_relative(self, path: str) -> bytes:
        """A relative path's bytes: under :attr:`base`, else (not there, but in the working directory) from the
        working directory."""
        assert self.base is not None
        if "://" in self.base:
            try:
                return self._read_url(f"{self.base}/{path}")
            except ImageError:
                if not os.path.isfile(path):
                    raise
                return self._read_file(path, path)
        under = os.path.join(self.base, path)
        if os.path.exists(under) or not os.path.isfile(path):
            if not os.path.exists(under):
                raise ImageError(
                    f"image {path!r}: no such file in the input's directory ({self.base}) or the working directory"
                )
            return self._read_file(under, under)
        return self._read_file(path, path)

    def _read_file(self, path: str, name: str) -> bytes:
        try:
            with open(os.path.expanduser(path), "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise ImageError(f"image {describe(name)!r}: no such file") from None
        except OSError as e:
            raise ImageError(f"image {describe(name)!r}: cannot read: {e.strerror or e}") from None

    def _read_url(self, url: str) -> bytes:
        from batchgen.data.storage import Location, StorageError

        parent, _, name = url.rstrip("/").rpartition("/")
        try:
            with self._lock:
                loc = self._locations.get(parent)
                if loc is None:
                    loc = self._locations[parent] = Location(parent, self.storage_options, key="image")
            data = loc.read_bytes(name)
        except StorageError as e:
            raise ImageError(str(e)) from None
        if data is None:
            raise ImageError(f"image {describe(url)!r}: no such object")
        return data

    # -------------------------------------------------------------------------------------- decoding
    def decode(self, data: bytes, name: str = "<bytes>", digest: str | None = None) -> LoadedImage:
        """Decode encoded image bytes (any format Pillow reads) to RGB, bounded as the class says (``digest``:
        their hash when known)."""
        Image = pil()
        if not data:
            raise ImageError(f"image {name!r}: empty (0 bytes)")
        digest = digest or hashlib.sha256(data).hexdigest()
        try:
            img = Image.open(io.BytesIO(data))
            w, h = img.size
            if w * h > self.max_pixels:
                raise ImageError(
                    f"image {name!r}: {w}x{h} pixels exceeds the limit of {self.max_pixels} pixels"
                )
            if self.target_side and img.format == "JPEG" and min(w, h) > 2 * self.target_side:
                img.draft("RGB", (2 * self.target_side, 2 * self.target_side))  # decode at a reduced scale
            img.load()
            img = upright(img)
            rgb = to_rgb(img)
        except ImageError:
            raise
        except Image.UnidentifiedImageError:
            raise ImageError(f"image {name!r}: unknown or unsupported image format") from None
        except Image.DecompressionBombError as e:
            raise ImageError(f"image {name!r}: too large ({e})") from None
        except (OSError, SyntaxError, ValueError) as e:  # truncated / corrupt data
            raise ImageError(f"image {name!r}: corrupt or truncated image data ({e})") from None
        return LoadedImage(rgb, digest, _opened(img))

    def _from_pil(self, img: Any) -> LoadedImage:
        img = upright(img)
        w, h = img.size
        if w * h > self.max_pixels:
            raise ImageError(f"image <PIL image>: {w}x{h} pixels exceeds the limit of {self.max_pixels}")
        rgb = to_rgb(img)
        h_ = hashlib.sha256(f"pil:{rgb.mode}:{w}x{h}:".encode())
        h_.update(rgb.tobytes())
        return LoadedImage(rgb, h_.hexdigest(), _opened(img))


def is_pixel_array(value: Any) -> bool:
    """Whether ``value`` is one image's pixels as a numpy array (2 or 3 dimensions of numbers), not an array of
    image values (Parquet's lists arrive as object arrays)."""
    dtype = getattr(value, "dtype", None)
    return (
        type(value).__module__ == "numpy" and getattr(dtype, "kind", "O") in "biuf" and value.ndim in (2, 3)
    )


def _array_image(array: Any) -> Any:
    """A numpy array of 8-bit pixels as a PIL image (``H x W``: grayscale; ``H x W x 1/3/4``: L, RGB, RGBA), as
    transformers' processors read such an array; ImageError for another shape or dtype."""
    Image = pil()
    shape = tuple(array.shape)
    if array.dtype.name != "uint8" or (len(shape) == 3 and shape[2] not in (1, 3, 4)):
        raise ImageError(
            f"image array of shape {shape} and dtype {array.dtype}: pass 8-bit pixels (uint8) as H x W or "
            "H x W x C with 1, 3 or 4 channels, or a PIL image"
        )
    if len(shape) == 3 and shape[2] == 1:
        array = array[:, :, 0]
    return Image.fromarray(array)


def _given_bytes(source: Any) -> Any:
    """The bytes object ``source`` carries itself (bytes, or a datasets Image value's ``bytes``), else None."""
    if isinstance(source, Mapping):
        source = source.get("bytes")
    return source if type(source) is bytes else None


EXIF_ORIENTATION = 0x0112


def upright(img: Any) -> Any:
    """``img`` turned and flipped as its EXIF orientation tag says, as a viewer shows it (what vLLM does to every
    image, and transformers' ``load_image`` to every image it opens); ``img`` itself without such a tag."""
    try:
        orientation = img.getexif().get(EXIF_ORIENTATION, 1)
    except Exception:  # noqa: BLE001 - unreadable EXIF: the pixels as stored
        return img
    if orientation in (None, 1):
        return img
    from PIL import ImageOps

    return ImageOps.exif_transpose(img)


def _has_alpha(img: Any) -> bool:
    return "A" in img.getbands() or img.info.get("transparency") is not None


def _opened(img: Any) -> Any:
    """``img`` when :func:`to_rgb` changes more than its type (another mode, transparency), else None."""
    return img if img.mode != "RGB" or _has_alpha(img) else None


def to_rgb(img: Any) -> Any:
    """``img`` as an RGB image, as transformers' image processors convert it: transparency (an alpha band, or a
    palette's or grayscale image's transparent colour) composited onto a white background, any other mode
    converted by Pillow (``I;16`` clips to 255, CMYK inverts to RGB). The first frame of an animated image
    (EXIF orientation: :func:`upright`, before)."""
    Image = pil()
    if _has_alpha(img):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def _data_url_bytes(url: str) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep:
        raise ImageError(f"image {describe(url)!r}: a data: URL needs a ',' before its payload")
    if not head.endswith(";base64"):
        raise ImageError(f"image {describe(url)!r}: only base64 data: URLs are supported")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"image {describe(url)!r}: invalid base64 payload") from None
