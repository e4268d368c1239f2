"""A small line chart written as a PNG with nothing but NumPy and zlib.

The demo must draw its plot on any machine with NumPy, so it does not use matplotlib: lines are
drawn into an RGB pixel array, text comes from a 5×7 bitmap font, and the PNG is written by hand
(signature, IHDR, one zlib-compressed IDAT, IEND).
"""

from __future__ import annotations

import math
import struct
import zlib

import numpy as np

WHITE = (255, 255, 255)
BLACK = (40, 40, 40)
GREY = (225, 225, 225)
BLUE = (31, 119, 180)
ORANGE = (230, 120, 20)

_GLYPHS = {  # seven rows of five pixels each
    "A": ".###. #...# #...# ##### #...# #...# #...#",
    "B": "####. #...# #...# ####. #...# #...# ####.",
    "C": ".###. #...# #.... #.... #.... #...# .###.",
    "D": "####. #...# #...# #...# #...# #...# ####.",
    "E": "##### #.... #.... ####. #.... #.... #####",
    "F": "##### #.... #.... ####. #.... #.... #....",
    "G": ".###. #...# #.... #.### #...# #...# .####",
    "H": "#...# #...# #...# ##### #...# #...# #...#",
    "I": ".###. ..#.. ..#.. ..#.. ..#.. ..#.. .###.",
    "J": "..### ...#. ...#. ...#. ...#. #..#. .##..",
    "K": "#...# #..#. #.#.. ##... #.#.. #..#. #...#",
    "L": "#.... #.... #.... #.... #.... #.... #####",
    "M": "#...# ##.## #.#.# #.#.# #...# #...# #...#",
    "N": "#...# #...# ##..# #.#.# #..## #...# #...#",
    "O": ".###. #...# #...# #...# #...# #...# .###.",
    "P": "####. #...# #...# ####. #.... #.... #....",
    "Q": ".###. #...# #...# #...# #.#.# #..#. .##.#",
    "R": "####. #...# #...# ####. #.#.. #..#. #...#",
    "S": ".#### #.... #.... .###. ....# ....# ####.",
    "T": "##### ..#.. ..#.. ..#.. ..#.. ..#.. ..#..",
    "U": "#...# #...# #...# #...# #...# #...# .###.",
    "V": "#...# #...# #...# #...# #...# .#.#. ..#..",
    "W": "#...# #...# #...# #.#.# #.#.# #.#.# .#.#.",
    "X": "#...# #...# .#.#. ..#.. .#.#. #...# #...#",
    "Y": "#...# #...# .#.#. ..#.. ..#.. ..#.. ..#..",
    "Z": "##### ....# ...#. ..#.. .#... #.... #####",
    "0": ".###. #...# #..## #.#.# ##..# #...# .###.",
    "1": "..#.. .##.. ..#.. ..#.. ..#.. ..#.. .###.",
    "2": ".###. #...# ....# ...#. ..#.. .#... #####",
    "3": "####. ....# ....# .###. ....# ....# ####.",
    "4": "...#. ..##. .#.#. #..#. ##### ...#. ...#.",
    "5": "##### #.... ####. ....# ....# #...# .###.",
    "6": "..##. .#... #.... ####. #...# #...# .###.",
    "7": "##### ....# ...#. ..#.. .#... .#... .#...",
    "8": ".###. #...# #...# .###. #...# #...# .###.",
    "9": ".###. #...# #...# .#### ....# ...#. .##..",
    ".": "..... ..... ..... ..... ..... .##.. .##..",
    ",": "..... ..... ..... ..... .##.. ..#.. .#...",
    "-": "..... ..... ..... .###. ..... ..... .....",
    "+": "..... ..#.. ..#.. ##### ..#.. ..#.. .....",
    "(": "...#. ..#.. .#... .#... .#... ..#.. ...#.",
    ")": ".#... ..#.. ...#. ...#. ...#. ..#.. .#...",
    "|": "..#.. ..#.. ..#.. ..#.. ..#.. ..#.. ..#..",
    "/": "....# ....# ...#. ..#.. .#... #.... #....",
    ":": "..... .##.. .##.. ..... .##.. .##.. .....",
    "=": "..... ..... ##### ..... ##### ..... .....",
    "%": "##... ##..# ...#. ..#.. .#... #..## ...##",
    " ": "..... ..... ..... ..... ..... ..... .....",
}
_FONT = {
    ch: np.array([[c == "#" for c in row] for row in rows.split()], bool) for ch, rows in _GLYPHS.items()
}


