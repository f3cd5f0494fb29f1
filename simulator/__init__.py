"""The bit-accurate simulator of the int8 matrix-only accelerator (design.md sections 3 and 7). It depends
only on the compiled program format, never on the compiler, so it models the hardware, not our compiler."""
