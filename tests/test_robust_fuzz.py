"""A short seeded run of the loader fuzzer (tests/fuzz/fuzz_loaders.py; the long run is not part of the default
test run): 200 mutated ONNX models and .qdp programs, each of which must load and run or fail with a user
error (exit code 2 at the CLI), within the per-case time limit."""

from fuzz.fuzz_loaders import run_fuzz


def test_seeded_fuzz_of_the_onnx_and_program_loaders(tmp_path):
    report = run_fuzz(cases=200, seed=2024, findings_dir=tmp_path / "findings")
    assert not report.findings, report.summary()
    assert report.cases == {"onnx": 100, "qdp": 100}
    # The mutations are not all refused at the first byte: some damaged files still load, compile and run.
    assert report.outcomes["onnx: compiled and ran"] > 0 and report.outcomes["qdp: read and ran"] > 0, \
        report.summary()
