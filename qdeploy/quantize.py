"""Quantize a lowered float graph into an integer program (design.md section 3).

Per tensor: int8 (or uint8 for provably non-negative tensors on targets with unsigned activations: a clamp at 0, or a
weighted GEMM of weights and bias >= 0 over a uint8 input such as an average pool of a ReLU output), zero
point 0 (but eq. (10)), scale = T / 127 (T / 255 unsigned) from the calibration table. Per GEMM instruction, per output
channel c:

  (1) weights  q_w[c] = rne(W[c] / s_w[c]) in [-127, 127],  s_w[c] = max|W[c]| / 127   (calib/weights.py)
  (2) bias     q_b[c] = rne((b[c] + delta[c]) / (s_in * s_w[c])), saturated to int32, where
  (2b)         delta[c] = sum_k E[x_k] (W[c, k] - s_w[c] q_w[c, k]) corrects the mean shift of the weights'
               rounding (bias correction; E[x] per channel from the calibration table; off: delta = 0)
  (1c) error-feedback rounding (default, where the calibration table has the GEMM's input moments): the codes of
               (1) at the same scale, chosen column by column so that each column's rounding error is carried onto
               the columns still to round in the proportions that minimize e^T C e, C the covariance of the
               GEMM's input columns over the calibration data (GPTQ's algorithm; calib/rounding.py)
  (1b) with tap_sum_rounding (off by default; instead of (1c)), a convolution's codes are re-rounded so that each
               (c, input channel) kernel's code sum is the nearest integer to its float sum / s_w[c]
               (calib/weights.py `keep_tap_sums`), before (2b): the mean shift is then at most 1/2 code per input
               channel whatever the input's mean
  (3) acc[c]   = sum_k q_x[k] * q_w[c, k] + q_b[c]                     (acc_bits, wrap or saturate)
  (4) M[c]     = s_in * s_w[c] / s_out  -> integer mult[c] (Q(mult_bits-1)) and right shift[c]
  (4b) an output a pre-quantized model leaves in float (qdeploy/prequantized.py) with no table to fill it is
               int32 with s_out = max_c s_in * s_w[c] (so M[c] <= 1 and y fits wherever acc does): the GEMM's
               result at nearly the accumulator's resolution, for the host to read
  (5) y        = clamp(requantize(acc, M), lo, hi), lo/hi from the fused activation, then min(y, hi[c]) with
               hi[c] = round(clamp_hi[c] / s_out) where equalization made the bound per channel, then window-max
  (5b) with a lookup table (a fused Sigmoid, SiLU, GELU, ...: lowering/lookup.py), (4)-(5) requantize and clamp
               to the pre-activation p (its own calibrated scale s_p, int8, or uint8 when it is non-negative on
               an unsigned target) and the output is y = table[p - p_min] with, for each of the 256 codes
               p = p_min + i,  table[i] = clamp(rne(f(p * s_p) / s_out), out_lo, out_hi)
               (f in float64 by the reference executor, rne = round half to even of the float64 value, out_lo /
               out_hi the output's integer range); then window-max

AddGemm (the residual add) is the output stage's two-input GEMM, K = 2 per channel, with 16-bit pre-scale
weights on a common scale s_acc = max(s_a, s_b) / 2^14: acc = q_a * w_a + q_b * w_b with
w = rne(s / s_acc), then (4)-(5) with M = s_acc / s_out. The relative error of the pre-scale is at most
2^-15 for the larger input scale. b's weight is negative for a - b (`negate_b`); a negative s_out (an integer
softmax's exp table reads the reflected code p = (m - x) / s_d >= 0, qdeploy/row_scales.py) negates both
weights, M = s_acc / |s_out|.

With rounding `float32_rne` the AddGemm instead computes what ONNX Runtime computes for the exported
DequantizeLinear -> Add -> QuantizeLinear pattern, which its default graph optimizations fuse into QLinearAdd
(MLAS `MlasQLinearAddKernelAvx2Helper`, x86-64 AVX2/FMA; qdeploy/export_onnx.py):

  (6) r_a = f32(f32(s_a) / f32(s_out)),  r_b = f32(f32(s_b) / f32(s_out))   (`add_ratio_f32`)
  (7) y   = clamp(rne(fma(q_a, r_a, f32(q_b * r_b))), lo, hi)

fma rounds once (q_a * r_a + t exactly, then to float32); f32 rounds to float32, ties to even; rne rounds to
an integer, ties to even; a = the Add's first input.

MulGemm and MatMulGemm multiply two activations, a (scale s_a) by b (scale s_b), both with zero point 0, so
the product needs no correction terms and no bias:

  (8) acc = sum_k q_a[k] * q_b[k]   (K = 1 for MulGemm, the contraction length for MatMulGemm),
      M   = c * s_a * s_b / s_out (one multiplier; float32_rne: f32(f32(s_a * f32(c * s_b)) / s_out)), then (5),
            c a positive constant scale folded from a Mul/Div after a MatMulGemm (1 otherwise);
      |acc| <= K * max|q_a| * max|q_b| (128 for int8, 255 for uint8): `acc_bound_bits`.

Layout ops keep their input's scale; a Concat's inputs are written by their producers straight into the
shared buffer, so every producer takes the Concat's output scale, except where nothing reads the buffer again:

  (9) a Concat whose output is a graph output that no instruction reads (a detector's raw output: boxes in
      pixels beside 0..1 class scores) stores each segment at its writer's own calibrated scale, so the
      tensor's scale is one per index along the Concat's axis (`scale_axis`, `scales` in its record):
      scales[i] = s_k for i in segment k. The writers' requantization is already per output channel, so this
      costs nothing on the unit; the int8 integers of each segment are those of its writer.

A lookup table's output of a function bounded below by f_min < 0 (SiLU -0.278, GELU -0.170, Mish -0.309,
HardSwish -0.375, ...; f_min = the least of f over the table's 256 inputs) that only GEMMs with constant weights
read (ConvGemm, DenseGemm, as their x, directly or through views; not a program output) is stored with a zero
point, where that is finer (a view of it has the same zero point):

  (10) s = f32((T - f_min) / 255) < T / 127,  zp = round(-f_min / s),  q = clamp(rne(y / s) + zp, 0, 255) (uint8):
       the table's entries table[i] = clamp(rne(f(p_i s_p) / s) + zp, 0, 255); each reader folds the offset in
       integers, exactly (gemmlowp's zero-point algebra, doc/quantization.md "the zero-point term"):
       sum_k w[c, k] (q_k - zp) = sum_k w[c, k] q_k - zp sum_k w[c, k], so its bias is
       q_b[c] - zp sum_k q_w[c, k] (before the int32 saturation), and a ConvGemm's zero padding reads the code zp
       (`pad_value`), the value 0. With zero point 0 half of an int8 code's levels lie on [-T, f_min), where no
       value falls (design.md section 3).

A softmax's input x (the scores Q.K^T a MatMulGemm writes) read only by the integer softmax's row max and exp
(lowering/softmax.py: the row max keeps x's codes, rule "input", and the exp AddGemm reads the difference of two
codes, rule "exp_table") is stored with a zero point over its calibrated range, where that is finer: x_min its least
value over the calibration data (the table's `minimum`), lo = max(x_min, -T) < 0,

  (13) s = f32((T - lo) / 255) < T / 127,  zp = round(-lo / s),  q = clamp(rne(acc M + M b), 0, 255) (uint8),
       b = round(zp / M) the product's int32 bias (M = c s_a s_b / s_out, eq. (8)), so the stored offset is
       M b = zp to within M / 2 codes; the row max is one of the row's codes (zero point and all) and the exp
       table's input is q_max - q_x, in which the offset cancels, whatever it is: softmax depends only on the
       differences of a row's scores. A score below lo clamps to 0 (its exp is that of lo, which matters only in a
       row whose max is within ln 510 of lo). Trained attention is lopsided (the digits ViT's first block: scores in
       [-5.8, 13.4] over the calibration digits), so zero point 0 left up to half of the codes unused.

An image input x = (p - m) / d of pixels p = 0..255, calibrated from images with one integer mean m and one std d for
every channel (the table's `preprocess`), that only GEMMs with constant weights read (as for eq. (10)):

  (14) s = f32(1 / d),  zp = m,  q = clamp(rne(x / s) + zp, 0, 255) = p (uint8): the pixels are the codes, exactly
       (TFLite's uint8 image inputs: EfficientNet-Lite's m = 127, d = 128 is s = 1/128, zp = 127); the readers fold
       zp as in eq. (10). From its threshold T the input got s = T / 127, which gives two of the 256 pixel values
       one code and, where KL's T is below the brightest pixel, clips it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from calib.rounding import InputMoments, error_feedback_round, weight_digest
from calib.weights import keep_tap_sums, quantize_weights
from qdeploy import __version__
from qdeploy_base.errors import BadInput, Unsupported
from qdeploy.ir import Graph, Node
from qdeploy.lowering import LoweringResult
from isa.kinds import RESHAPE_KINDS, VIEW_KINDS, WEIGHTED_GEMM_KINDS, Kind, handler
from isa.instructions import RECORDS
from isa.output_stage import Bias, Clamp, ClampHi, Lookup, OutputStage, Requantize, RowReciprocal
from qdeploy.lowering.nodes import INSTRUCTION_OPS, is_buffer_concat, is_segmented_concat, node_kind, output_stage
from qdeploy.lowering.lookup import NON_NEGATIVE
from qdeploy.lowering.range_split import PARTS_BY_GAIN, resplit_weight, unsplit_weight
from qdeploy.lowering.rows import row_scale_input, stores_row_words
from qdeploy import row_scales
from qdeploy.reference.ops.activation import evaluate
from qdeploy.prequantized import ModelQuantization, model_bias, model_weights
from qdeploy.program import Program
from isa.target import Target, target_to_dict
from isa.geometry import real_tap_fraction
from isa.tiling import record_tiles
from isa.multiplier import float32_multiplier, quantize_multiplier

ADD_PRESCALE_BITS = 14
INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1


@dataclass
class LayerReport:
    """One line of `qdeploy compile`'s table."""

    name: str
    kind: str
    m: int
    n: int
    k: int
    groups: int
    input_scale: float
    weight_scale_min: float
    weight_scale_max: float
    output_scale: float
    mult_min: int
    mult_max: int
    shift_min: int
    shift_max: int
    rounding: str
    acc_bound_bits: int
    acc_bits: int
    bias_saturated: int = 0
    warnings: list[str] = field(default_factory=list)


