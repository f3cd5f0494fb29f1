// qdeploy reference RTL: one weight-stationary R x C GEMM tile (docs/hardware.md section 2). PE (r, c) holds
// w[r][c]; an input row x[0..R-1] enters, and column c adds x[r] * w[r][c] to the accumulator it carries,
// r ascending, each addition wrapping or saturating at ACC_BITS as the target says: the order is part of the
// result under saturation (docs/design.md section 3, eq. 1). Combinational here: a reference, not a pipeline.
`include "accel_params.svh"
`include "qdeploy_arith.svh"

module qdeploy_gemm_tile #(
  parameter int R = ACCEL_ROWS,
  parameter int C = ACCEL_COLS,
  parameter int ACC_BITS = ACCEL_ACC_BITS,
  parameter bit SATURATE = (ACCEL_OVERFLOW == ACCEL_OVERFLOW_SATURATE)
) (
  input  logic [R*17-1:0]   x,        // R signed 17-bit values (int8, uint8 or the add's int16 weights)
  input  logic [R*C*17-1:0] w,        // w[r][c] at bits (r*C + c)*17
  input  logic [C*128-1:0]  acc_in,   // C accumulators entering the tile (128-bit signed each)
  output logic [C*128-1:0]  acc_out
);
  wide_t acc, xv, wv;
  always @* begin
    for (int c = 0; c < C; c++) begin
      acc = $signed(acc_in[c*128 +: 128]);
      for (int r = 0; r < R; r++) begin
        xv = $signed(x[r*17 +: 17]);  // sign-extended to the wide type before the product
        wv = $signed(w[(r*C + c)*17 +: 17]);
        acc = acc_add(acc, xv * wv, ACC_BITS, SATURATE);
      end
      acc_out[c*128 +: 128] = acc;
    end
  end
endmodule