class Canvas:
    """An RGB image with drawing helpers; coordinates are (x, y) from the top left."""

    def __init__(self, width: int, height: int):
        self.pixels = np.empty((height, width, 3), np.uint8)
        self.pixels[:] = WHITE

    @property
    def width(self) -> int:
        return self.pixels.shape[1]

    @property
    def height(self) -> int:
        return self.pixels.shape[0]

    def rect(self, x0, y0, x1, y1, color):
        x0, x1 = sorted((int(x0), int(x1)))
        y0, y1 = sorted((int(y0), int(y1)))
        self.pixels[max(y0, 0) : max(y1, 0), max(x0, 0) : max(x1, 0)] = color

    def polyline(self, xs, ys, color, thickness: int = 2):
        xs = np.asarray(xs, float)
        ys = np.asarray(ys, float)
        if len(xs) == 1:
            xs, ys = np.repeat(xs, 2), np.repeat(ys, 2)
        for (xa, ya), (xb, yb) in zip(zip(xs[:-1], ys[:-1]), zip(xs[1:], ys[1:])):
            if not np.isfinite((xa, ya, xb, yb)).all():  # a gap, e.g. where training diverged
                continue
            n = int(max(abs(xb - xa), abs(yb - ya))) + 2
            px = np.rint(np.linspace(xa, xb, n)).astype(int)
            py = np.rint(np.linspace(ya, yb, n)).astype(int)
            for dx in range(thickness):
                for dy in range(thickness):
                    qx, qy = px + dx, py + dy
                    ok = (qx >= 0) & (qx < self.width) & (qy >= 0) & (qy < self.height)
                    self.pixels[qy[ok], qx[ok]] = color

    def text(self, x, y, message: str, color=BLACK, scale: int = 2, anchor: str = "left"):
        """Draw `message` (upper-cased; unknown characters become spaces) with its top at `y`."""
        message = message.upper()
        advance = 6 * scale
        if anchor == "right":
            x -= advance * len(message) - scale
        elif anchor == "center":
            x -= (advance * len(message) - scale) // 2
        for i, ch in enumerate(message):
            glyph = np.kron(_FONT.get(ch, _FONT[" "]), np.ones((scale, scale), bool))
            gx, gy = int(x) + i * advance, int(y)
            region = self.pixels[gy : gy + glyph.shape[0], gx : gx + glyph.shape[1]]
            region[glyph[: region.shape[0], : region.shape[1]]] = color

    def save_png(self, path) -> None:
        write_png(path, self.pixels)