@dataclass
class CompileOptions:
    per_channel_weights: bool = True
    allow_host_fallback: bool = False
    bias_correction: bool = True  # eq. (2b), where the calibration table has the input's channel means
    bias_shrinkage: bool = False  # eq. (2c), where the table also has the spread of the channel means
    tap_sum_rounding: bool = False  # eq. (1b): each kernel's code sum the nearest to its float sum
    error_feedback_rounding: bool = True  # eq. (1c), where the table has the GEMM's input moments
    wide_outputs: bool = False  # eq. (4b) for every graph output a weighted GEMM writes and nothing reads


def _shape(graph: Graph, name: str) -> list:
    return [d for d in (graph.tensors[name].shape or ())]


def rne(x: np.ndarray) -> np.ndarray:
    """Round half to even (numpy's rounding), as float64."""
    return np.round(np.asarray(x, np.float64))


def _table_inputs_mapped(lookup, input_scale: float, unsigned_input: bool) -> np.ndarray:
    """f at a lookup table's 256 inputs p * s_p, p = 0..255 (uint8 input) or -128..127 (int8): eq. (5b)'s table
    before its output rounding, and eq. (10)'s f_min."""
    codes = np.arange(256, dtype=np.float64) + (0 if unsigned_input else -128)
    return evaluate(lookup.function, dict(lookup.params), codes * input_scale)


