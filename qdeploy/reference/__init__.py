"""Float reference executor: runs an IR graph in numpy, op by op, following the ONNX operator specs.

It is the meaning every later stage is compared against (lowering must reproduce it; calibration reads the
lowered graph through it). Each op is a plain function `op(*inputs, **attributes)`; see `ops.OPS`."""

from qdeploy.reference.executor import run_graph, run_host_op, run_node, run_signature, supported_ops

__all__ = ["run_graph", "run_host_op", "run_node", "run_signature", "supported_ops"]