def write_png(path, pixels: np.ndarray) -> None:
    """Write an (height, width, 3) uint8 array as an 8-bit RGB PNG."""
    height, width, _ = pixels.shape
    raw = np.zeros((height, 1 + 3 * width), np.uint8)  # filter byte 0 (None) on every row
    raw[:, 1:] = pixels.reshape(height, -1)

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n")
        f.write(chunk(b"IHDR", header))
        f.write(chunk(b"IDAT", zlib.compress(raw.tobytes(), 9)))
        f.write(chunk(b"IEND", b""))


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [lo, hi] (1, 2 or 5 times a power of ten apart)."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo]
    raw = (hi - lo) / max(count - 1, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    ticks = []
    v = first
    while v <= hi + 1e-9 * step:
        ticks.append(0.0 if abs(v) < 1e-12 * step else v)
        v += step
    return ticks


def _label(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e4 or abs(v) < 1e-3:
        return f"{v:.0e}".replace("e-0", "e-").replace("e+0", "e")
    return f"{v:.4g}"


def panel(canvas: Canvas, box, title: str, series, xmax: int, ymin=None, ymax=None):
    """A framed line plot inside `box = (x0, y0, x1, y1)`: `series` is a list of `(ys, color)`,
    each ys indexed by step (x from 0 to `xmax`)."""
    x0, y0, x1, y1 = box
    left, right, top, bottom = x0 + 70, x1 - 30, y0 + 34, y1 - 48
    values = np.concatenate([np.asarray(ys, float) for ys, _ in series])
    values = values[np.isfinite(values)]
    lo = float(values.min()) if ymin is None and len(values) else (ymin or 0.0)
    hi = float(values.max()) if ymax is None and len(values) else (ymax or 1.0)
    if hi <= lo:
        hi = lo + 1.0
    pad = 0.05 * (hi - lo)
    lo, hi = lo - (0.4 if ymin is not None else 1.0) * pad, hi + pad

    def sx(x):
        return left + (right - left) * np.asarray(x, float) / max(xmax, 1)

    def sy(y):
        return bottom - (bottom - top) * (np.asarray(y, float) - lo) / (hi - lo)

    canvas.text((x0 + x1) // 2, y0 + 6, title, scale=2, anchor="center")
    for t in nice_ticks(lo if ymin is None else ymin, hi):
        if lo <= t <= hi:
            y = int(sy(t))
            canvas.rect(left, y, right, y + 1, GREY)
            canvas.text(left - 6, y - 6, _label(t), scale=2, anchor="right")
    for t in nice_ticks(0, xmax, 4):
        x = int(sx(t))
        canvas.rect(x, bottom, x + 1, bottom + 5, BLACK)
        canvas.text(x, bottom + 9, _label(t), scale=2, anchor="center")
    canvas.text((left + right) // 2, bottom + 28, "step", scale=2, anchor="center")
    for ys, color in series:
        ys = np.asarray(ys, float)
        canvas.polyline(sx(np.linspace(0, xmax, len(ys))), np.clip(sy(ys), top, bottom), color)
    canvas.rect(left, top, right + 1, top + 1, BLACK)
    canvas.rect(left, bottom, right + 1, bottom + 1, BLACK)
    canvas.rect(left, top, left + 1, bottom + 1, BLACK)
    canvas.rect(right, top, right + 1, bottom + 1, BLACK)


def smooth(values, window: int) -> np.ndarray:
    """Running mean over the last `window` values (shorter at the start)."""
    v = np.asarray(values, float)
    if len(v) == 0:
        return v
    c = np.cumsum(np.insert(v, 0, 0.0))
    idx = np.arange(1, len(v) + 1)
    start = np.maximum(idx - window, 0)
    return (c[idx] - c[start]) / (idx - start)


def training_plot(path, tied_loss, naive_loss, tied_drift, naive_drift, title: str) -> None:
    """Two panels: both runs' smoothed training loss, and how far each run's two places (embedding
    and output layer) are apart after every step."""
    canvas = Canvas(1000, 420)
    canvas.text(500, 10, title, scale=2, anchor="center")
    window = max(1, len(tied_loss) // 40)
    steps = len(tied_loss)
    panel(
        canvas,
        (0, 36, 500, 380),
        "training loss",
        [(smooth(naive_loss, window), ORANGE), (smooth(tied_loss, window), BLUE)],
        steps,
    )
    panel(
        canvas,
        (500, 36, 1000, 380),
        "max |embed - unembed|",
        [(naive_drift, ORANGE), (tied_drift, BLUE)],
        steps,
        ymin=0.0,
    )
    legend_y = 396
    canvas.rect(250, legend_y, 274, legend_y + 12, BLUE)
    canvas.text(282, legend_y, "tied (optimisers)", scale=2)
    canvas.rect(560, legend_y, 584, legend_y + 12, ORANGE)
    canvas.text(592, legend_y, "naive (two copies)", scale=2)
    canvas.save_png(path)
