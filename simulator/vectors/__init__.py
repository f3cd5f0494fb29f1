"""Golden test vectors for RTL verification: export them from a program run, compare RTL dumps with them, and
generate stress cases (docs/hardware.md, "Vector files", has the format with an example).

Hex files (`$readmemh`-ready; the same format is read back from RTL dumps):
- one memory word per line, lowercase hex digits, no `0x`, no addresses; '\\n' line ends;
- a word packs `per_line` elements of `bits` bits each, two's complement (unsigned for uint8 tensors;
  float32 files hold the IEEE-754 binary32 bit pattern). Element 0 is the least significant: it occupies bits
  [bits-1:0] of the word, i.e. the LAST `bits/4` digits of the line, as `mem[i][bits*j +: bits]` is element j
  in Verilog. Every line has per_line * bits / 4 digits;
- a matrix (rows x cols) takes ceil(cols / per_line) consecutive lines per row, rows in order; the last line
  of a row is padded with zero elements;
- per_line is the array's rows R for the input (the R values entering the array's rows in one cycle) and the
  array's cols C for everything indexed by output channel (weights: one row of PEs; biases, multipliers,
  shifts, scales, accumulators, outputs: one value per array column; also a per-row scale's words, one per line
  in element 0, and a row-reciprocal store's table).

Reading (RTL dumps) also accepts `//` comments, blank lines, `_` digit separators and lines with fewer digits
(zero-extended on the left, as $readmemh does); `x`/`z` digits make that element unknown (a mismatch).

Every `.hex` file has a `.npy` twin with the same values in the logical shape (unpadded), and `manifest.json`
describes shapes, layouts, widths, tiles and the arithmetic parameters of every layer.

The package has one module per responsibility: `codec` (format constants, hex encode/decode), `export` (vectors
of a program run), `compare` (RTL dumps against vectors) and `stress` (unit-level stress cases).
"""

from simulator.vectors.codec import (
           FORMAT,
           FORMAT_VERSION,
           VectorError,
           decode_hex,
           encode_hex,
)
from simulator.vectors.compare import (
           CompareReport,
           compare_vectors,
           load_manifest,
           read_hex_file,
)
from simulator.vectors.export import ExportResult, export_vectors
from simulator.vectors.stress import export_stress, stress_cases, stress_expected

__all__ = ["FORMAT", "FORMAT_VERSION", "CompareReport", "ExportResult", "VectorError", "compare_vectors",
           "decode_hex", "encode_hex", "export_stress", "export_vectors", "load_manifest", "read_hex_file",
           "stress_cases", "stress_expected"]