class _Scales:
    """Per-tensor quantization: scale and signedness, from the calibration thresholds; a pre-quantized
    model's tensors take the signedness the model states (`stated`)."""

    def __init__(self, graph: Graph, thresholds: dict[str, float], target: Target,
                 stated: ModelQuantization | None = None, minimums: dict[str, float] | None = None,
                 wide_outputs: bool = False, pixel_codes: dict[str, tuple[float, int]] | None = None):
        self.graph, self.target, self.stated = graph, target, stated
        self.wide_outputs = wide_outputs
        self.producers = graph.producers()
        self.scale: dict[str, float] = {}
        self.unsigned: dict[str, bool] = {}
        self.wide: set[str] = set()  # int32 outputs: their scale is set by the compiler (_Compiler.gemm)
        self.lookup_input: dict[str, tuple[float, bool]] = {}  # output -> (scale, unsigned) of its table's input
        self.axis_scales: dict[str, tuple[int, list[float]]] = {}  # eq. (9): output -> (axis, scale per index)
        self.segmented: set[str] = set()  # the outputs of Concats that eq. (9) applies to
        self.zero_point: dict[str, int] = {}  # eq. (10): a lower-bounded table's output -> the code of 0
        concat_scale = self._concat_scales(thresholds)
        consumers = graph.consumers()
        for name in graph.inputs:
            if not self._pixel_input(name, (pixel_codes or {}).get(name), consumers):
                self._assign(name, thresholds, unsigned=False)
        for node in graph.nodes:
            out = node.outputs[0]
            if self._left_in_float(node, thresholds, consumers):
                self.wide.add(out)
                self.unsigned[out] = False
            elif node.op in INSTRUCTION_OPS and stores_row_words(node):  # int32 row-scale words (row_scales.py)
                self.wide.add(out)
                self.unsigned[out] = False
                function = output_stage(node).steps[-1].function
                self.scale[out] = row_scales.words_scale(function, row_scales.accumulator_scale(node, self.scale))
            elif node.op in INSTRUCTION_OPS and "output_scale" in node.attrs:
                self._ruled(node)
            elif node.op in INSTRUCTION_OPS:
                # A Concat's buffer is signed (its other slices may be negative), so are the slices' writers.
                stage = output_stage(node)
                non_negative = stage.clamp.lo >= 0 or self._sums_non_negative(node)
                if stage.lookup is not None:  # (5b): the table's input p, then y = f(p)
                    self._assign(node.outputs[1], thresholds, target.arithmetic.unsigned_activations and non_negative)
                    self.lookup_input[out] = (self.scale.pop(node.outputs[1]), self.unsigned.pop(node.outputs[1]))
                    function, params = stage.lookup.function, dict(stage.lookup.params)
                    non_negative = function in NON_NEGATIVE and NON_NEGATIVE[function](params)
                unsigned = target.arithmetic.unsigned_activations and non_negative and out not in concat_scale
                self._assign(out, thresholds, unsigned, override=concat_scale.get(out))
                if (stage.lookup is not None and not unsigned and target.arithmetic.unsigned_activations
                        and stated is None and out not in concat_scale and self._folds_zero_point(out, consumers)):
                    self._lower_bounded(out, float(thresholds[out]), stage.lookup)
                if (node.op == Kind.MATMUL_GEMM and stage.lookup is None and not row_scale_input(node)
                        and stage.step(RowReciprocal) is None and not unsigned
                        and target.arithmetic.unsigned_activations and stated is None and out not in concat_scale
                        and (minimums or {}).get(out) is not None and self._softmax_input(out, consumers)):
                    self._shift_invariant(out, float(thresholds[out]), float(minimums[out]))
            elif node.op in VIEW_KINDS:
                self.scale[out], self.unsigned[out] = self.scale[node.inputs[0]], self.unsigned[node.inputs[0]]
                if node.inputs[0] in self.zero_point:  # eq. (10): a view of the codes has their zero point
                    self.zero_point[out] = self.zero_point[node.inputs[0]]
                if node.inputs[0] in self.wide:  # a view of int32 words
                    self.wide.add(out)
            else:  # a channel Concat's buffer, or a host op's output (requantized on the host)
                if not np.issubdtype(graph.tensors[out].dtype, np.floating):
                    raise Unsupported(f"node '{node.name}' ({node.op}) computes the integer tensor '{out}' on the "
                                      f"host (shape arithmetic on an activation's run-time shape); a program "
                                      f"carries int8 activations only, so this model cannot be compiled yet")
                self._assign(out, thresholds, unsigned=False)
                if out in self.segmented:
                    self.axis_scales[out] = self._segment_scales(node)

    def _pixel_input(self, name: str, codes: tuple[float, int] | None, consumers: dict[str, list[Node]]) -> bool:
        """Eq. (14): an image input whose pixels are exact codes (calib/data.py `Preprocess.pixel_codes`: one integer
        mean m, one std d) is uint8 with s = f32(1 / d) and zero point m, so q = p, the pixel itself: no rounding and
        no clipping at the input (at T / 127 two of the 256 pixel values shared a code, and a threshold below the
        brightest pixel clipped it). Its readers must fold a zero point (eq. (10): GEMMs with constant weights reading
        it as x); otherwise, on a target without unsigned activations, or for a pre-quantized model, the input keeps
        its threshold. Returns whether it applied."""
        if codes is None or not self.target.arithmetic.unsigned_activations or self.stated is not None:
            return False
        scale, zero_point = codes
        if not self._folds_zero_point(name, consumers):
            return False
        self.scale[name], self.unsigned[name] = scale, True
        if zero_point:
            self.zero_point[name] = zero_point
        return True

    def _sums_non_negative(self, node: Node) -> bool:
        """A weighted GEMM whose float output cannot be negative without a clamp: its input is stored uint8 with
        zero point 0 (non-negative), every weight and bias is >= 0 and its read pads with zeros or copies of the
        input. A global or window average pool of a ReLU output is one (weights 1 / (H W)): stored int8 at T / 127,
        half its codes would never be used. The uint8 range's floor at 0 only ever clips the integer rounding of
        a value whose float counterpart is >= 0."""
        x = node.inputs[0]
        if (node.op not in WEIGHTED_GEMM_KINDS or node.attrs.get("integer_weights") or self.stated is not None
                or not self.unsigned.get(x) or x in self.zero_point or x in self.wide
                or node.attrs.get("pad_value") is not None):
            return False
        constants = [self.graph.constant_data(name) for name in node.inputs[1:] if name]
        return all(value is not None and bool(np.all(np.asarray(value) >= 0)) for value in constants)

    def _folds_zero_point(self, name: str, consumers: dict[str, list[Node]]) -> bool:
        """Eq. (10) applies to `name`: no program output, and every reader a ConvGemm or DenseGemm with constant
        weights that reads it as its x with a plain zero-padded read and no output_scale rule, row scale or
        row-reciprocal store (each folds the zero point into its bias and pads with its code), or a view (reshape,
        slice, permutation: the same codes) whose output only such GEMMs read in turn."""
        readers = consumers.get(name, [])
        return bool(readers) and name not in self.graph.outputs and all(
            (reader.op in VIEW_KINDS and self._folds_zero_point(reader.outputs[0], consumers))
            or (reader.op in (Kind.CONV_GEMM, Kind.DENSE_GEMM) and reader.inputs[0] == name
                and name not in reader.inputs[1:] and not reader.attrs.get("integer_weights")
                and "output_scale" not in reader.attrs and not row_scale_input(reader)
                and output_stage(reader).step(RowReciprocal) is None
                and all(reader.attrs.get(key) is None for key in ("upsample", "upsample_fill", "pad_fill")))
            for reader in readers)

    def _softmax_input(self, name: str, consumers: dict[str, list[Node]], rule: str = "") -> bool:
        """Eq. (13) applies to `name`: no program output, and every reader an integer softmax's row max (the
        output_scale rule "input": x's own codes) whose output only its exp AddGemm reads, or that exp AddGemm
        (rule "exp_table"), directly or through views (lowering/softmax.py); `rule`: only readers of that rule."""
        readers = consumers.get(name, [])
        return bool(readers) and name not in self.graph.outputs and all(
            (reader.op in VIEW_KINDS and self._softmax_input(reader.outputs[0], consumers, rule))
            or (reader.op == Kind.ADD_GEMM and reader.attrs.get("output_scale") == "exp_table"
                and rule in ("", "exp_table"))
            or (not rule and reader.op == Kind.CONV_GEMM and reader.attrs.get("output_scale") == "input"
                and reader.attrs.get("integer_weights") and reader.inputs[0] == name
                and self._softmax_input(reader.outputs[0], consumers, "exp_table"))
            for reader in readers)

    def _shift_invariant(self, name: str, threshold: float, minimum: float) -> None:
        """Eq. (13): the softmax input `name` lies in [max(x_min, -T), T] (x_min its calibrated least value, T its
        threshold); where (T - lo) / 255 is finer than zero point 0's T / 127, it becomes uint8 with
        s = f32((T - lo) / 255) and the zero point zp = round(-lo / s)."""
        lo = max(minimum, -threshold)
        if lo < 0:
            self._with_zero_point(name, threshold, lo)

    def _lower_bounded(self, name: str, threshold: float, lookup) -> None:
        """Eq. (10): the table's output `name` lies in [f_min, T] (f_min = min of f over the table's 256 inputs, T
        its threshold); where f_min < 0 and (T - f_min) / 255 is finer than zero point 0's T / 127, it becomes
        uint8 with s = (T - f_min) / 255 and the zero point zp = round(-f_min / s)."""
        with np.errstate(over="ignore", invalid="ignore"):
            f_min = float(np.min(_table_inputs_mapped(lookup, *self.lookup_input[name])))
        if math.isfinite(f_min) and f_min < 0:
            self._with_zero_point(name, threshold, f_min)

    def _with_zero_point(self, name: str, threshold: float, lo: float) -> None:
        """`name`, whose values lie in [lo, T] with lo < 0, becomes uint8 with s = f32((T - lo) / 255) and the zero
        point zp = round(-lo / s) where that step is finer than its scale now (eqs. (10) and (13))."""
        scale = float(np.float32((threshold - lo) / 255.0))
        zero_point = int(np.round(-lo / scale))
        if scale < self.scale[name] and 0 < zero_point < 255:
            self.scale[name], self.unsigned[name], self.zero_point[name] = scale, True, zero_point

    def _segment_scales(self, node: Node) -> tuple[int, list[float]]:
        """Eq. (9): (the Concat's axis, each input's scale repeated over its extent along that axis)."""
        shape = _shape(self.graph, node.outputs[0])
        axis = int(node.attrs["axis"]) % len(shape)
        return axis, [self.scale[name] for name in node.inputs for _ in range(_shape(self.graph, name)[axis])]

    def _ruled(self, node: Node) -> None:
        """The scales of an instruction with an `output_scale` rule (qdeploy/row_scales.py): from its input's,
        not from a threshold."""
        x, out, rule = node.inputs[0], node.outputs[0], node.attrs["output_scale"]
        if rule == "input":
            self.scale[out], self.unsigned[out] = self.scale[x], self.unsigned[x]
            if x in self.zero_point:  # eq. (13): the row max is one of x's codes, zero point included
                self.zero_point[out] = self.zero_point[x]
        elif rule == "exp_table":
            s_p, p_unsigned, s_e, unsigned = row_scales.exp_table_scales(
                self.scale[x], self.target.arithmetic.unsigned_activations)
            self.lookup_input[out] = (s_p, p_unsigned)  # s_p < 0: the reflected code p = (m - x) / s_d
            self.scale[out], self.unsigned[out] = s_e, unsigned
        elif rule == "constant":
            bias = self.graph.constant_data(node.inputs[2])
            if node.op != Kind.DENSE_GEMM or not node.attrs.get("integer_weights") or bias is None or \
                    bias.size != 1 or not bias.item() > 0 or np.any(self.graph.constant_data(node.inputs[1])):
                raise Unsupported(f"node '{node.name}' ({node.op}): the output_scale rule 'constant' needs a "
                                  f"DenseGemm of integer weights 0 and one positive bias")
            self.scale[out], self.unsigned[out] = row_scales.constant_scale(bias.item()), False
        elif rule == "probability":
            self.scale[out], self.unsigned[out] = row_scales.unit_interval_scale(
                self.target.arithmetic.unsigned_activations)
        else:
            raise Unsupported(f"node '{node.name}' ({node.op}): unknown output_scale rule '{rule}'")

    def _left_in_float(self, node: Node, thresholds: dict[str, float], consumers) -> bool:
        """A pre-quantized model's output that it leaves in float (NNCF's logits) and no table fills, or with
        `wide_outputs` any graph output a weighted GEMM writes and no instruction reads (a classifier's logits,
        which NNCF and TensorRT also leave in float): the GEMM writes it as int32 (eq. (4b) of the module
        docstring) instead of rounding it to 8 bits at its calibrated scale."""
        out = node.outputs[0]
        unscaled = self.wide_outputs or (self.stated is not None and out not in thresholds)
        return (unscaled and out in self.graph.outputs
                and not consumers.get(out) and node.op in WEIGHTED_GEMM_KINDS
                and output_stage(node).window_max is None)

    def _concat_scales(self, thresholds: dict[str, float]) -> dict[str, str | None]:
        """Producer output -> the Concat output whose scale it must take (None: its own, eq. (9), where the table
        (or a pre-quantized model) gives every writer a scale; the Concat's one scale otherwise)."""
        result = {}
        consumers = self.graph.consumers()
        for node in self.graph.nodes:
            if not is_buffer_concat(self.graph, node):
                continue
            writers = {}
            for name in node.inputs:
                producer = self.producers.get(name)
                while (producer is not None and producer.op in RESHAPE_KINDS and len(consumers[name]) == 1
                       and name not in self.graph.outputs):
                    name = producer.inputs[0]  # a reshaped view of the writer's output: the writer takes the scale
                    producer = self.producers.get(name)
                if producer is None or producer.op not in INSTRUCTION_OPS or len(consumers[name]) != 1:
                    raise Unsupported(f"node '{node.name}' (Concat): input '{name}' must be written by a GEMM "
                                      f"instruction that feeds only this Concat (shared-buffer write)")
                writers[name] = node.outputs[0]
            if is_segmented_concat(self.graph, node, consumers) and all(name in thresholds for name in writers):
                self.segmented.add(node.outputs[0])
                writers = dict.fromkeys(writers)
            result.update(writers)
        return result

    def _assign(self, name: str, thresholds: dict[str, float], unsigned: bool, override: str | None = None):
        key = override or name
        if key not in thresholds:
            if self.stated is not None:
                raise BadInput(f"the model states no scale for tensor '{key}' (no QuantizeLinear on it); pass a "
                               f"calibration table (--calib) to fill the tensors the model leaves in float")
            raise BadInput(f"the calibration table has no entry for tensor '{key}' of this model; "
                           f"recalibrate with this model")
        if self.stated is not None and key in self.stated.tensors:
            unsigned = self.stated.tensors[key].unsigned
            if unsigned and not self.target.arithmetic.unsigned_activations:
                raise Unsupported(f"tensor '{key}' is uint8 in the model (node '{self.stated.tensors[key].node}') "
                                  f"and the target has no unsigned activations (set unsigned_activations = true)")
        threshold = float(thresholds[key])
        if not math.isfinite(threshold) or threshold <= 0:
            raise BadInput(f"calibration table: tensor '{key}' has threshold {threshold}, expected a finite "
                           f"positive number")
        self.unsigned[name] = unsigned
        # float32, as the program stores it and the hardware reads it: multipliers computed from these
        # scales are the ones a reader recomputes from the program (and from its ONNX export).
        self.scale[name] = float(np.float32(threshold / (255.0 if unsigned else 127.0)))

    def range(self, name: str) -> tuple[int, int]:
        if name in self.wide:
            return -INT32_MAX, INT32_MAX
        return self._code_range(self.unsigned[name])

    def _code_range(self, unsigned: bool) -> tuple[int, int]:
        """The integer range of a uint8 or int8 activation on this target."""
        return (0, 255) if unsigned else (self.target.arithmetic.act_min, self.target.arithmetic.act_max)

    def requantized(self, name: str) -> tuple[float, tuple[int, int]]:
        """(scale, integer range) that the requantization of the instruction writing `name` produces: the table's
        input p with a lookup (eq. (5b)), the output itself otherwise."""
        if name not in self.lookup_input:
            return self.scale[name], self.range(name)
        scale, unsigned = self.lookup_input[name]
        return scale, self._code_range(unsigned)


