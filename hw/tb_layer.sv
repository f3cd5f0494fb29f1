// qdeploy reference testbench: runs one layer of a golden-vectors directory (docs/hardware.md section 3) through
// the GEMM tile and the output stage, and writes acc.hex and out.hex in the same format for
// `qdeploy vectors compare`. Plain $readmemh / $writememh: no Python needed in the simulator. The layer's
// geometry comes as plusargs (hw/rtl.py reads them from the vectors manifest):
//   +dir=<layer dir> +dump=<dump layer dir> +G=<groups> +M=<m> +N=<n> +K=<k> +WBITS=<8|16> +INBITS=<8|16>
//   +UNSIGNED=<0|1>
//   +SIGNED_OUT=<0|1> and, for the Clamp step, +LO=<clamp lo> +HI=<clamp hi>
// and, for per-channel upper bounds (the ClampHi step, clamp_hi.hex), +CLAMP_HI=1
// and, for an output-stage lookup table (lookup_table.hex, 256 entries), +LOOKUP_OFFSET=<128 for int8 codes|0>
// and, for a Requantize with a per-row scale (row_scale.hex, one word per output row), +ROW_SCALE=1
// and, for the row-reciprocal store (row_table.hex; out.hex then holds 32-bit words),
//   +ROW_RECIPROCAL=<0 for 1/x | 1 for 1/sqrt x>
// and, for a fused MaxPool (the window-max on store, writing stored.hex), +WINDOW_MAX=1 with the output grid
// +NB=<batch> +OH +OW, the window +KH +KW +SH +SW +PT +PL +PB +PR +DH +DW and the pooled size +POH +POW.
// ROUNDING defaults to the target's; overriding it (iverilog -Ptb_layer.ROUNDING=n) simulates a wrong design.
`include "accel_params.svh"
`include "qdeploy_arith.svh"

