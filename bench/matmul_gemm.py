"""The MatMulGemm (a GEMM of two activations: attention's Q K^T and P V) on the CPU's int8 dot product
(kernels.int8_simd.matmul) against the exact GEMM path it replaced (kernels.gemm: float32 BLAS chunks), in one
run on one machine, on a small torchvision VisionTransformer (seeded weights: the speed does not depend on
them): 112 x 112 RGB, patch 8 (197 tokens), width 192, 3 heads of 64, 4 layers, exported with torch's TorchScript
exporter, calibrated with KL on 16 photograph crops.

    python bench/matmul_gemm.py [--batch 32] [--rounds 7]

Prints, per MatMulGemm shape and for the whole program at --batch images: the median wall time of --rounds runs
of ours (int8 dot product) and the old path, each instruction with one BLAS thread as Machine.run calls it, (int8_simd.EXTENSION off for the MatMulGemms only; convolutions and
DenseGemms keep theirs), interleaved round by round, and old / ours. Checks that both give the same integers."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `examples` is not installed

from examples import images, zoo  # noqa: E402


def vit_program(folder: Path):
    from qdeploy import api
    from qdeploy.calibration import calibrate

    torchvision = zoo.import_torchvision()
    model = zoo._seeded(lambda: torchvision.models.vision_transformer.VisionTransformer(
        image_size=112, patch_size=8, num_layers=4, num_heads=3, hidden_dim=192, mlp_dim=768, num_classes=10), 0)
    path = zoo.export_model(model.eval(), (1, 3, 112, 112), folder / "vit.onnx", opset=17)
    table = calibrate(path, images.image_batch(16, seed=0, split="calib", size=112), "kl", num_samples=16,
                      batch_size=16).table
    return api.compile(path, table, allow_host_fallback=True).program


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    options = parser.parse_args(argv)

    from isa.kinds import Kind
    from qdeploy.reference.executor import run_host_op
    from qdeploy_base.threads import one_blas_thread
    from simulator.kernels import int8_simd
    from simulator.machine import Machine

    extension = int8_simd.EXTENSION
    if extension is None:
        print("this CPU has no int8 dot product Numba compiles for: nothing to compare")
        return 1
    with tempfile.TemporaryDirectory() as folder:
        program = vit_program(Path(folder))
    x = images.image_batch(options.batch, seed=1, split="eval", size=112)
    machine = Machine(program)
    machine.host = run_host_op
    feeds = {program.inputs[0]: x}
    run = machine.run(feeds, dump=True)  # also compiles the kernels
    matmuls = [instr for instr in program.instructions if instr["kind"] == Kind.MATMUL_GEMM]
    if not matmuls:
        print("the program has no MatMulGemm")
        return 1

    def with_extension(on: bool, call):
        int8_simd.EXTENSION = extension if on else None
        try:
            return call()
        finally:
            int8_simd.EXTENSION = extension

    def timed(call) -> float:
        start = time.perf_counter()
        call()
        return time.perf_counter() - start

    rows = []
    for instr in matmuls:
        args = [run.tensors[name] for name in instr["inputs"]]
        ours = with_extension(True, lambda: machine.execute(instr, args))
        old = with_extension(False, lambda: machine.execute(instr, args))
        assert np.array_equal(ours[0], old[0]) and np.array_equal(ours[1], old[1]) and ours[2] == old[2], instr["name"]
        times = {True: [], False: []}
        with one_blas_thread():  # as Machine.run calls its instructions (threaded BLAS on shared cores stalls)
            for round_ in range(options.rounds):
                for on in ((True, False) if round_ % 2 == 0 else (False, True)):
                    times[on].append(with_extension(on, lambda: timed(lambda: machine.execute(instr, args))))
        shape = " x ".join(str(tuple(a.shape)) for a in args[:2])
        rows.append((instr["name"], shape, "/".join(str(a.dtype) for a in args[:2]),
                     statistics.median(times[True]), statistics.median(times[False])))
    whole = {True: [], False: []}
    for round_ in range(options.rounds):
        for on in ((True, False) if round_ % 2 == 0 else (False, True)):
            whole[on].append(with_extension(on, lambda: timed(lambda: machine.run(feeds))))
    print(f"int8 dot product: {extension.name}; batch {options.batch}; median of {options.rounds} interleaved rounds")
    print("| MatMulGemm | operands | types | ours ms | old ms | old / ours |")
    print("|---|---|---|---:|---:|---:|")
    for name, shape, types, ours_s, old_s in rows:
        print(f"| {name} | {shape} | {types} | {1e3 * ours_s:.2f} | {1e3 * old_s:.2f} | {old_s / ours_s:.2f} |")
    ours_total, old_total = sum(r[3] for r in rows), sum(r[4] for r in rows)
    print(f"| all {len(rows)} MatMulGemms | | | {1e3 * ours_total:.1f} | {1e3 * old_total:.1f} | "
          f"{old_total / ours_total:.2f} |")
    ours_run, old_run = statistics.median(whole[True]), statistics.median(whole[False])
    print(f"| whole program run | | | {1e3 * ours_run:.1f} | {1e3 * old_run:.1f} | {old_run / ours_run:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