def zero_point_free_uint8(graph: Graph, target: Target) -> frozenset[str]:
    """The tensors of a lowered float graph that the program stores as uint8 with zero point 0, s = T / 255, on
    `target` (_Scales's rule: a provably non-negative instruction output, or a lookup table's non-negative input p,
    on a target with unsigned activations, unless it writes into a Concat's signed buffer). The rule does not
    depend on the thresholds, so calibration asks it before choosing them and judges these tensors at 255 steps
    (calib/kl.py). The uint8 tensors of eqs. (10) and (13) are not among them: they get their zero point only
    where T makes (T - lo) / 255 finer than T / 127, so their thresholds are chosen at int8's 127 steps."""
    probe = {name: 1.0 for name, tensor in graph.tensors.items() if not tensor.is_constant}
    scales = _Scales(graph, probe, target)
    uint8 = {name for name, unsigned in scales.unsigned.items() if unsigned and name not in scales.zero_point}
    for node in graph.nodes:  # a lookup's input p (5b): _Scales keeps its signedness under the table's output
        if (node.op in INSTRUCTION_OPS and "output_scale" not in node.attrs and not stores_row_words(node)
                and len(node.outputs) > 1 and node.outputs[0] in scales.lookup_input
                and scales.lookup_input[node.outputs[0]][1]):
            uint8.add(node.outputs[1])
    return frozenset(uint8)


def activation_steps(graph: Graph, thresholds: dict[str, float], target: Target) -> dict[str, float]:
    """The step (scale) each activation of a lowered float graph gets from `thresholds` on `target`, as the program
    will store it (_Scales: T / 255 for uint8, T / 127 for int8, float32): for a compile-time rewrite that weighs
    rounding noise before the program exists (lowering/range_split.py)."""
    return dict(_Scales(graph, thresholds, target).scale)


def _requant_params(real: np.ndarray, target: Target) -> dict[str, np.ndarray]:
    """Integer (mult, shift) per channel for eq. (4), and the float32 multiplier of `float32_rne`."""
    pairs = [quantize_multiplier(float(m), target.arithmetic.mult_bits) for m in real]
    return {"mult": np.array([p[0] for p in pairs], np.int64),
            "shift": np.array([p[1] for p in pairs], np.int64)}


def _clamp_bounds(node: Node, scale: float, qrange: tuple[int, int]) -> tuple[int, int]:
    """The Clamp step's float bounds in the output's integers: ReLU gives lo = 0, ReLU6 hi = round(6 / s_out)."""
    clamp = output_stage(node).clamp
    q_min, q_max = qrange
    lo, hi = q_min, q_max
    if clamp.lo != -math.inf:
        lo = int(np.clip(np.round(clamp.lo / scale), q_min, q_max))
    if clamp.hi != math.inf:
        hi = int(np.clip(np.round(clamp.hi / scale), q_min, q_max))
    # A clamp interval outside the calibrated range collapses to one value, as the float clamp does there.
    return lo, max(lo, hi)


def _read_fields(attrs: dict) -> dict:
    """The manifest fields of an upsampled read (isa/instructions.py ConvGemm), present only when set."""
    return {key: list(attrs[key]) if key == "upsample" else attrs[key]
            for key in ("upsample", "upsample_fill", "pad_fill") if attrs.get(key) is not None}


def _bits_for(bound: float) -> int:
    """Bits of a signed accumulator holding every value in [-bound, bound]."""
    return int(math.ceil(math.log2(bound + 1))) + 1 if bound > 0 else 1


