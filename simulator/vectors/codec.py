"""The vectors format's constants and its hex codec (the format is described in simulator/vectors/__init__.py)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np

FORMAT = "qdeploy-vectors"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TIE_TOLERANCE = Fraction(1, 1 << 10)  # "near a rounding tie": within 2^-10 LSB of a half-integer
MAX_CLASSIFIED = 10000  # mismatches classified per file (all are counted)
COMPARED = ("acc", "lookup_input", "out", "stored")  # the files an RTL dump may hold


class VectorError(ValueError):
    """Bad input to export/compare/stress: a one-line message naming the file and the value seen."""


# ---------------------------------------------------------------------------------------------------------
# Hex codec

_DIGITS = np.frombuffer(b"0123456789abcdef", np.uint8)
_NIBBLE = np.full(256, 17, np.int64)  # 0..15 a digit, 16 unknown (x/z), 17 not a digit
for _i, _c in enumerate(b"0123456789abcdef"):
    _NIBBLE[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _NIBBLE[_c] = 10 + _i
for _c in b"xXzZ":
    _NIBBLE[_c] = 16


def _range_of(bits: int, signed: bool) -> tuple[int, int]:
    return (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)


def encode_hex(matrix: np.ndarray, bits: int, per_line: int, signed: bool = True) -> bytes:
    """$readmemh text of an integer matrix (rows, cols): ceil(cols/per_line) words per row, element 0 in the
    low bits (last digits), zero padding, two's complement (module docstring)."""
    if bits not in (8, 16, 32, 64):
        raise ValueError(f"bits = {bits}: expected 8, 16, 32 or 64")
    matrix = np.asarray(matrix)
    if matrix.ndim != 2:
        raise ValueError(f"expected a matrix, got shape {matrix.shape}")
    rows, cols = matrix.shape
    lo, hi = _range_of(bits, signed)
    if matrix.size and (int(matrix.min()) < lo or int(matrix.max()) > hi):
        raise ValueError(f"values {int(matrix.min())}..{int(matrix.max())} do not fit {bits}-bit "
                         f"{'signed' if signed else 'unsigned'} elements")
    chunks = max(-(-cols // per_line), 1)
    padded = np.zeros((rows, chunks * per_line), np.int64 if signed or bits < 64 else np.uint64)
    padded[:, :cols] = matrix
    words = padded.reshape(rows * chunks, per_line)[:, ::-1]  # element 0 last
    unsigned = words.view(np.uint64) if words.dtype == np.int64 else words
    if bits < 64:
        unsigned = unsigned & np.uint64((1 << bits) - 1)
    raw = np.ascontiguousarray(unsigned.astype(f">u{bits // 8}")).view(np.uint8).reshape(len(words), -1)
    text = np.empty((len(words), raw.shape[1] * 2 + 1), np.uint8)
    text[:, 0:-1:2] = _DIGITS[raw >> 4]
    text[:, 1:-1:2] = _DIGITS[raw & 15]
    text[:, -1] = ord("\n")
    return text.tobytes()


def decode_hex(data: bytes, bits: int, per_line: int, signed: bool = True,
               source: str = "<hex>") -> tuple[np.ndarray, np.ndarray]:
    """(words (L, per_line) int64, unknown (L, per_line) bool) from $readmemh text, the inverse of encode_hex.
    VectorError names source and line for anything that is not a word of this width."""
    digits = per_line * bits // 4
    raw = np.frombuffer(data, np.uint8)
    if raw.size and raw.size % (digits + 1) == 0 and np.all(raw[digits::digits + 1] == ord("\n")):
        nibbles = _NIBBLE[raw.reshape(-1, digits + 1)[:, :digits]]  # fast path: full-width words, '\n' ends
        if nibbles.max() < 17:
            return _words(nibbles, bits, per_line, signed)
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise VectorError(f"{source}: not an ASCII hex file") from None
    lines, numbers = [], []

    def bad(number: int, line: str) -> VectorError:
        return VectorError(f"{source}:{number}: expected up to {digits} hex digits ({per_line} x {bits}-bit "
                           f"elements), got {line[:40]!r}")

    for number, line in enumerate(text.split("\n"), 1):
        if "//" in line:
            line = line.split("//", 1)[0]
        line = line.strip().replace("_", "")
        if not line:
            continue
        if line.startswith("@"):
            raise VectorError(f"{source}:{number}: address '{line}' not supported (write words in order)")
        if len(line) > digits:
            raise bad(number, line)
        lines.append(line.rjust(digits, "0"))
        numbers.append(number)
    if not lines:
        return np.zeros((0, per_line), np.int64), np.zeros((0, per_line), bool)
    nibbles = _NIBBLE[np.frombuffer("".join(lines).encode(), np.uint8)].reshape(len(lines), digits)
    if nibbles.max() == 17:
        first = int(np.argmax((nibbles == 17).any(axis=1)))
        raise bad(numbers[first], lines[first].lstrip("0"))
    return _words(nibbles, bits, per_line, signed)


def _words(nibbles: np.ndarray, bits: int, per_line: int, signed: bool) -> tuple[np.ndarray, np.ndarray]:
    """(words, unknown) from the digit values (L, digits) of full-width words (16 marks x/z)."""
    nibbles = nibbles.reshape(len(nibbles), per_line, bits // 4)
    nibbles = nibbles[:, ::-1, :]  # element 0 is the last group of digits
    unknown = (nibbles == 16).any(axis=2)
    nibbles = np.where(nibbles == 16, 0, nibbles).astype(np.uint64)
    value = np.zeros(nibbles.shape[:2], np.uint64)
    for i in range(bits // 4):
        value = (value << np.uint64(4)) | nibbles[:, :, i]
    if bits == 64:
        words = value.view(np.int64) if signed else value.astype(np.int64)  # unsigned 64-bit is not used
    else:
        words = value.astype(np.int64)
        if signed:
            words = np.where(words >= 1 << (bits - 1), words - (1 << bits), words)
    return words, unknown


def lines_to_matrix(words: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """(rows, cols) from the words of a matrix written by encode_hex (drops the padding)."""
    chunks = max(-(-cols // words.shape[1]), 1)
    return words.reshape(rows, chunks * words.shape[1])[:, :cols]


def channels_last(y: np.ndarray) -> np.ndarray:
    """(N, C, ...) -> (N*..., C): pixels as rows, channels as columns."""
    if y.ndim == 2:
        return y
    return np.ascontiguousarray(np.moveaxis(y, 1, -1)).reshape(-1, y.shape[1])
