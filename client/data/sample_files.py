"""A sample file's bytes, as a `Dataset` of one file per sample reads them
from a mount.

Python before 3.14 asks every file it opens buffered whether it is a
terminal (``isatty()``: an ``ioctl(TCGETS)``), and the kernel hands every
ioctl on a FUSE file to the filesystem, every time: a round trip to the
mount per sample, and on a ``cache=immutable`` mount the only one a sample
read from the page cache makes (README, "Open samples unbuffered"). An
unbuffered open asks nothing. torchvision's ``ImageFolder`` opens with its
``default_loader``, buffered: pass ``loader=pil_loader`` from here.
"""

from __future__ import annotations

import io
import os
from typing import Any


def read_sample(path: str | os.PathLike[str]) -> bytes:
    """The whole file at *path* (open unbuffered, read, close)."""
    with open(path, "rb", buffering=0) as f:
        return f.readall()


def pil_loader(path: str | os.PathLike[str]) -> Any:
    """The image at *path* as an RGB ``PIL.Image`` (what torchvision's
    ``pil_loader`` returns), read by `read_sample`."""
    from PIL import Image

    with Image.open(io.BytesIO(read_sample(path))) as image:
        return image.convert("RGB")