class _Compiler:
    def __init__(self, lowered: LoweringResult, thresholds: dict[str, float], target: Target,
                 options: CompileOptions, channel_means: dict[str, tuple[float, ...]] | None = None,
                 stated: ModelQuantization | None = None,
                 channel_spreads: dict[str, tuple[float, ...]] | None = None,
                 minimums: dict[str, float] | None = None, pixel_codes: dict[str, tuple[float, int]] | None = None,
                 moments: dict[str, InputMoments] | None = None):
        self.graph, self.target, self.options = lowered.graph, target, options
        self.moments = moments or {}
        self.scales = _Scales(self.graph, thresholds, target, stated, minimums, options.wide_outputs, pixel_codes)
        self.stated_weights = stated.weights if stated is not None else {}
        self.channel_means = {name: np.asarray(mean, np.float64) for name, mean in (channel_means or {}).items()}
        self.channel_spreads = {name: np.asarray(spread, np.float64)
                                for name, spread in (channel_spreads or {}).items()}
        self.shrunk = 0  # GEMMs whose bias correction eq. (2c) shrank (the manifest says whether any was)
        self.tap_rounded = 0  # GEMMs whose codes eq. (1b) moved (the manifest says whether any were)
        self.feedback_rounded = 0  # GEMMs rounded by eq. (1c) (the manifest says how many)
        self.arrays: dict[str, np.ndarray] = {}
        self.reports: list[LayerReport] = []

    def array(self, index: int, key: str, value: np.ndarray) -> str:
        name = f"{index:04d}_{key}"
        self.arrays[name] = value
        return name

    def gemm(self, index: int, node: Node) -> dict:
        graph, scales = self.graph, self.scales
        x, y = node.inputs[0], node.outputs[0]
        s_in = scales.scale[x]
        weight = graph.constant_data(node.inputs[1]).astype(np.float64)
        bias = graph.constant_data(node.inputs[2]).astype(np.float64)
        rows = weight.reshape(weight.shape[0], -1)  # (M, C/g*kh*kw): the GEMM's weight matrix, k = (c, kh, kw)
        stated = self.stated_weights.get(node.name)
        if node.attrs.get("integer_weights"):  # stored as they are (lowering/rows.py): an exact row sum or max
            q_w, s_w = row_scales.integer_weights(node, rows), np.ones(rows.shape[0])
            constant = node.attrs.get("output_scale") == "constant"  # lowering/groupnorm.py's sqrt(L)
            q_bias = row_scales.constant_bias_codes(node, bias, s_in) if constant else rne(bias / s_in)
        elif stated is not None:  # a pre-quantized model's integers and scales (qdeploy/prequantized.py)
            q_w, s_w = model_weights(rows, stated, node.name)
            q_bias = model_bias(bias, stated, s_in, s_w)
            q_bias = rne(bias / (s_in * s_w)) if q_bias is None else q_bias.astype(np.float64)
        else:
            quantized = quantize_weights(rows, per_channel=self.options.per_channel_weights)
            q_w, s_w = quantized.q, quantized.scale.astype(np.float32).astype(np.float64).reshape(-1)
            s_w = np.array(np.broadcast_to(s_w, (rows.shape[0],)))
            q_w, s_w = self._fit_bias(node, rows, bias, q_w, s_w, s_in)
            taps = int(np.prod(weight.shape[2:])) if node.op == Kind.CONV_GEMM else 1
            fed = self._error_feedback(node, weight, s_w)
            if fed is not None:
                q_w = fed
                self.feedback_rounded += 1
            elif self.options.tap_sum_rounding and taps > 1:
                rounded = keep_tap_sums(rows, q_w, s_w, taps)
                self.tap_rounded += int(np.any(rounded != q_w))
                q_w = rounded
            correction = self._bias_correction(node, weight, (q_w * s_w[:, None]).reshape(weight.shape))
            if correction is not None:
                bias = bias + correction
            q_bias = rne(bias / (s_in * s_w))
        zero_point = scales.zero_point.get(x, 0)
        keeps_codes = node.attrs.get("output_scale") == "input"  # eq. (13): y is x's codes, zero point and all
        if zero_point and not keeps_codes:  # eq. (10): sum_k w[c, k] (q_k - zp) = sum_k w[c, k] q_k - zp sum_k w[c, k]
            q_bias = q_bias - zero_point * q_w.astype(np.int64).sum(axis=1)
        if y in scales.wide and not stores_row_words(node):  # eq. (4b): s_out = max_c s_in s_w[c] (float32, not below)
            widest = np.float32(np.max(s_in * s_w))
            scales.scale[y] = float(widest if widest >= np.max(s_in * s_w) else np.nextafter(widest, np.float32(np.inf)))
        s_out, q_range = scales.requantized(y)
        saturated = int(np.sum((q_bias < INT32_MIN) | (q_bias > INT32_MAX)))
        q_bias = np.clip(q_bias, INT32_MIN, INT32_MAX).astype(np.int32)
        lo, hi = _clamp_bounds(node, s_out, q_range) if output_stage(node).clamp is not None else (0, 0)
        x_lo, x_hi = scales.range(x)
        k = rows.shape[1]
        bound = k * max(abs(x_lo), abs(x_hi)) * int(np.max(np.abs(q_w), initial=0)) + \
            int(np.max(np.abs(q_bias.astype(np.int64)), initial=0))
        bias_array = self.array(index, "bias", q_bias)
        store = output_stage(node).step(RowReciprocal)
        if store is not None:  # the row-reciprocal store: the exact row sum becomes its word (row_scales.py)
            row_scales.check_row_accumulator(node, f"the row sum of {k} codes of '{x}'", bound,
                                             self.target.arithmetic.acc_bits)
            steps = [Bias(bias_array), store]
        elif row_scale_input(node):  # a row scale (rows.py with_row_scale): M[c] = s_in s_w[c] s_words / s_out
            words = row_scale_input(node)
            row_scales.check_row_accumulator(node, f"the GEMM of '{x}' (K = {k}) read with a row scale", bound,
                                             self.target.arithmetic.acc_bits)
            requant = self._requant(index, s_in, s_w * scales.scale[words], s_out)
            steps = [Bias(bias_array), replace(requant, row_scale=words), Clamp(lo, hi)]
        else:
            steps = [Bias(bias_array), self._requant(index, s_in, s_w, s_out), Clamp(lo, hi)]
        clamp_hi = output_stage(node).clamp_hi
        if clamp_hi is not None:  # per-channel bounds of an equalized ReLU6 (lowering/equalize.py)
            channel_hi = np.clip(np.round(np.asarray(clamp_hi.hi) / s_out), lo, hi)
            if np.any(channel_hi < hi):  # else Clamp's hi already bounds every channel (a range split's parts)
                steps.append(ClampHi(self.array(index, "clamp_hi", channel_hi.astype(np.int32))))
        record = {
            "weight": self.array(index, "weight", q_w.astype(np.int8)), "bias": bias_array,
            "weight_scale": self.array(index, "weight_scale", s_w.astype(np.float32)),
            "stage": self._stage(index, node, steps), "acc_bound_bits": _bits_for(bound), "k": k,
        }
        if node.op == Kind.CONV_GEMM:
            record.update(kernel=list(weight.shape[2:]), group=int(node.attrs["group"]),
                          strides=list(node.attrs["strides"]), pads=list(node.attrs["pads"]),
                          dilations=list(node.attrs["dilations"]))
            record.update(_read_fields(node.attrs))
            if zero_point:  # eq. (10): a padded tap reads the code of 0
                record["pad_value"] = zero_point
        self._report(node, record, s_in, s_w, s_out, saturated)
        return record

    def _fit_bias(self, node: Node, rows: np.ndarray, bias: np.ndarray, q_w: np.ndarray, s_w: np.ndarray,
                  s_in: float) -> tuple[np.ndarray, np.ndarray]:
        """Widen s_w[c] where the bias would not fit the accumulator: a channel with near-zero weights and a
        large bias (common after BatchNorm folding) has max|W[c]|/127 so small that b / (s_in * s_w) passes
        2^(acc_bits-1) and the sum would overflow. Such a channel gets s_w[c] = |b[c]| / (s_in * B) with
        B = 2^(acc_bits-1) - 1 - K * 127 * (255 + zp) the room the products leave, and the input's zero point
        where the bias folds it (eqs. (10), (14): -zp sum_k q_w[c, k]), and its weights are re-rounded (|q| < 127
        then); every other channel keeps its max-abs scale."""
        zero_point = self.scales.zero_point.get(node.inputs[0], 0)
        room = 2 ** (self.target.arithmetic.acc_bits - 1) - 1 - rows.shape[1] * 127 * (255 + zero_point)
        needed = np.abs(bias) / (s_in * room) if room > 0 else np.zeros_like(s_w)
        widen = needed > s_w
        if not np.any(widen):
            return q_w, s_w
        needed32 = needed.astype(np.float32)
        needed32 = np.where(needed32 < needed, np.nextafter(needed32, np.float32(np.inf)), needed32)  # float32, not below
        s_w = np.where(widen, needed32.astype(np.float64), s_w)
        q_w = q_w.copy()
        q_w[widen] = np.clip(np.round(rows[widen] / s_w[widen, None]), -127, 127).astype(np.int8)
        return q_w, s_w

    def _error_feedback(self, node: Node, weight: np.ndarray, s_w: np.ndarray) -> np.ndarray | None:
        """Eq. (1c)'s codes (M, k) of the GEMM's `weight` at scales `s_w`, where the table has input moments of
        these very weights: as calibrated, or as a range split rewrote them (lowering/range_split.py). A split's
        writer A has the calibrated weight's rows repeated with signs over the same input columns: its rows are
        rounded as they are. Its reader B has the calibrated input channels repeated with signs: B's codes are
        rounded on the calibrated weight, with the moments of the unsplit input, and repeated the same way.
        None where there are none (or compile changed the weights otherwise, as a per-channel rescale does): the
        GEMM then rounds to nearest."""
        moments = self.moments.get(node.name)
        if moments is None or not self.options.error_feedback_rounding or self.options.tap_sum_rounding:
            return None
        groups = int(node.attrs["group"]) if node.op == Kind.CONV_GEMM else 1
        layouts = [(None, 1)] + [(axis, parts) for axis in (0, 1) for _, parts in PARTS_BY_GAIN]
        for axis, parts in layouts:
            calibrated, signs = (weight, None) if axis is None else unsplit_weight(weight, axis, parts) or (None, None)
            if calibrated is None or moments.mean.shape != (groups, int(np.prod(calibrated.shape[1:]))) or \
                    moments.weight_digest != weight_digest(calibrated):
                continue
            if axis != 1:
                return error_feedback_round(weight.reshape(weight.shape[0], -1), s_w, moments)
            codes = error_feedback_round(calibrated.reshape(calibrated.shape[0], -1), s_w, moments)
            return resplit_weight(codes.reshape(calibrated.shape), axis, signs).astype(np.int8).reshape(
                weight.shape[0], -1)
        return None

    def _input_channel_stat(self, stats: dict[str, np.ndarray], name: str) -> np.ndarray | None:
        """A per-channel calibration statistic of `name` (`stats`: the channel means or their spreads), looking
        through the views that calibration does not measure: reshapes that keep the channel axis (Flatten of an
        (N, C, 1, 1) tensor), channel windows and channel permutations (whose statistics are the window or the
        permutation of their input's)."""
        if name in stats:
            return stats[name]
        node = self.scales.producers.get(name)
        if node is None or node.op not in VIEW_KINDS:
            return None
        stat = self._input_channel_stat(stats, node.inputs[0])
        if stat is None:
            return None
        if node.op == Kind.CHANNEL_SLICE:
            return stat[node.attrs["start"]:node.attrs["start"] + node.attrs["count"]]
        if node.op == Kind.CHANNEL_PERMUTE:
            return stat[np.asarray(node.attrs["perm"])]
        if _shape(self.graph, node.inputs[0])[1:2] != _shape(self.graph, name)[1:2]:
            return None
        return stat

    def _bias_correction(self, node: Node, weight: np.ndarray, dequantized: np.ndarray) -> np.ndarray | None:
        """Eq. (2b): delta[c] = sum_k E[x_k] (W[c, k] - s_w[c] q_w[c, k]), the mean shift the weights'
        rounding causes, added to the float bias before it is quantized (Nagel et al., "Data-Free
        Quantization", ICCV 2019, eq. 14, with E[x] measured at calibration). For a conv, E[x_k] of tap
        (i, j) of channel c is mean[c] times the fraction of output positions where that tap reads the input
        rather than the zero padding, so delta[c] = sum_j e[c, j] mean[j] with e[c, j] the error of output
        channel c summed over the taps of input channel j (each weighted by its fraction).

        Eq. (2c), shrinkage (options.bias_shrinkage, where the table has the spreads): delta is the mean shift
        of the calibration samples, but one sample's own shift is delta_i[c] = sum_j e[c, j] m_i[j], with m_i
        its channel means; where delta_i moves a lot from sample to sample relative to delta, the constant
        correction is right on average and wrong on inputs unlike the average (it pushes them further off). So
        delta[c] is kept in the proportion its calibration samples agree on it:

            delta'[c] = delta[c] * delta[c]^2 / (delta[c]^2 + v[c]),   v[c] = sum_j e[c, j]^2 sd_j^2

        with sd_j the spread of m_i[j] over the samples (the channels taken as independent); a correction the
        samples agree on (v << delta^2) stays whole, one whose sign the samples do not agree on (v >> delta^2)
        goes to zero (Wiener's shrinkage of a mean towards zero by its signal-to-variance ratio)."""
        if not self.options.bias_correction:
            return None
        mean = self._input_channel_stat(self.channel_means, node.inputs[0])
        if mean is None:
            return None
        error = weight - dequantized.astype(np.float64)
        if node.op == Kind.DENSE_GEMM:
            if mean.size != error.shape[1]:
                return None
            per_input = error  # (M, C)
            delta = per_input @ mean
        else:
            groups = int(node.attrs["group"])
            out_channels, per_group, kh, kw = weight.shape
            if mean.size != per_group * groups:
                return None
            _, _, height, width = _shape(self.graph, node.inputs[0])
            (sh, sw), (dh, dw), (pt, pl, pb, pr) = (node.attrs["strides"], node.attrs["dilations"],
                                                    node.attrs["pads"])
            read = _read_fields(node.attrs)
            fh, fw = read.get("upsample", (1, 1))
            fill, pad_fill = read.get("upsample_fill"), read.get("pad_fill")
            taps = np.outer(real_tap_fraction(height, kh, sh, pt, pb, dh, fh, fill, pad_fill),
                            real_tap_fraction(width, kw, sw, pl, pr, dw, fw, fill, pad_fill))
            error = error.reshape(groups, out_channels // groups, per_group, kh, kw)
            per_input = np.einsum("gmcij,ij->gmc", error, taps)  # (G, M/G, C/G)
            delta = np.einsum("gmc,gc->gm", per_input, mean.reshape(groups, per_group)).reshape(-1)
        spread = self._input_channel_stat(self.channel_spreads, node.inputs[0])
        if not self.options.bias_shrinkage or spread is None or spread.size != mean.size:
            return delta
        if node.op == Kind.DENSE_GEMM:
            variance = per_input ** 2 @ spread ** 2
        else:
            variance = np.einsum("gmc,gc->gm", per_input ** 2, spread.reshape(groups, per_group) ** 2).reshape(-1)
        self.shrunk += 1
        power = delta ** 2
        return delta * np.divide(power, power + variance, out=np.zeros_like(power), where=power + variance > 0)

    def _requant(self, index: int, s_in: float, s_w: np.ndarray, s_out: float) -> Requantize:
        """Eq. (4) per channel: M = s_in * s_w[c] / s_out as (mult, shift); and the float32 multiplier of
        `float32_rne`, float32(float32(s_in * s_w) / s_out) as ONNX Runtime computes it (design.md 3)."""
        real = s_in * s_w / s_out
        with np.errstate(over="ignore"):
            scale_f32 = np.array([float32_multiplier(s_in, w, s_out) for w in s_w], np.float32)
        if not (np.all(np.isfinite(real)) and np.all(np.isfinite(scale_f32)) and np.all(real < 2.0 ** 31)):
            raise BadInput(f"layer {self.current}: requantization multiplier s_in * s_w / s_out = "
                           f"{float(np.max(real)):.3g} is out of range (scales {s_in:.3g}, {float(np.max(s_w)):.3g}, "
                           f"{s_out:.3g}); check the calibration table")
        params = _requant_params(real, self.target)
        return Requantize(self.array(index, "mult", params["mult"]), self.array(index, "shift", params["shift"]),
                          self.array(index, "scale_f32", scale_f32))

    def _stage(self, index: int, node: Node, steps: list) -> OutputStage:
        """The instruction's output stage: `steps` (Bias, Requantize, Clamp, ClampHi with their integers), then
        the node's Lookup with its table (eq. (5b)) and its WindowMax (whose parameters need no calibration)."""
        lookup, window = self._lookup(index, node), output_stage(node).window_max
        return OutputStage(tuple(steps) + tuple(step for step in (lookup, window) if step is not None))

    def add(self, index: int, node: Node) -> dict:
        scales = self.scales
        a, b = node.inputs
        y = node.outputs[0]
        (s_a, s_b), (s_out, q_range) = (scales.scale[a], scales.scale[b]), scales.requantized(y)
        s_acc = max(s_a, s_b) / 2 ** ADD_PRESCALE_BITS
        sign = -1 if node.attrs.get("negate_b") else 1  # a - b: the weight of b negative (lowering/rows.py)
        # A negative output scale (an exp table's reflected input, row_scales.py "exp_table") is the sign of both
        # pre-scale weights: the multiplier stays s_acc / |s_out| > 0.
        reflect = -1 if s_out < 0 else 1
        w_a, w_b = reflect * int(np.round(s_a / s_acc)), reflect * sign * int(np.round(s_b / s_acc))
        lo, hi = _clamp_bounds(node, abs(s_out), q_range)
        bound = 255 * (abs(w_a) + abs(w_b))
        # float32_rne: eq. (6), the float32 scale ratios of ONNX Runtime's QLinearAdd (s_out's sign included).
        ratio = np.array([np.float32(s_a) / np.float32(s_out), sign * (np.float32(s_b) / np.float32(s_out))],
                         np.float32)
        stage = self._stage(index, node, [self._requant(index, 1.0, np.array([s_acc]), abs(s_out)),
                                          Clamp(lo, hi)])
        record = {"add_weights": [w_a, w_b], "add_scale": s_acc,
                  "add_ratio_f32": self.array(index, "add_ratio_f32", ratio),
                  "stage": stage, "acc_bound_bits": _bits_for(bound), "k": 2}
        self._report(node, record, s_a, np.array([s_acc]), abs(s_out), 0)
        return record

    def product(self, index: int, node: Node) -> dict:
        """Eq. (8): MulGemm and MatMulGemm, the product of two activations with the multiplier s_a * s_b / s_out."""
        scales = self.scales
        (a, b), y = node.inputs[:2], node.outputs[0]
        s_a, s_b, s_out = scales.scale[a], scales.scale[b], scales.scale[y]
        from qdeploy.lowering import describe_instruction

        k = describe_instruction(self.graph, node).k
        bound = k * max(abs(v) for v in scales.range(a)) * max(abs(v) for v in scales.range(b))
        s_b_scaled = s_b * node.attrs.get("product_scale", 1.0)  # a folded constant scale c: M = c s_a s_b / s_out
        store = output_stage(node).step(RowReciprocal)
        words = row_scale_input(node)
        bias = ""
        if store is not None:  # row sums of products (a LayerNorm's sum of squares): their words, s_out = f(s_acc)
            # `row_sum_bias` (a LayerNorm's C eps) joins the sum in the accumulator: round(C eps / s_acc) codes.
            q_bias = int(np.round(float(node.attrs.get("row_sum_bias", 0.0))
                                  / row_scales.accumulator_scale(node, scales.scale)))
            bound += abs(q_bias)
            row_scales.check_row_accumulator(node, f"the row sum of products of '{a}' and '{b}' (K = {k})"
                                                   f"{f' plus its bias {q_bias}' if q_bias else ''}", bound,
                                             self.target.arithmetic.acc_bits)
            if q_bias and node.op != Kind.MATMUL_GEMM:
                raise Unsupported(f"node '{node.name}' ({node.op}): only a MatMulGemm adds a bias to its row sum")
            bias = self.array(index, "bias", np.array([q_bias], np.int32)) if q_bias else ""
            stage = OutputStage(((Bias(bias),) if bias else ()) + (store,))
        else:
            lo, hi = _clamp_bounds(node, s_out, scales.range(y))
            if words:  # a row scale (P.V of an integer softmax): M = c s_a s_b s_words / s_out, times each row's word
                row_scales.check_row_accumulator(node, f"the product of '{a}' and '{b}' (K = {k}) read with a row "
                                                       f"scale", bound, self.target.arithmetic.acc_bits)
                s_b_scaled *= scales.scale[words]
            requant = self._requant(index, s_a, np.array([s_b_scaled]), s_out)
            stage = OutputStage((replace(requant, row_scale=words), Clamp(lo, hi)))
            zero_point = scales.zero_point.get(y, 0)
            if zero_point:  # eq. (13): the offset zp as round(zp / M) accumulator codes, M = c s_a s_b / s_out
                q_bias = int(np.round(zero_point * s_out / (s_a * s_b_scaled)))
                if not INT32_MIN <= q_bias <= INT32_MAX:
                    raise BadInput(f"layer {self.current}: the zero point {zero_point} of '{y}' is {q_bias} "
                                   f"accumulator codes, beyond int32 (scales {s_a:.3g}, {s_b_scaled:.3g}, "
                                   f"{s_out:.3g}); check the calibration table")
                bound += abs(q_bias)
                bias = self.array(index, "bias", np.array([q_bias], np.int32))
                stage = OutputStage((Bias(bias), *stage.steps))
        record = {"stage": stage, "acc_bound_bits": _bits_for(bound), "k": k}
        if node.op == Kind.MATMUL_GEMM:
            record.update(transpose_a=bool(node.attrs["transpose_a"]), transpose_b=bool(node.attrs["transpose_b"]))
        if bias:
            record["bias"] = bias
        self._report(node, record, s_a, np.array([s_b_scaled]), s_out, 0)
        return record

    def _lookup(self, index: int, node: Node) -> Lookup | None:
        """The Lookup step of eq. (5b) with its table (None without a fused table): 256 output codes."""
        y, lookup = node.outputs[0], output_stage(node).lookup
        if lookup is None:
            return None
        if self.target.array.lookup_tables == 0:
            raise Unsupported(f"node '{node.name}' ({node.op}) applies {lookup.function} as a lookup "
                              f"table and the target has none (lookup_tables = 0)")
        s_p, unsigned = self.scales.lookup_input[y]
        function = lookup.function
        values = _table_inputs_mapped(lookup, s_p, unsigned)
        out_lo, out_hi = self.scales.range(y)
        with np.errstate(over="ignore", invalid="ignore"):  # eq. (10): the codes shifted by the zero point
            table = np.clip(np.round(values / self.scales.scale[y]) + self.scales.zero_point.get(y, 0), out_lo, out_hi)
        dtype = np.uint8 if self.scales.unsigned[y] else np.int8
        table = table.astype(dtype)
        return Lookup(function, bool(np.all(np.diff(table.astype(np.int64)) >= 0)),
                      table=self.array(index, "lookup_table", table), input_scale=s_p,
                      input_dtype="uint8" if unsigned else "int8")

    def _report(self, node: Node, record: dict, s_in: float, s_w: np.ndarray, s_out: float, saturated: int):
        from qdeploy.lowering import describe_instruction

        described = describe_instruction(self.graph, node)
        requant = record["stage"].requantize
        none = np.zeros(1, np.int64)  # a row-reciprocal store has no multiplier
        mult, shift = (none, none) if requant is None else (self.arrays[requant.mult], self.arrays[requant.shift])
        report = LayerReport(node.name, node.op, described.m, described.n, described.k, described.groups,
                             s_in, float(np.min(s_w)), float(np.max(s_w)), s_out, int(mult.min()),
                             int(mult.max()), int(shift.min()), int(shift.max()),
                             self.target.arithmetic.rounding, record["acc_bound_bits"],
                             self.target.arithmetic.acc_bits, saturated)
        if report.acc_bound_bits > report.acc_bits:
            report.warnings.append(f"worst-case accumulator needs {report.acc_bound_bits} bits > acc_bits "
                                   f"{report.acc_bits} ({self.target.arithmetic.overflow} on overflow)")
        if saturated:
            report.warnings.append(f"{saturated} bias value(s) saturated to int32")
        self.reports.append(report)

    def compile(self) -> Program:
        graph = self.graph
        instructions = []
        for index, node in enumerate(graph.nodes):
            self.current = f"'{node.name}' ({node.op})"
            kind = node_kind(graph, node)
            fields = handler(COMPILERS, kind, "the compiler", f"node '{node.name}'")(self, index, node)
            # a weighted GEMM reads x (and a row scale's words, after its weight and bias: lowering/rows.py)
            inputs = [*node.inputs[:1], *node.inputs[3:]] if kind in WEIGHTED_GEMM_KINDS else node.inputs
            record = RECORDS[kind](kind=kind, name=node.name, output=node.outputs[0], **fields,
                                   inputs=tuple(i for i in inputs if i and not graph.tensors[i].is_constant))
            instructions.append(record.to_manifest())  # the program is written from the typed records
        tensors = {}
        for name, scale in self.scales.scale.items():
            dtype = "int32" if name in self.scales.wide else "uint8" if self.scales.unsigned[name] else "int8"
            tensors[name] = {"shape": _shape(graph, name), "scale": scale, "dtype": dtype}
            if name in self.scales.axis_scales:  # eq. (9): what the integers mean; "scale" stays the calibrated one
                axis, scales = self.scales.axis_scales[name]
                tensors[name].update(scale_axis=axis, scales=scales)
            if name in self.scales.zero_point:  # eq. (10)
                tensors[name]["zero_point"] = self.scales.zero_point[name]
        manifest = {"toolkit_version": __version__, "target": target_to_dict(self.target),
                    "options": {"per_channel_weights": self.options.per_channel_weights,
                                "bias_correction": self.options.bias_correction and bool(self.channel_means),
                                **({"bias_shrinkage": True} if self.shrunk else {}),
                                **({"tap_sum_rounding": True} if self.tap_rounded else {}),
                                **({"error_feedback_rounding": self.feedback_rounded} if self.feedback_rounded else {}),
                                **({"wide_outputs": True} if self.scales.wide_outputs else {}),
                                "unsigned_activations": self.target.arithmetic.unsigned_activations,
                                **({"prequantized": True} if self.stated_weights or self.scales.stated else {})},
                    "inputs": list(graph.inputs), "outputs": list(graph.outputs),
                    "tensors": tensors, "instructions": instructions}
        return Program(manifest, self.arrays)

    def _host(self, index: int, node: Node) -> dict:
        """A host op: runs in float outside the accelerator on dequantized inputs, and its output is
        quantized with its calibrated scale. Its operands are tensors or constant arrays, in ONNX order."""
        if not self.options.allow_host_fallback:
            raise Unsupported(f"node '{node.name}' ({node.op}) has no lowering to the GEMM unit "
                              f"(--allow-host-fallback runs it in float on the host)")
        operands = []
        for position, name in enumerate(node.inputs):
            if not name:
                operands.append(None)
            elif self.graph.tensors[name].is_constant:
                operands.append({"array": self.array(index, f"operand{position}", self.graph.constant_data(name))})
            else:
                operands.append({"tensor": name})
        attrs = {}
        for key, value in node.attrs.items():
            if isinstance(value, np.ndarray):
                attrs[key] = {"array": self.array(index, f"attr_{key}", value)}
            else:
                attrs[key] = value
        return {"op": node.op, "opset": self.graph.opset, "operands": operands, "attrs": attrs}

    def _concat(self, index: int, node: Node) -> dict:
        shape = _shape(self.graph, node.outputs[0])
        return {"axis": int(node.attrs["axis"]) % len(shape)}  # node_kind: never the batch axis

    def _channel_slice(self, index: int, node: Node) -> dict:
        """Indices [start, start + count) along an axis (the channels: no field): the consumer reads at an offset
        (no copy, no arithmetic)."""
        axis = int(node.attrs.get("axis", 1))
        return {"start": int(node.attrs["start"]), "count": int(node.attrs["count"]),
                **({} if axis == 1 else {"axis": axis})}

    def _channel_permute(self, index: int, node: Node) -> dict:
        """Output channel c is input channel perm[c]: the hardware reads (or writes) with permuted strides."""
        return {"perm": [int(p) for p in node.attrs["perm"]]}

    def _axis_permute(self, index: int, node: Node) -> dict:
        """Output axis a is input axis perm[a]: the consumer reads (or the producer writes) with permuted strides."""
        return {"perm": [int(p) for p in node.attrs["perm"]]}

    def _reshape(self, index: int, node: Node) -> dict:
        """Every reshape kind is a view with the output's static shape (batch kept free)."""
        shape = _shape(self.graph, node.outputs[0])
        if not shape or shape[0] is not None or any(d is None for d in shape[1:]):
            raise Unsupported(f"node '{node.name}' ({node.op}): output shape {shape} is not (batch, static...)")
        return {"shape": shape}


# The compiler's handler table: the record fields (and arrays) of each kind's instruction, the output stage included.
COMPILERS = {Kind.CONV_GEMM: _Compiler.gemm, Kind.DENSE_GEMM: _Compiler.gemm, Kind.ADD_GEMM: _Compiler.add,
             Kind.MUL_GEMM: _Compiler.product, Kind.MATMUL_GEMM: _Compiler.product,
             Kind.CONCAT: _Compiler._concat, **{kind: _Compiler._reshape for kind in RESHAPE_KINDS},
             Kind.CHANNEL_SLICE: _Compiler._channel_slice, Kind.CHANNEL_PERMUTE: _Compiler._channel_permute,
             Kind.AXIS_PERMUTE: _Compiler._axis_permute, Kind.HOST: _Compiler._host}

def compile_graph(lowered: LoweringResult, thresholds: dict[str, float], target: Target,
                  options: CompileOptions | None = None,
                  channel_means: dict[str, tuple[float, ...]] | None = None,
                  stated: ModelQuantization | None = None,
                  channel_spreads: dict[str, tuple[float, ...]] | None = None,
                  minimums: dict[str, float] | None = None,
                  pixel_codes: dict[str, tuple[float, int]] | None = None,
                  moments: dict[str, InputMoments] | None = None) -> tuple[Program, list[LayerReport]]:
    """Quantize the lowered graph (equations (1)-(5) of the module docstring) into a Program;
    `channel_means` (tensor -> mean per channel, from calibration) enables the bias correction (2b), and
    `channel_spreads` (the spread of each sample's channel means) its shrinkage (2c).
    `stated`: what a pre-quantized model states; its tensors take the model's signedness, its GEMMs the
    model's integer weights and scales, and its bias where no fold changed it (qdeploy/prequantized.py).
    `minimums` (tensor -> its least value over the calibration data): the zero points of softmax inputs, eq. (13).
    `pixel_codes` (graph input -> (scale, zero point) that make its image pixels exact codes): eq. (14).
    `moments` (GEMM node -> its input moments, from calibration): the error-feedback rounding (1c)."""
    options = options or CompileOptions()
    if not target.array.window_max_on_store:
        pooled = [n for n in lowered.graph.nodes if n.op in INSTRUCTION_OPS and output_stage(n).window_max]
        if pooled:
            raise Unsupported(f"instruction '{pooled[0].name}' ends in a MaxPool, which runs as window-max on the "
                              f"store path, and the target has none (window_max_on_store = false)")
    compiler = _Compiler(lowered, thresholds, target, options, channel_means, stated, channel_spreads, minimums,
                         pixel_codes, moments)
    program = compiler.compile()
    record_tiles(program.manifest, target)  # "tiles" per GEMM instruction (qdeploy/perf.py, docs/hardware.md)
    return program, compiler.reports
