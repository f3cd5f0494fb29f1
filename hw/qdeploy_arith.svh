// qdeploy reference RTL: the arithmetic of the output stage and of the accumulator, as SystemVerilog functions
// written from docs/design.md section 3 and the Python-int twins of simulator/twins.py. A reference for RTL
// teams, not a product: every function is combinational and uses wide integers so that it can be read
// against the equations. Include after accel_params.svh (from `qdeploy target header`).
`ifndef QDEPLOY_ARITH_SVH
`define QDEPLOY_ARITH_SVH

typedef logic signed [127:0] wide_t;

// 2^n as a wide integer (n in 0..126).
function automatic wide_t pow2(input int n);
  wide_t one;
  one = 1;
  return one <<< n;
endfunction

// (1) one addition into the acc_bits accumulator: two's complement wrap, or clamp at every addition.
function automatic wide_t acc_add(input wide_t acc, input wide_t value, input int acc_bits, input bit saturate);
  wide_t sum, lo, hi, modulus;
  sum = acc + value;
  lo = -pow2((acc_bits - 1));
  hi = pow2((acc_bits - 1)) - 1;
  if (saturate) return sum > hi ? hi : (sum < lo ? lo : sum);
  modulus = pow2(acc_bits);
  sum = (sum - lo) % modulus;
  if (sum < 0) sum = sum + modulus;
  return sum + lo;
endfunction

// (3)-(5) p / 2^n to the nearest integer, ties up, away from zero or to even; n < 0 is a left shift.
function automatic wide_t round_shift(input wide_t p, input int n, input int mode);
  wide_t q, r, half, magnitude;
  if (n <= 0) return p <<< (-n);
  if (n > 120) return 0;  // |p| < 2^96: every mode gives 0
  half = pow2(n - 1);
  if (mode == ACCEL_ROUNDING_HALF_UP) return (p + half) >>> n;
  if (mode == ACCEL_ROUNDING_HALF_AWAY) begin
    magnitude = p < 0 ? -p : p;
    magnitude = (magnitude + half) >>> n;
    return p < 0 ? -magnitude : magnitude;
  end
  q = p >>> n;  // floor
  r = p - (q <<< n);
  if (2 * r > pow2(n) || (2 * r == pow2(n) && q[0])) q = q + 1;
  return q;
endfunction

// (6) gemmlowp / TFLite: SaturatingRoundingDoublingHighMul then RoundingDivideByPOT on int32.
function automatic wide_t tflite_multiply(input wide_t acc, input wide_t mult, input int shift);
  int exponent, left, right;
  wide_t x, ab, nudge, high, mask, remainder, threshold;
  exponent = 31 - shift;
  left = exponent > 0 ? exponent : 0;
  right = exponent < 0 ? -exponent : 0;
  if (right > 31) return 0;
  x = acc <<< left;
  x = {{96{x[31]}}, x[31:0]};  // int32 wrap, as the C++ multiplication
  if (x == -pow2(31) && mult == -pow2(31)) high = pow2(31) - 1;
  else begin
    ab = x * mult;
    nudge = ab >= 0 ? pow2(30) : 1 - pow2(30);
    ab = ab + nudge;
    high = ab >= 0 ? ab / pow2(31) : -((-ab) / pow2(31));  // C: toward zero
  end
  mask = pow2(right) - 1;
  remainder = high & mask;
  threshold = (mask >>> 1) + (high < 0 ? 1 : 0);
  return (high >>> right) + (remainder > threshold ? 1 : 0);
endfunction

// float32 as (sign, significand, exponent): value = (-1)^sign * significand * 2^exponent with the significand
// rounded to 24 bits, ties to even (IEEE 754 roundTiesToEven). round24_drop gives the bits a significand loses,
// round24 the rounded significand (2^24 after a carry: the caller renormalises).
function automatic int round24_drop(input wide_t significand);
  int msb;
  msb = 0;
  for (int i = 0; i < 127; i++) if (significand[i]) msb = i;
  return msb > 23 ? msb - 23 : 0;
endfunction

function automatic wide_t round24(input wide_t significand);
  int drop;
  wide_t kept, rest, half;
  drop = round24_drop(significand);
  if (drop == 0) return significand;
  kept = significand >>> drop;
  rest = significand - (kept <<< drop);
  half = pow2(drop - 1);
  if (rest > half || (rest == half && kept[0])) kept = kept + 1;
  return kept;
endfunction

