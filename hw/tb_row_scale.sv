// qdeploy reference testbench for the per-row scale and the row-reciprocal store (docs/design.md section 3,
// (11)-(12); isa/row_scale.py): reads `count` cases from +dir and writes the RTL's results next to them for the
// Python test (tests/test_row_scale.py) to compare with the Python-int twins. Plusargs: +dir=<folder> +N=<count>.
//   tables.hex      768 16-bit entries: RECIPROCAL, then RSQRT[0], RSQRT[1]
//   sums.hex        N 32-bit row sums          -> recip.hex, rsqrt.hex: the 1/S and 1/sqrt(S) words
//   acc.hex, mult.hex, shift.hex, scale.hex (float32 bits), word.hex
//                    -> out.hex: requantize(acc, the row-scaled mult and shift, or scale), int32 range, and
//                       scaled.hex: the row-scaled mult (float32_rne: the row-scaled scale's bits)
`include "accel_params.svh"
`include "qdeploy_arith.svh"

module tb_row_scale;
  parameter int ROUNDING = ACCEL_ROUNDING;
  localparam int MAX_CASES = 1 << 16;
  logic [15:0] table_mem [0:767];
  logic [31:0] sums [0:MAX_CASES-1], acc_mem [0:MAX_CASES-1], mult_mem [0:MAX_CASES-1], shift_mem [0:MAX_CASES-1];
  logic [31:0] word_mem [0:MAX_CASES-1], recip_mem [0:MAX_CASES-1], rsqrt_mem [0:MAX_CASES-1];
  logic [31:0] scale_mem [0:MAX_CASES-1];
  logic [31:0] out_mem [0:MAX_CASES-1], scaled_mem [0:MAX_CASES-1];
  string dir;
  int count;

  // the row-reciprocal store: the word of 1/s (rsqrt = 0) or 1/sqrt(s) (rsqrt = 1); the tables as one memory,
  // RECIPROCAL then RSQRT
  function automatic logic [31:0] row_reciprocal(input logic [31:0] sum, input bit rsqrt);
    wide_t acc;
    acc = $signed(sum);
    return row_reciprocal_word(acc, rsqrt, table_mem[(rsqrt ? 256 : 0) + row_table_address(acc, rsqrt)]);
  endfunction

  initial begin
    wide_t acc, y, scaled;
    if (!$value$plusargs("dir=%s", dir) || !$value$plusargs("N=%d", count)) begin
      $display("tb_row_scale: missing plusargs"); $finish;
    end
    $readmemh({dir, "/tables.hex"}, table_mem);
    $readmemh({dir, "/sums.hex"}, sums);
    $readmemh({dir, "/acc.hex"}, acc_mem);
    $readmemh({dir, "/mult.hex"}, mult_mem);
    $readmemh({dir, "/shift.hex"}, shift_mem);
    $readmemh({dir, "/word.hex"}, word_mem);
    $readmemh({dir, "/scale.hex"}, scale_mem);
    for (int c = 0; c < count; c++) begin
      recip_mem[c] = row_reciprocal(sums[c], 0);
      rsqrt_mem[c] = row_reciprocal(sums[c], 1);
      acc = $signed(acc_mem[c]);
      scaled = row_scaled_mult($signed(mult_mem[c]), word_mem[c]);
      scaled_mem[c] = ROUNDING == ACCEL_ROUNDING_FLOAT32_RNE ? row_scaled_scale(scale_mem[c], word_mem[c])
                                                            : scaled[31:0];
      y = output_stage(acc, scaled, row_scaled_shift($signed(shift_mem[c]), word_mem[c]), scaled_mem[c], ROUNDING,
                       -2147483647 - 1, 2147483647, 2147483647);
      out_mem[c] = y[31:0];
    end
    $writememh({dir, "/recip.hex"}, recip_mem, 0, count - 1);
    $writememh({dir, "/rsqrt.hex"}, rsqrt_mem, 0, count - 1);
    $writememh({dir, "/out.hex"}, out_mem, 0, count - 1);
    $writememh({dir, "/scaled.hex"}, scaled_mem, 0, count - 1);
    $finish;
  end
endmodule
