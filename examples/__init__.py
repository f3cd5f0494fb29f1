"""Examples: the real models (`examples.zoo`) and real photographs (`examples.images`) that the tests, examples
and benchmarks use. Not installed with the package; tests import it from the repository root."""
