"""The reference RTL of the accelerator (SystemVerilog: the GEMM tile, its arithmetic and a layer testbench) and
its runner, hw/rtl.py (`qdeploy rtl run`), shipped with the package so that an installed qdeploy can run a
team's own tile against the golden vectors."""
