# SPDX-License-Identifier: Apache-2.0
"""What the stage tests share: the applied tree, CPU stand-ins for what this
hardware lacks (AITER, vLLM's compiled ops, the ROCm platform checks), and a
launcher for multi-rank tests on gloo."""