// (7) float32_rne: rne(f32(f32(acc) * M)) with the float32 M given as its IEEE-754 bits (finite, >= 0).
// Results beyond the int32 range only matter by their sign once clamped, so they saturate there.
function automatic wide_t float32_multiply(input wide_t acc, input logic [31:0] scale_bits);
  bit negative;
  wide_t a, s, q, r, half;
  int ea, es, n;
  negative = acc < 0;
  a = negative ? -acc : acc;
  ea = round24_drop(a);  // acc to float32
  a = round24(a);
  if (a == pow2(24)) begin a = pow2(23); ea = ea + 1; end
  if (scale_bits[30:23] == 0) begin s = scale_bits[22:0]; es = -149; end
  else begin s = {1'b1, scale_bits[22:0]}; es = scale_bits[30:23]; es = es - 150; end
  a = a * s;  // exact: 24 x 24 bits
  ea = ea + es;
  if (a == 0) return 0;
  ea = ea + round24_drop(a);  // the product to float32 (values below 2^-126 round to integer 0 either way)
  a = round24(a);
  if (a == pow2(24)) begin a = pow2(23); ea = ea + 1; end
  if (ea >= 0) begin
    q = ea > 40 ? pow2(40) : (a <<< ea);
  end else begin
    n = -ea;
    if (n > 30) q = 0;
    else begin
      q = a >>> n;
      r = a - (q <<< n);
      half = pow2(n - 1);
      if (r > half || (r == half && q[0])) q = q + 1;
    end
  end
  return negative ? -q : q;
endfunction

// The output stage after the accumulator (isa/output_stage.py): Requantize in `mode`, Clamp to [lo, hi], then
// ClampHi (hi_channel, pass hi when the instruction has none).
function automatic wide_t output_stage(input wide_t acc, input wide_t mult, input int shift,
                                       input logic [31:0] scale_bits, input int mode, input int lo, input int hi,
                                       input int hi_channel);
  wide_t y;
  if (mode == ACCEL_ROUNDING_TFLITE) y = tflite_multiply(acc, mult, shift);
  else if (mode == ACCEL_ROUNDING_FLOAT32_RNE) y = float32_multiply(acc, scale_bits);
  else y = round_shift(acc * mult, shift, mode);
  if (y < lo) y = lo;
  if (y > hi) y = hi;
  if (y > hi_channel) y = hi_channel;
  return y;
endfunction

// (11) the per-row scale (isa/row_scale.py): the channel's multiplier scaled by the row's word e << 16 | m,
// mult' = (mult * m + 2^15) >> 16 and shift' = shift + e - 16 (float32_rne: row_scaled_scale below).
function automatic wide_t row_scaled_mult(input wide_t mult, input logic [31:0] word);
  wide_t m;
  m = {112'b0, word[15:0]};
  return (mult * m + pow2(15)) >>> 16;
endfunction

function automatic int row_scaled_shift(input int shift, input logic [31:0] word);
  int e;
  e = {26'b0, word[21:16]};
  return shift + e - 16;
endfunction

// (11) float32_rne: the float32 bits of f32(scale * m * 2^-e), one rounding to nearest, ties to even
// (subnormal results included): the row-scaled float32 multiplier.
function automatic logic [31:0] row_scaled_scale(input logic [31:0] scale_bits, input logic [31:0] word);
  wide_t s, p, kept;
  int es, e, msb, exponent;
  logic [7:0] field;
  if (scale_bits[30:23] == 0) begin s = {105'b0, scale_bits[22:0]}; es = -149; end
  else begin s = {104'b0, 1'b1, scale_bits[22:0]}; es = scale_bits[30:23]; es = es - 150; end
  p = s * {112'b0, word[15:0]};
  e = word[21:16];
  es = es - e;  // value = p * 2^es
  if (p == 0) return 32'b0;
  msb = 0;
  for (int i = 0; i < 64; i++) if (p[i]) msb = i;
  exponent = msb + es;
  if (exponent >= -126) begin
    kept = round_shift(p, msb - 23, ACCEL_ROUNDING_HALF_EVEN);
    if (kept == pow2(24)) begin kept = pow2(23); exponent = exponent + 1; end
    field = exponent + 127;
    return {1'b0, field, kept[22:0]};
  end
  kept = round_shift(p, -(es + 149), ACCEL_ROUNDING_HALF_EVEN);  // a multiple of 2^-149
  return kept == pow2(23) ? 32'h00800000 : {9'b0, kept[22:0]};
endfunction

// (12) floor(log2 s) = 31 - CLZ(s) of a positive 32-bit s, and the 8 bits after its leading one (the table index).
function automatic int leading_one(input logic [31:0] s);
  int n;
  n = 31;
  while (n > 0 && !s[n]) n = n - 1;
  return n;
endfunction

function automatic int reciprocal_index(input logic [31:0] s, input int n);
  logic [31:0] shifted;
  shifted = n >= 8 ? s >> (n - 8) : s << (8 - n);
  return {24'b0, shifted[7:0]};
endfunction

// (12) the row-reciprocal store of an accumulator (a row sum; below 1 read as 1, above 2^31 - 1 as 2^31 - 1):
// row_table_address gives the entry of its table to read (1/x: RECIPROCAL[i], i in 0..255; 1/sqrt x: RSQRT[n % 2][i]
// at (n % 2) * 256 + i), row_reciprocal_word the word e << 16 | m from that entry m.
function automatic logic [31:0] row_sum(input wide_t acc);
  if (acc < 1) return 32'd1;
  if (acc > pow2(31) - 1) return 32'h7fffffff;
  return acc[31:0];
endfunction

function automatic int row_table_address(input wide_t acc, input bit rsqrt);
  logic [31:0] s;
  int n;
  s = row_sum(acc);
  n = leading_one(s);
  return (rsqrt ? (n % 2) * 256 : 0) + reciprocal_index(s, n);
endfunction

function automatic logic [31:0] row_reciprocal_word(input wide_t acc, input bit rsqrt, input logic [15:0] mantissa);
  int n, e;
  n = leading_one(row_sum(acc));
  e = rsqrt ? 16 + n / 2 : 16 + n;
  return (e << 16) | mantissa;
endfunction

`endif
