# SPDX-License-Identifier: Apache-2.0
"""What the stage tests and the benchmarks share to run the applied vLLM tree
without AMD hardware: the applied tree, stand-ins for what this hardware lacks
(AITER, vLLM's compiled ops, the ROCm platform checks) grounded in their
source, batches built the way vLLM builds them, and a launcher for multi-rank
runs of a real vLLM TP group."""
