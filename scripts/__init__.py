# SPDX-License-Identifier: Apache-2.0
"""The series tool (``series``), the stand-ins that run the applied tree
without AMD hardware (``harness``), the benchmarks (``bench``) and the MI355X
validation kit (``validate``)."""