module tb_layer;
  parameter int ROUNDING = ACCEL_ROUNDING;
  localparam int R = ACCEL_ROWS, C = ACCEL_COLS, AB = ACCEL_ACC_ELEMENT_BITS;
  localparam int MAX_WORDS = 1 << 18;

  logic [R*8-1:0]   input_mem [0:MAX_WORDS-1];
  logic [R*16-1:0]  input16   [0:MAX_WORDS-1];  // an add of a signed and an unsigned tensor: int16 elements
  logic [C*8-1:0]   weight8   [0:MAX_WORDS-1];
  logic [C*16-1:0]  weight16  [0:MAX_WORDS-1];
  logic [C*32-1:0]  bias_mem  [0:4095], mult_mem [0:4095], shift_mem [0:4095], scale_mem [0:4095];
  logic [C*16-1:0]  clamp_hi_mem [0:4095];
  logic [C*8-1:0]   table_mem [0:255];  // the lookup table: entry e at word e / C, lane e % C
  logic [C*AB-1:0]  acc_mem   [0:MAX_WORDS-1];
  logic [C*8-1:0]   out_mem   [0:MAX_WORDS-1];
  logic [C*8-1:0]   stored_mem [0:MAX_WORDS-1];
  logic [C*32-1:0]  row_scale_mem [0:MAX_WORDS-1];  // (11) line g*M + m: the word of row m of group g, element 0
  logic [C*16-1:0]  row_table_mem [0:511];  // (12) the store's table: entry e at word e / C, lane e % C
  logic [C*32-1:0]  words_mem [0:MAX_WORDS-1];  // (12) the store's words, in place of out_mem

  logic [R*17-1:0]   x;
  logic [R*C*17-1:0] w;
  logic [C*128-1:0]  acc_in, acc_out;
  qdeploy_gemm_tile tile (.x(x), .w(w), .acc_in(acc_in), .acc_out(acc_out));

  string dir, dump;
  int G, M, N, K, WBITS, INBITS, UNSIGNED, LO, HI, HAS_CLAMP_HI, SIGNED_OUT;
  int LOOKUP_OFFSET, ROW_SCALE, ROW_RECIPROCAL;
  int WINDOW_MAX, NB, OH, OW, KH, KW, SH, SW, PT, PL, PB, PR, DH, DW, POH, POW;

  // one value of the `out` matrix (row, channel) as a signed integer
  function automatic int out_value(input int row, input int channel, input int row_words);
    logic [7:0] bits;
    bits = out_mem[row*row_words + channel / C][(channel % C)*8 +: 8];
    // Not `SIGNED_OUT ? $signed(bits) : bits`: a conditional with one unsigned operand is unsigned, so a negative
    // code came back as 256 + code and won every window it was in (found by a window-max after SiLU).
    if (SIGNED_OUT) return $signed(bits);
    return bits;
  endfunction

  // (10) window-max on store: the maximum over each window's in-bounds taps (padding never wins), ONNX MaxPool
  task automatic window_max(input int channels, input int row_words);
    int best, ih, iw, row, value;
    bit any;
    for (int n = 0; n < NB; n++)
      for (int ph = 0; ph < POH; ph++)
        for (int pw = 0; pw < POW; pw++) begin
          row = (n*POH + ph)*POW + pw;
          for (int c = 0; c < channels; c++) begin
            any = 0; best = 0;
            for (int i = 0; i < KH; i++)
              for (int j = 0; j < KW; j++) begin
                ih = ph*SH - PT + i*DH; iw = pw*SW - PL + j*DW;
                if (ih >= 0 && ih < OH && iw >= 0 && iw < OW) begin
                  value = out_value((n*OH + ih)*OW + iw, c, row_words);
                  if (!any || value > best) best = value;
                  any = 1;
                end
              end
            if (!any) best = SIGNED_OUT ? -128 : 0;  // no in-bounds tap: the dtype's minimum
            stored_mem[row*row_words + c / C][(c % C)*8 +: 8] = best[7:0];
          end
          for (int lane = channels % C; lane != 0 && lane < C; lane++)
            stored_mem[row*row_words + channels / C][lane*8 +: 8] = '0;
        end
  endtask

  function automatic int words(input int count, input int per_word);
    return (count + per_word - 1) / per_word;
  endfunction

  // element `index` of a 1 x G*N per-channel file (bias, mult, shift: signed; scale: float32 bits)
  function automatic wide_t element32(input int which, input int index);  // bias, mult, shift, scale
    logic [31:0] bits;
    wide_t value;
    case (which)
      0: bits = bias_mem[index / C][(index % C)*32 +: 32];
      1: bits = mult_mem[index / C][(index % C)*32 +: 32];
      2: bits = shift_mem[index / C][(index % C)*32 +: 32];
      default: bits = scale_mem[index / C][(index % C)*32 +: 32];
    endcase
    if (which == 3) value = {96'b0, bits};
    else value = $signed(bits);
    return value;
  endfunction

  initial begin
    wide_t acc, y, mult;
    logic [31:0] scale, word;
    int shift, found, address;
    int channel, hi_channel, k_words, n_words, gn_words;
    if (!$value$plusargs("dir=%s", dir) || !$value$plusargs("dump=%s", dump) || !$value$plusargs("G=%d", G) ||
        !$value$plusargs("M=%d", M) || !$value$plusargs("N=%d", N) || !$value$plusargs("K=%d", K) ||
        !$value$plusargs("WBITS=%d", WBITS) || !$value$plusargs("INBITS=%d", INBITS) ||
        !$value$plusargs("UNSIGNED=%d", UNSIGNED) || !$value$plusargs("SIGNED_OUT=%d", SIGNED_OUT)) begin
      $display("tb_layer: missing plusargs"); $finish;
    end
    if (!$value$plusargs("LO=%d", LO)) LO = -2147483647 - 1;  // no Clamp step (a row-reciprocal store)
    if (!$value$plusargs("HI=%d", HI)) HI = 2147483647;
    k_words = words(K, R); n_words = words(N, C); gn_words = words(G * N, C);
    if (INBITS == 16) $readmemh({dir, "/input.hex"}, input16); else $readmemh({dir, "/input.hex"}, input_mem);
    if (WBITS == 16) $readmemh({dir, "/weight.hex"}, weight16); else $readmemh({dir, "/weight.hex"}, weight8);
    $readmemh({dir, "/bias.hex"}, bias_mem);
    $readmemh({dir, "/mult.hex"}, mult_mem);
    $readmemh({dir, "/shift.hex"}, shift_mem);
    $readmemh({dir, "/scale_f32.hex"}, scale_mem);
    if (!$value$plusargs("CLAMP_HI=%d", HAS_CLAMP_HI)) HAS_CLAMP_HI = 0;
    if (HAS_CLAMP_HI) $readmemh({dir, "/clamp_hi.hex"}, clamp_hi_mem);
    if (!$value$plusargs("LOOKUP_OFFSET=%d", LOOKUP_OFFSET)) LOOKUP_OFFSET = -1;
    if (LOOKUP_OFFSET >= 0) $readmemh({dir, "/lookup_table.hex"}, table_mem);
    if (!$value$plusargs("ROW_SCALE=%d", ROW_SCALE)) ROW_SCALE = 0;
    if (ROW_SCALE) $readmemh({dir, "/row_scale.hex"}, row_scale_mem);
    if (!$value$plusargs("ROW_RECIPROCAL=%d", ROW_RECIPROCAL)) ROW_RECIPROCAL = -1;
    if (ROW_RECIPROCAL >= 0) $readmemh({dir, "/row_table.hex"}, row_table_mem);
    for (int g = 0; g < G; g++)
      for (int nt = 0; nt < n_words; nt++)
        for (int i = 0; i < M; i++) begin
          acc_in = '0;
          for (int kt = 0; kt < k_words; kt++) begin  // k-tiles in order: the accumulator passes through
            for (int r = 0; r < R; r++) begin
              logic [7:0] byte_in;
              logic [15:0] half_in;
              byte_in = input_mem[(g*M + i)*k_words + kt][r*8 +: 8];
              half_in = input16[(g*M + i)*k_words + kt][r*16 +: 16];
              if (INBITS == 16) x[r*17 +: 17] = {half_in[15], half_in};
              else x[r*17 +: 17] = UNSIGNED ? {9'b0, byte_in} : {{9{byte_in[7]}}, byte_in};
              for (int c = 0; c < C; c++) begin
                int row;
                row = g*K + kt*R + r;
                if (kt*R + r >= K) w[(r*C + c)*17 +: 17] = '0;
                else if (WBITS == 16) w[(r*C + c)*17 +: 17] = {weight16[row*n_words + nt][c*16 + 15],
                                                               weight16[row*n_words + nt][c*16 +: 16]};
                else w[(r*C + c)*17 +: 17] = {{9{weight8[row*n_words + nt][c*8 + 7]}},
                                              weight8[row*n_words + nt][c*8 +: 8]};
              end
            end
            #1 acc_in = acc_out;
          end
          for (int c = 0; c < C && nt*C + c < N; c++) begin
            channel = g*N + nt*C + c;
            acc = $signed(acc_in[c*128 +: 128]);
            acc = acc_add(acc, element32(0, channel), ACCEL_ACC_BITS,
                          ACCEL_OVERFLOW == ACCEL_OVERFLOW_SATURATE);  // the bias, added last
            hi_channel = HAS_CLAMP_HI ? $signed(clamp_hi_mem[channel / C][(channel % C)*16 +: 16]) : HI;
            mult = element32(1, channel);
            shift = element32(2, channel);
            scale = element32(3, channel);
            if (ROW_SCALE) begin  // (11) the row's word scales the channel's multiplier
              word = row_scale_mem[g*M + i][31:0];
              mult = row_scaled_mult(mult, word);
              shift = row_scaled_shift(shift, word);
              scale = row_scaled_scale(scale, word);
            end
            if (ROW_RECIPROCAL >= 0) begin  // (12) the row-reciprocal store ends the stage: a 32-bit word
              address = row_table_address(acc, ROW_RECIPROCAL);
              words_mem[i*gn_words + channel / C][(channel % C)*32 +: 32] =
                row_reciprocal_word(acc, ROW_RECIPROCAL, row_table_mem[address / C][(address % C)*16 +: 16]);
            end
            y = output_stage(acc, mult, shift, scale, ROUNDING, LO, HI, hi_channel);
            if (LOOKUP_OFFSET >= 0)  // the Lookup step: the clamped code indexes the table
              y = table_mem[(y + LOOKUP_OFFSET) / C][((y + LOOKUP_OFFSET) % C)*8 +: 8];
            acc_mem[i*gn_words + channel / C][(channel % C)*AB +: AB] = acc[AB-1:0];
            out_mem[i*gn_words + channel / C][(channel % C)*8 +: 8] = y[7:0];
          end
        end
    for (int i = 0; i < M * gn_words; i++) begin  // padding lanes of the last word of a row are zero
      for (int lane = 0; lane < C; lane++) if ((i % gn_words)*C + lane >= G*N) begin
        acc_mem[i][lane*AB +: AB] = '0;
        out_mem[i][lane*8 +: 8] = '0;
        words_mem[i][lane*32 +: 32] = '0;
      end
    end
    $writememh({dump, "/acc.hex"}, acc_mem, 0, M*gn_words - 1);
    if (ROW_RECIPROCAL >= 0) $writememh({dump, "/out.hex"}, words_mem, 0, M*gn_words - 1);
    else $writememh({dump, "/out.hex"}, out_mem, 0, M*gn_words - 1);
    if ($value$plusargs("WINDOW_MAX=%d", WINDOW_MAX) && WINDOW_MAX) begin
      found = 1;
      found = found & $value$plusargs("NB=%d", NB); found = found & $value$plusargs("OH=%d", OH); found = found & $value$plusargs("OW=%d", OW);
      found = found & $value$plusargs("KH=%d", KH); found = found & $value$plusargs("KW=%d", KW);
      found = found & $value$plusargs("SH=%d", SH); found = found & $value$plusargs("SW=%d", SW);
      found = found & $value$plusargs("PT=%d", PT); found = found & $value$plusargs("PL=%d", PL);
      found = found & $value$plusargs("PB=%d", PB); found = found & $value$plusargs("PR=%d", PR);
      found = found & $value$plusargs("DH=%d", DH); found = found & $value$plusargs("DW=%d", DW);
      found = found & $value$plusargs("POH=%d", POH); found = found & $value$plusargs("POW=%d", POW);
      if (!found) begin $display("tb_layer: +WINDOW_MAX=1 needs the grid and window plusargs"); $finish; end
      window_max(G*N, gn_words);
      $writememh({dump, "/stored.hex"}, stored_mem, 0, NB*POH*POW*gn_words - 1);
    end
    $finish;
  end
endmodule
