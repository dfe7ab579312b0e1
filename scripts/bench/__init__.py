# SPDX-License-Identifier: Apache-2.0
"""Benchmarks of the stages (results under docs/); what they share is in
``common``, the stand-ins they run on in ``scripts.harness``."""
